"""`offload.engine=jax`: the same placements made by JAX's own offload (`jax.checkpoint` with
`save_and_offload_only_these_names`), the baseline the TPU benchmark measures ferry against. Its
gradients equal save_all's, and it really moves the offloaded tensors to host."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest

from ferry.offload.engine import LAYER_INPUT, Policy, PolicyError
from ferry.train.step import LossSettings, batch_loss
from tests.conftest import preset_policy
from tests.engine.test_presets import jitted_loss_grad, model_and_batch
from tests.placements import count_device_puts


def jax_engine_grad(model, batch, preset: str):
    policy = dataclasses.replace(preset_policy(preset, model), engine="jax")
    settings = LossSettings(policy, "float32")
    return eqx.filter_grad(lambda m: batch_loss(m, batch, settings)[0])(model)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "loop"])
@pytest.mark.parametrize("preset", ["minimal_offloaded", "qkv_offload", "full_remat"])
def test_gradients_equal_save_all(preset, scan_layers):
    model, batch = model_and_batch(scan_layers)
    expected = jitted_loss_grad(model, batch, "save_all")
    got = eqx.filter_jit(jax_engine_grad)(model, batch, preset)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_offloads_through_jax_not_ferry():
    """JAX's remat moves the residuals it keeps of the offloaded names to host and back (those
    the backward pass reads: never more than ferry moves), and ferry's pipelined scan is not used."""
    model, batch = model_and_batch(True)
    policy = preset_policy("minimal_offloaded", model)
    offloaded = sum(policy.placement(name) == "offload" for name in model.tagged_names())
    jaxpr = jax.make_jaxpr(lambda m: jax_engine_grad(m, batch, "minimal_offloaded"))(model).jaxpr
    to_host = count_device_puts(jaxpr, "pinned_host") + str(jaxpr).count("<host>")
    assert 0 < str(jaxpr).count("device_put") <= 2 * offloaded
    assert to_host > 0
    assert "remat" in str(jaxpr)
    assert not Policy({"mlpwo": "offload"}, engine="jax").pipelined_by_ferry


def test_layer_input_offload_is_refused():
    with pytest.raises(PolicyError, match="engine 'jax' cannot offload decoder_layer_input"):
        Policy({LAYER_INPUT: "offload"}, engine="jax")
    with pytest.raises(PolicyError, match="engine is 'torch'"):
        Policy({}, engine="torch")
