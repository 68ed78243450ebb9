"""The gradient self-check (`train.check_policy`): every preset passes on both tiny models, a broken
engine is caught naming the layer group and the difference, and the launcher refuses with exit
status 2 before anything is written."""

import dataclasses
import functools
import io
import re

import jax
import pytest
from rich.console import Console

import ferry.offload.engine
import ferry.offload.scan
from ferry.models.registry import abstract_model
from ferry.offload.engine import Policy
from ferry.run.policy_check import (
    CHECK_LAYERS,
    TOLERANCE,
    PolicyCheckError,
    check_before_training,
    check_enabled,
    check_model_config,
    check_policy,
)
from tests.conftest import MOE_ONLY_PRESETS, PRESETS, compose_config, load_model_config, preset_policy, run_python

SEQ = 16
GROUPS = {"llama_tiny": [("decoder",)], "deepseek_v3_tiny": [("dense",), ("moe", "mtp_1")]}
# DeepSeek's MoE layers take 10-30 s a preset to compile on two shared cores: by default the
# presets that offload (every tagged tensor, or the experts'), all of them with `-m slow` and in
# `python benchmarks/gpu_check.py`
FAST_DEEPSEEK = {"minimal_offloaded", "moe_offload"}
CASES = [
    pytest.param(
        model, preset, marks=[pytest.mark.slow] if model != "llama_tiny" and preset not in FAST_DEEPSEEK else []
    )
    for model in GROUPS
    for preset in PRESETS
    if preset != "save_all" and not (model == "llama_tiny" and preset in MOE_ONLY_PRESETS)
]


@functools.cache
def model_config(name: str):
    return load_model_config(name)


def policy_of(model: str, preset: str) -> Policy:
    return preset_policy(preset, abstract_model(model_config(model)))


@pytest.mark.parametrize(("model", "preset"), CASES)
def test_every_preset_passes_on_both_tiny_models(model, preset):
    results = check_policy(model_config(model), policy_of(model, preset), seq_len=SEQ, policy_name=preset)
    assert [r.groups for r in results] == GROUPS[model]
    for result in results:
        assert result.ok and result.worst.relative <= TOLERANCE, result.describe()
        assert not result.narrowed


def test_save_all_is_its_own_reference():
    assert check_policy(model_config("llama_tiny"), Policy.save_all()) == []


@pytest.fixture
def broken_restore(monkeypatch):
    """An engine whose copy back from host memory returns each value 0.1% off (the size of error a
    misplaced host read gives is far larger); compiled programs cached before or after are
    dropped, so no test sees another's."""
    restore = ferry.offload.engine.to_memory

    def off_by_a_little(x, memory_kind, *args, **kwargs):
        out = restore(x, memory_kind, *args, **kwargs)
        return out * 1.001 if memory_kind == "device" else out

    jax.clear_caches()
    monkeypatch.setattr(ferry.offload.engine, "to_memory", off_by_a_little)  # per-layer engine
    monkeypatch.setattr(ferry.offload.scan, "to_memory", off_by_a_little)  # pipelined stacks
    yield
    jax.clear_caches()


def test_a_broken_restore_is_refused_naming_the_group_and_the_difference(broken_restore):
    policy = policy_of("deepseek_v3_tiny", "moe_offload")  # only the MoE layers offload anything
    with pytest.raises(PolicyCheckError) as refusal:
        check_policy(model_config("deepseek_v3_tiny"), policy, seq_len=SEQ, policy_name="moe_offload")
    first_line = str(refusal.value).splitlines()[0]
    assert f"offload policy 'moe_offload' compiled by jax {jax.__version__}" in first_line
    assert f"{CHECK_LAYERS} stacked moe/mtp_1 layers" in first_line
    assert "dense" not in first_line  # the dense layers offload nothing and agree
    assert "differs by" in first_line and "of its largest magnitude" in first_line
    assert "train.check_policy=false" in str(refusal.value)


def test_a_broken_restore_of_every_tensor_is_refused_on_llama(broken_restore):
    with pytest.raises(PolicyCheckError, match=r"3 stacked decoder layers .* differs by [0-9.e-]+, [0-9.e-]+ of its"):
        check_policy(model_config("llama_tiny"), policy_of("llama_tiny", "minimal_offloaded"), seq_len=SEQ)


def test_a_peeled_policy_is_checked_on_a_stack_it_peels(broken_restore):
    """`offload.peel=2` runs the first layer and the last two outside the loop: the check stacks
    5, so that the program it compiles has the loop of a deep stack, and refuses a broken restore
    there."""
    policy = dataclasses.replace(policy_of("llama_tiny", "minimal_offloaded"), peel=2)
    with pytest.raises(PolicyCheckError, match=r"5 stacked decoder layers .* differs by"):
        check_policy(model_config("llama_tiny"), policy, seq_len=SEQ)


@pytest.mark.parametrize(
    ("overrides", "enabled"),
    [
        ((), False),
        (("platform=gpu",), True),
        (("platform=tpu",), True),
        (("train.check_policy=true",), True),
        (("platform=gpu", "train.check_policy=false"), False),
    ],
)
def test_on_by_default_for_gpu_and_tpu_only(overrides, enabled):
    assert check_enabled(compose_config(*overrides)) is enabled


def test_a_model_too_wide_for_one_device_is_checked_at_tiny_widths_with_its_own_structure():
    full = load_model_config("deepseek_v3")
    narrowed, was_narrowed = check_model_config(full)
    tiny = model_config("deepseek_v3_tiny")
    assert was_narrowed
    assert (narrowed.dim, narrowed.num_experts, narrowed.moe_mlp_dim) == (tiny.dim, tiny.num_experts, tiny.moe_mlp_dim)
    kept = ("num_layers", "num_dense_layers", "mtp_depth", "moe_tile_rows", "moe_tag_capacity_factor", "scan_layers")
    assert {k: getattr(narrowed, k) for k in kept} == {k: getattr(full, k) for k in kept}
    assert check_model_config(tiny) == (tiny, False)
    small = dataclasses.replace(tiny, dim=128)
    assert check_model_config(small) == (small, False)


def test_the_launcher_refuses_a_broken_engine_with_status_2(tmp_path):
    """`python launch/run.py train.check_policy=true` with an engine whose restore is wrong: a
    one-line refusal, exit 2, before the run directory exists."""
    run_dir = tmp_path / "run"
    code = f"""
import runpy, sys
import ferry.offload.engine
import ferry.offload.scan
restore = ferry.offload.engine.to_memory
ferry.offload.engine.to_memory = lambda x, kind, *a, **k: restore(x, kind, *a, **k) * (1.001 if kind == "device" else 1)
ferry.offload.scan.to_memory = ferry.offload.engine.to_memory
sys.argv = ["launch/run.py", "train.check_policy=true", "train.seq_len={SEQ}", "data=synthetic", "run.dir={run_dir}",
            "offload=minimal_offloaded"]  # an offloading preset: the broken restore is on its path
runpy.run_path("launch/run.py", run_name="__main__")
"""
    result = run_python(code, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the gradient self-check failed: offload policy 'minimal_offloaded'" in result.stdout
    assert "3 stacked decoder layers" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert not run_dir.exists()


def test_the_386m_llama_is_checked_at_tiny_widths_and_the_start_up_line_says_what_it_cost():
    """The model issue 45 timed on a v5e (dim 2048, MLP 8192: 756 MB of float32 stack, 60 s of
    check at its own widths, nearly all compiling) is checked at llama_tiny's widths with its own
    structure; the start-up line gives the check's seconds and the compiling share."""
    shape = ("model=llama3_1_8b", "model.dim=2048", "model.num_heads=16", "model.num_kv_heads=8")
    config = compose_config(*shape, "model.mlp_dim=8192", "model.num_layers=4", "train.check_policy=true")
    narrowed, was_narrowed = check_model_config(config.model)
    tiny = model_config("llama_tiny")
    assert was_narrowed and (narrowed.dim, narrowed.mlp_dim, narrowed.head_dim) == (
        tiny.dim,
        tiny.mlp_dim,
        tiny.head_dim,
    )
    assert (narrowed.num_layers, narrowed.scan_layers) == (4, config.model.scan_layers)

    out = io.StringIO()
    policy = policy_of("llama_tiny", "minimal_offloaded")
    tiny_run = dataclasses.replace(config, model=tiny)
    (result,) = check_before_training(tiny_run, policy, Console(file=out, width=1000))
    line = out.getvalue().strip()
    assert re.search(r"passed in [0-9.]+ s \([0-9.]+ s compiling; train.check_policy=false skips it\)", line), line
    assert 0 < result.compile_seconds <= result.seconds
    assert "s of it compiling the two programs" in result.describe()
