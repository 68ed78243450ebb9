"""The engine on layers that are not ferry's: gradients, placement, and errors."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.offload.engine import LAYER_INPUT, Policy, PolicyError, offloaded, tag, tagged_names
from ferry.offload.schedule import transfer_schedule
from tests.placements import count_device_puts


class GatedResidualBlock(eqx.Module):
    """A layer written here, not in ferry: tagging is all it takes to make it offloadable."""

    w_in: jax.Array
    w_gate: jax.Array
    w_out: jax.Array

    def __init__(self, dim: int, hidden: int, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_in = jax.random.normal(k1, (dim, hidden)) / np.sqrt(dim)
        self.w_gate = jax.random.normal(k2, (dim, hidden)) / np.sqrt(dim)
        self.w_out = jax.random.normal(k3, (hidden, dim)) / np.sqrt(hidden)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = tag(jnp.tanh(x @ self.w_in), "block_in")
        g = tag(jax.nn.sigmoid(x @ self.w_gate), "block_gate")
        return x + tag((h * g) @ self.w_out, "block_out")


def stacked_blocks(num_layers=3, dim=8, hidden=16):
    keys = jax.random.split(jax.random.key(0), num_layers)
    return eqx.filter_vmap(lambda k: GatedResidualBlock(dim, hidden, k))(keys)


def scanned_loss(blocks, x, policy):
    run = offloaded(lambda block, h: block(h), policy)
    dynamic, static = eqx.partition(blocks, eqx.is_array)
    h, _ = jax.lax.scan(lambda h, d: (run(eqx.combine(d, static), h), None), x, dynamic)
    return jnp.sum(jnp.sin(h))


POLICIES = {
    "everything remat": {},
    "offload all": {LAYER_INPUT: "offload", "block_in": "offload", "block_gate": "offload", "block_out": "offload"},
    "mixed": {"block_in": "offload", "block_gate": "device"},
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_custom_layer_gradients_equal_save_all(name):
    blocks, x = stacked_blocks(), jax.random.normal(jax.random.key(1), (4, 8))
    grad = eqx.filter_jit(eqx.filter_grad(scanned_loss))
    expected = grad(blocks, x, Policy.save_all())
    got = grad(blocks, x, Policy.from_dict(POLICIES[name]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_custom_layer_is_offloaded_where_the_policy_says():
    blocks, x = stacked_blocks(), jax.random.normal(jax.random.key(1), (4, 8))
    policy = Policy.from_dict({"block_in": "offload", "block_out": "offload", "block_gate": "device"})
    jaxpr = jax.make_jaxpr(lambda b, x: eqx.filter_grad(scanned_loss)(b, x, policy))(blocks, x)
    assert count_device_puts(jaxpr.jaxpr, "pinned_host") == 2
    assert count_device_puts(jaxpr.jaxpr, "device") == 2


def test_tag_is_the_identity_outside_offloaded():
    x = jnp.arange(3.0)
    assert tag(x, "anything") is x


def test_tagged_names_are_found_abstractly():
    block = GatedResidualBlock(8, 16, jax.random.key(0))
    names = tagged_names(lambda b, h: b(h), block, jax.ShapeDtypeStruct((2, 8), jnp.float32))
    assert names == {LAYER_INPUT, "block_in", "block_gate", "block_out"}


def test_unknown_name_is_an_error_listing_the_tagged_names():
    block = GatedResidualBlock(8, 16, jax.random.key(0))
    policy = Policy.from_dict({"block_inn": "offload"})
    with pytest.raises(PolicyError, match=r"block_inn.*never tags.*block_gate, block_in, block_out"):
        transfer_schedule(lambda b, h: b(h), block, jax.ShapeDtypeStruct((2, 8), jnp.float32), policy, 1)
    with pytest.raises(PolicyError, match="never tags"):
        jax.grad(lambda b: jnp.sum(offloaded(lambda p, h: p(h), policy)(b, jnp.ones((2, 8)))))(block)


def test_bad_placement_is_an_error():
    with pytest.raises(PolicyError, match=r"'mlpwo' has placement 'host'.*device, offload, remat"):
        Policy.from_dict({"mlpwo": "host"})


def test_layer_input_cannot_be_rematerialised():
    with pytest.raises(PolicyError, match="decoder_layer_input cannot be rematerialised"):
        Policy.from_dict({LAYER_INPUT: "remat"})


def test_pytree_params_and_outputs():
    """Any pytree of params in, any pytree of arrays out (here: a dict and an auxiliary scalar)."""

    def layer(params, x):
        h = tag(x @ params["w"], "h")
        return {"y": jnp.tanh(h) + params["b"], "aux": jnp.mean(h**2)}

    params = {"w": jax.random.normal(jax.random.key(0), (5, 5)), "b": jnp.ones(5), "scale": 2}
    x = jax.random.normal(jax.random.key(1), (3, 5))

    def loss(inputs, policy):
        params, x = inputs
        out = offloaded(layer, policy)(params, x)
        return jnp.sum(out["y"] ** 2) + out["aux"]

    want = eqx.filter_grad(loss)((params, x), Policy.save_all())
    for policy in (Policy.from_dict({"h": "offload"}), Policy.from_dict({})):
        got = eqx.filter_grad(loss)((params, x), policy)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_policy_is_an_immutable_mapping():
    policy = Policy.from_dict({"block_in": "offload", LAYER_INPUT: "offload"})
    assert dict(policy) == {"block_in": "offload", LAYER_INPUT: "offload"}
    assert policy["block_in"] == "offload" and len(policy) == 2 and "block_out" not in policy
    assert policy.placement("block_out") == "remat"
    assert Policy.from_dict({}).placement(LAYER_INPUT) == "device"
    assert policy == Policy.from_dict({LAYER_INPUT: "offload", "block_in": "offload"})
    assert hash(policy) == hash(Policy.from_dict({LAYER_INPUT: "offload", "block_in": "offload"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.placements = ()
