"""DeepSeek-V3 on its tiny config: every preset's gradients equal save_all's, and the published
sizes."""

import dataclasses
import functools

import equinox as eqx
import jax
import numpy as np
import pytest

from ferry.models.deepseek_v3 import DeepSeekV3
from ferry.models.registry import parameter_count, size_summary
from ferry.train.step import LossSettings, batch_loss
from tests.conftest import PRESETS, load_model_config, preset_policy
from tests.placements import count_device_puts


@functools.cache
def tiny(scan_layers: bool = True, **overrides):
    config = load_model_config("deepseek_v3_tiny", scan_layers=scan_layers, **overrides)
    model = DeepSeekV3(config, key=jax.random.key(0))
    # Non-zero correction biases, so selection differs from plain top-k on the scores.
    model = eqx.tree_at(
        lambda m: m.moe_layers.layers.mlp.correction_bias,
        model,
        0.05 * jax.random.normal(jax.random.key(2), model.moe_layers.layers.mlp.correction_bias.shape),
    )
    batch = jax.random.randint(jax.random.key(1), (2, 17), 0, config.vocab_size)
    return model, batch


def loss_grad(model, batch, preset):
    settings = LossSettings(preset_policy(preset, model), "float32")
    return eqx.filter_grad(lambda m: batch_loss(m, batch, settings)[0])(model)


jitted_loss_grad = eqx.filter_jit(loss_grad)  # one cache: save_all compiles once per model


@eqx.filter_jit  # one compile of the forward pass per model, not DeepSeek's every op run eagerly
def training_loss(model, batch, preset):
    return model.training_loss(batch, preset_policy(preset, model))


def test_published_parameter_counts():
    config = load_model_config("deepseek_v3")
    assert parameter_count(dataclasses.replace(config, mtp_depth=0)) == 671_026_419_200
    assert parameter_count(config) == 682_636_487_424
    assert size_summary(config) == "682.64B parameters (671.03B without MTP)"


# full_remat and qkv_offload place tags as the others do, in other combinations (each compile of
# DeepSeek's gradient takes 15-20 s): every tag rematerialised in decoder_input_offload, Q/K/V
# offloaded with the rest in minimal_offloaded, offloads beside remat in moe_offload
SLOW_PRESETS = {"full_remat", "qkv_offload"}


@pytest.mark.parametrize(
    "preset", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PRESETS else p for p in PRESETS]
)
def test_gradients_equal_save_all(preset):
    model, batch = tiny()
    expected = jitted_loss_grad(model, batch, "save_all")
    got = jitted_loss_grad(model, batch, preset)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gradients_equal_save_all_without_scan():
    model, batch = tiny(scan_layers=False)
    expected = jitted_loss_grad(model, batch, "save_all")
    got = jitted_loss_grad(model, batch, "minimal_offloaded")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_moe_offload_moves_the_routed_expert_inputs():
    """Two tensors per traced MoE layer: the scanned MoE body and the MTP block."""
    model, batch = tiny()
    jaxpr = jax.make_jaxpr(lambda m: loss_grad(m, batch, "moe_offload"))(model).jaxpr
    assert count_device_puts(jaxpr, "pinned_host") == 2 * 2
    assert count_device_puts(jaxpr, "device") == 2 * 2


def test_model_tags_mla_and_moe_names():
    model, _ = tiny()
    assert {
        "query_wa_proj",
        "mla_q",
        "kv_wa_proj",
        "mla_kv",
        "moe_mlpwi_0",
        "moe_mlpwi_1",
        "moe_mlpwo",
        "query_proj",
        "key_proj",
        "value_proj",
        "attention_out",
        "attention_lse",  # declared on every backend; the CPU's xla path tags none
        "out_proj",
        "mlpwi_0",
        "mlpwi_1",
        "mlpwo",
        "decoder_layer_input",
    } == model.tagged_names()


def test_mtp_adds_lambda_times_its_loss():
    """Switching MTP off leaves the main loss unchanged and removes lambda x the MTP loss (and
    the MTP block's balance term)."""
    with_mtp, batch = tiny()
    without = DeepSeekV3(dataclasses.replace(with_mtp.config, mtp_depth=0), key=jax.random.key(0))
    without = eqx.tree_at(
        lambda m: m.moe_layers.layers.mlp.correction_bias, without, with_mtp.moe_layers.layers.mlp.correction_bias
    )
    loss_on, on = training_loss(with_mtp, batch, "minimal_offloaded")
    loss_off, off = training_loss(without, batch, "minimal_offloaded")
    np.testing.assert_allclose(on["loss"], off["loss"], rtol=1e-6)
    assert "mtp_loss" in on and "mtp_loss" not in off
    config = with_mtp.config
    balance_mtp = on["balance_loss"] - off["balance_loss"]
    np.testing.assert_allclose(
        loss_on - loss_off,
        config.mtp_loss_weight * on["mtp_loss"] + config.balance_loss_weight * balance_mtp,
        rtol=1e-5,
    )
    assert config.mtp_loss_weight == 0.3 and float(on["mtp_loss"]) > 0


def test_after_step_moves_every_router_bias():
    model, batch = tiny()
    _, stats = training_loss(model, batch, "save_all")
    updated = model.after_step(stats)
    load = np.asarray(stats["moe_expert_load"])
    change = np.asarray(updated.moe_layers.layers.mlp.correction_bias - model.moe_layers.layers.mlp.correction_bias)
    rate = model.config.bias_update_rate
    np.testing.assert_allclose(change, rate * np.sign(load.mean(axis=-1, keepdims=True) - load), atol=1e-7)
    mtp_change = updated.mtp[0].block.mlp.correction_bias - model.mtp[0].block.mlp.correction_bias
    assert np.abs(np.asarray(mtp_change)).max() == pytest.approx(rate)
