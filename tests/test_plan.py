"""The planner compiles the real train step for an H200 without one (compile-only devices of the
CUDA plugin) and reads the compiled memory: offloads land in pinned host memory, never dropped."""

import dataclasses
import importlib.util

import pytest

from ferry import offload
from ferry.models.registry import abstract_model
from ferry.plan.planner import PlanError, plan_memory
from ferry.plan.targets import GPU_TARGETS
from tests.conftest import compose_config, load_preset, run_launcher

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason='the planner needs the CUDA plugin: pip install -e ".[plan]"',
)
H200 = GPU_TARGETS["h200"]


def plan(model: str, preset: str, **kwargs):
    config = compose_config(f"model={model}", f"offload={preset}", "train.seq_len=256")
    policy = load_preset(preset).policy(abstract_model(config.model).tagged_names())
    return plan_memory(config, H200, policy, preset, **kwargs)


def test_llama_presets_on_h200():
    plans = {preset: plan("llama_tiny", preset) for preset in ("save_all", "full_remat", "minimal_offloaded")}
    assert plans["minimal_offloaded"].host_bytes > 0
    assert plans["save_all"].host_bytes == plans["full_remat"].host_bytes == 0
    assert plans["full_remat"].temp_bytes < plans["minimal_offloaded"].temp_bytes < plans["save_all"].temp_bytes
    # matmul FLOPs counted from the GPU program, layer loop included: recomputing the layer shows
    assert plans["full_remat"].flops > plans["minimal_offloaded"].flops > plans["save_all"].flops > 0
    measured = plans["save_all"]
    assert measured.fits and measured.capacity_bytes == H200.hbm_bytes
    assert not dataclasses.replace(measured, capacity_bytes=measured.device_bytes - 1).fits


def test_deepseek_moe_offload_lands_in_host_memory():
    assert plan("deepseek_v3_tiny", "moe_offload").host_bytes > 0


def test_a_dropped_offload_is_an_error(monkeypatch):
    """Were the engine to place with a pinned_host NamedSharding on compile-only devices, JAX
    would silently keep the values on device; the planner refuses such a program."""
    monkeypatch.setattr(offload, "has_memory_kinds", lambda mesh: True)
    with pytest.raises(PlanError, match="keeps no bytes in pinned host memory: the offload was dropped"):
        plan("llama_tiny", "minimal_offloaded")


def test_launcher_plans_and_flips_the_verdict(tmp_path):
    common = ("mode=plan", "target=h200", "train.seq_len=256", "plan.presets=[save_all]")
    result = run_launcher(*common, "plan.capacity_gib=0.01", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "OOM" in result.stdout and "FITS" not in result.stdout
    assert (tmp_path / "run" / "plan.json").exists()
