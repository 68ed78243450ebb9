"""Every offload preset (each file of configs/offload/, read from there) on llama_tiny: the gradients
of the full train loss equal save_all's, the jaxpr moves exactly the offloaded tensors, and the
compiled FLOPs show recompute avoided; each preset file keeps only what differs from _base.yaml."""

import dataclasses
import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

from ferry.config.overrides import compose_node, config_groups, group_presets, prepared_overrides, preset_node
from ferry.errors import ConfigError
from ferry.models.dense import DenseDecoder
from ferry.models.registry import abstract_model
from ferry.nn.kernels.flash import ATTENTION_LSE
from ferry.offload.engine import PolicyError
from ferry.offload.schedule import model_schedule
from ferry.train.step import LossSettings, batch_loss
from ferry.xla.hlo_flops import matmul_flops
from tests.conftest import CONFIGS, MOE_ONLY_PRESETS, PRESETS, ROOT, load_model_config, preset_policy
from tests.placements import count_device_puts


@functools.cache
def model_and_batch(scan_layers: bool):
    config = load_model_config("llama_tiny", scan_layers=scan_layers, num_layers=3)
    model = DenseDecoder(config, key=jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (2, 33), 0, config.vocab_size)
    return model, batch


LLAMA_PRESETS = [p for p in PRESETS if p not in MOE_ONLY_PRESETS]


def loss_grad(model, batch, preset: str, pipelined: bool = True):
    policy = dataclasses.replace(preset_policy(preset, model), pipelined=pipelined)
    settings = LossSettings(policy, "float32")
    return eqx.filter_grad(lambda m: batch_loss(m, batch, settings)[0])(model)


jitted_loss_grad = eqx.filter_jit(loss_grad)  # one cache: save_all compiles once per model


@functools.cache
def compiled(preset: str, scan_layers: bool = True, pipelined: bool = True):
    model, batch = model_and_batch(scan_layers)
    return jax.jit(lambda m, b: loss_grad(m, b, preset, pipelined)).lower(model, batch).compile()


def test_presets_are_the_documented_ones():
    """The presets are the files of configs/offload/, and the engine page's table names each."""
    table = (ROOT / "docs" / "concepts" / "engine.md").read_text().split("| preset | what it does |")[1]
    documented = re.findall(r"^\| `(\w+)` \|", table.split("\n\n")[0], re.MULTILINE)
    assert sorted(documented) == PRESETS and len(PRESETS) >= 7


@pytest.mark.parametrize("preset", group_presets(CONFIGS / "offload"))
def test_a_preset_file_keeps_only_what_differs(preset):
    """A preset says what it is for and inherits the shared keys from _base.yaml (Hydra's defaults
    list); each key it sets is its name or differs from the base, so the base is the one place a
    shared key and its comment live."""
    text = (CONFIGS / "offload" / f"{preset}.yaml").read_text()
    assert text.startswith("# "), f"{preset}.yaml opens with no comment saying what it is for"
    own = OmegaConf.to_container(OmegaConf.create(text))
    base = OmegaConf.to_container(OmegaConf.load(CONFIGS / "offload" / "_base.yaml"))
    assert own.pop("defaults") == ["_base", "_self_"] and own.pop("name") == preset
    assert not [key for key, value in own.items() if base.get(key) == value]
    assert preset_node(CONFIGS, "offload", preset) == base | {"name": preset} | own


@pytest.mark.parametrize("preset", group_presets(CONFIGS / "offload"))
def test_a_preset_loads_as_a_run_composes_it(preset):
    """The planner's `load_preset` and a run's `offload=NAME` read the same keys."""
    assert preset_node(CONFIGS, "offload", preset) == compose_node("train", [f"offload={preset}"], CONFIGS)["offload"]


def test_the_base_is_no_preset():
    assert "_base" not in config_groups(CONFIGS)["offload"] and (CONFIGS / "offload" / "_base.yaml").is_file()
    with pytest.raises(ConfigError, match=r"offload=_base: .* starts with _ .* is not a preset; choose one of "):
        prepared_overrides(["offload=_base"], CONFIGS)
    with pytest.raises(ConfigError, match="no offload preset '_base'"):
        preset_node(CONFIGS, "offload", "_base")


def test_moe_preset_is_refused_for_llama():
    model, batch = model_and_batch(True)
    with pytest.raises(PolicyError, match=r"moe_mlpwi_0.*never tags.*it tags: attention_lse, attention_out"):
        loss_grad(model, batch, "moe_offload")


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "loop"])
@pytest.mark.parametrize("preset", LLAMA_PRESETS)
def test_gradients_equal_save_all(preset, scan_layers):
    model, batch = model_and_batch(scan_layers)
    expected = jitted_loss_grad(model, batch, "save_all")
    got = jitted_loss_grad(model, batch, preset)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "loop"])
@pytest.mark.parametrize("preset", LLAMA_PRESETS)
def test_jaxpr_moves_exactly_the_offloaded_tensors(preset, scan_layers):
    model, batch = model_and_batch(scan_layers)
    policy = preset_policy(preset, model)
    # on the CPU attention is the xla path, which tags no log-sum-exp (the model declares one)
    tagged = model.tagged_names() - {ATTENTION_LSE}
    offloaded_per_layer = sum(policy.placement(name) == "offload" for name in tagged)
    # One traced layer body under scan; every layer traced separately without it.
    traced_layers = 1 if scan_layers else model.config.num_layers
    jaxpr = jax.make_jaxpr(lambda m: loss_grad(m, batch, preset))(model).jaxpr
    assert count_device_puts(jaxpr, "pinned_host") == offloaded_per_layer * traced_layers
    assert count_device_puts(jaxpr, "device") == offloaded_per_layer * traced_layers


def test_presets_that_offload_do_offload():
    expected = {"qkv_offload": 3, "minimal_offloaded": 9, "decoder_input_offload": 1}  # 9: attention_lse too
    model, _ = model_and_batch(True)
    for preset, count in expected.items():
        policy = preset_policy(preset, model)
        assert sum(policy.placement(n) == "offload" for n in model.tagged_names()) == count


def flops(preset: str) -> float:
    return compiled(preset).cost_analysis()["flops"]


def test_saving_matmul_outputs_avoids_recompute():
    base = flops("save_all")
    assert flops("minimal") <= 1.02 * base
    assert flops("minimal_offloaded") <= 1.02 * base


def test_full_remat_recomputes():
    assert flops("full_remat") > 1.15 * flops("save_all")


def test_offload_equals_device_in_flops():
    """Placing a residual on host instead of HBM must not change what is computed: the same
    matrix products and the same transcendentals. (XLA's total `flops` also counts the scalar
    loop-index arithmetic it clones into each fusion that slices a loop input, which differs
    with how the stack's loops carry their residuals, not with what they compute.)"""
    offloaded, on_device = compiled("minimal_offloaded"), compiled("minimal")
    assert matmul_flops(offloaded.as_text()) == matmul_flops(on_device.as_text()) > 0
    assert offloaded.cost_analysis()["transcendentals"] == on_device.cost_analysis()["transcendentals"] > 0


@functools.cache
def llama_8b_flops(preset: str) -> float:
    """Compiled FLOPs of the bf16 train-loss gradient at Llama 3.1 8B's real layer shapes (two
    layers, one sequence of 2048), compiled from abstract shapes: nothing is allocated."""
    model = abstract_model(load_model_config("llama3_1_8b", num_layers=2))
    batch = jax.ShapeDtypeStruct((1, 2049), jnp.int32)
    settings = LossSettings(preset_policy(preset, model), "bfloat16")
    grad = jax.jit(lambda m, b: eqx.filter_grad(lambda m: batch_loss(m, b, settings)[0])(m))
    return grad.lower(model, batch).compile().cost_analysis()["flops"]


def test_recompute_at_llama_8b_shapes():
    """With attention short next to the projections, as in real models, saving the matmul
    outputs leaves only the QK^T scores and elementwise work to recompute."""
    base = llama_8b_flops("save_all")
    assert llama_8b_flops("minimal") <= 1.02 * base
    assert llama_8b_flops("minimal_offloaded") <= 1.02 * base
    assert llama_8b_flops("full_remat") > 1.05 * base


def temp_bytes(preset: str, pipelined: bool = True) -> int:
    return compiled(preset, pipelined=pipelined).memory_analysis().temp_size_in_bytes


def test_remat_lowers_compiled_temp_memory():
    """Deterministic memory of the compiled CPU program: recompute frees residuals, while
    offloading is an identity on the CPU backend and so frees nothing here. Pipelining the copies
    adds its buffers: one layer's offloaded values carried through each loop (whose carry XLA's
    CPU loops keep a second copy of while a layer runs): at most two layers' worth."""
    assert temp_bytes("full_remat") < temp_bytes("minimal") < temp_bytes("save_all")
    assert temp_bytes("minimal_offloaded", pipelined=False) == temp_bytes("minimal", pipelined=False)
    model, batch = model_and_batch(True)
    rows, seq = batch.shape[0], batch.shape[1] - 1
    policy = preset_policy("minimal_offloaded", model)
    layer = model_schedule(model, policy, rows, seq, jnp.float32).pipeline_bytes
    assert layer == rows * seq * 4 * (64 + 32 + 32 + 64 + 64 + 192 + 192 + 64)  # llama_tiny's 8 offloaded tensors
    assert temp_bytes("minimal") < temp_bytes("minimal_offloaded") <= temp_bytes("minimal") + 2 * layer
