"""The contract between a user's layer and the offload engine: what a layer may tag, where, and
what the engine refuses, each with the message that says what to change."""

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from ferry.nn.stack import LayerStack
from ferry.offload import tags as offload_tags
from ferry.offload.engine import NestedTagError, Policy, PolicyError, offloaded, tag

POLICIES = ({"h": "offload"}, {"h": "device"}, {})


def assert_trees_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_policy_is_built_from_a_mapping():
    policy = Policy({"mix_in": "offload", "mix_out": "device"})
    assert policy == Policy.from_dict({"mix_out": "device", "mix_in": "offload"})
    assert dict(policy) == {"mix_in": "offload", "mix_out": "device"}
    assert hash(policy) == hash(Policy((("mix_out", "device"), ("mix_in", "offload"))))
    with pytest.raises(PolicyError, match="'mix_in' has placement 'host'"):
        Policy({"mix_in": "host"})


class InnerScanLayer(eqx.Module):
    """Tags a value inside its own `lax.scan`: a value of the inner loop's trace."""

    w: jax.Array

    def __call__(self, x):
        def step(h, _):
            return tag(h @ self.w, "inner"), None

        return jax.lax.scan(step, x, None, length=2)[0]


class InnerCheckpointLayer(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jax.checkpoint(lambda h: jnp.tanh(tag(h @ self.w, "inner")))(x)


@pytest.mark.parametrize("layer_type", [InnerScanLayer, InnerCheckpointLayer])
@pytest.mark.parametrize("placement", ["offload", "device", "remat"])
def test_a_tag_inside_an_inner_transformation_is_refused_naming_it(layer_type, placement):
    layer = layer_type(jnp.eye(4))
    run = offloaded(lambda m, h: m(h), Policy({"inner": placement}), check_names=False)
    with pytest.raises(NestedTagError, match=r"tag 'inner' sits inside a transformation nested in the layer"):
        jax.grad(lambda m: jnp.sum(run(m, jnp.ones((2, 4)))))(layer)


class Permute(eqx.Module):
    """A layer holding an integer array (a permutation of its features), which is not trained."""

    w: jax.Array
    order: jax.Array

    def __call__(self, x):
        h = tag(x[..., self.order] @ self.w, "h")
        return x + jnp.tanh(h)


def test_integer_arrays_of_a_layer_work_in_a_layer_stack():
    def make(key):
        return Permute(jax.random.normal(key, (4, 4)) / 2, jax.random.permutation(key, 4))

    stack = LayerStack(make, 3, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 4))

    def loss(s, policy):
        return jnp.sum(jnp.sin(s(x, policy)[0]))

    want = eqx.filter_grad(loss)(stack, Policy.save_all())
    for placements in POLICIES:
        assert_trees_close(eqx.filter_grad(loss)(stack, Policy(placements)), want)


def test_extra_inputs_reach_every_layer_undifferentiated():
    """`LayerStack(x, policy, *extra)`: e.g. segment ids every layer reads."""

    class Masked(eqx.Module):
        w: jax.Array

        def __call__(self, x, keep):
            return x + jnp.where(keep[..., None], tag(x @ self.w, "h"), 0.0)

    stack = LayerStack(lambda k: Masked(jax.random.normal(k, (4, 4)) / 2), 3, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 4))
    keep = jnp.arange(10).reshape(2, 5) % 3 != 0

    def loss(s, policy):
        return jnp.sum(jnp.sin(s(x, policy, keep)[0]))

    want = eqx.filter_grad(loss)(stack, Policy.save_all())
    for placements in POLICIES:
        assert_trees_close(eqx.filter_grad(loss)(stack, Policy(placements)), want)


def test_a_layer_stack_refuses_a_misspelt_name_listing_its_tags():
    stack = LayerStack(lambda k: Permute(jnp.eye(4), jnp.arange(4)), 2, key=jax.random.key(0))
    message = r"names \['hh'\], which this model never tags; it tags: decoder_layer_input, h"
    with pytest.raises(PolicyError, match=message):
        stack(jnp.ones((1, 3, 4)), Policy({"hh": "offload"}))


def test_a_tag_without_axes_leaves_sharding_to_xla():
    """Only a tag that names its logical axes pins the value's sharding (under save_all too)."""
    mesh = AbstractMesh((2,), ("data",), axis_types=(AxisType.Auto,))
    x = jnp.ones((4, 8))
    with jax.sharding.use_abstract_mesh(mesh):
        bare = str(jax.make_jaxpr(lambda v: tag(v, "a"))(x))
        pinned = str(jax.make_jaxpr(lambda v: tag(v, "a", ("batch", None)))(x))
    assert "sharding_constraint" not in bare and "sharding_constraint" in pinned


def test_the_tag_context_belongs_to_the_thread_that_traces():
    """The tag context is a context variable: a thread tracing its own layer does not record into
    (or inject from) another thread's."""
    recorder = offload_tags.Recorder()
    seen = []

    def other_thread():
        seen.append(offload_tags.TAG_CONTEXT.get())
        tag(jnp.ones(2), "other")

    with offload_tags.tag_context(recorder):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        tag(jnp.ones(2), "mine")
    assert seen == [()] and [name for name, _ in recorder.values] == ["mine"]
    assert offload_tags.TAG_CONTEXT.get() == ()


def test_a_replay_that_leaves_saved_values_unused_is_refused():
    """A layer that tags by Python state (here: only the first time it is traced) replays
    differently from its forward pass; the engine refuses rather than inject the wrong values."""
    traced = []

    def layer(w, x):
        traced.append(1)
        h = x @ w
        return jnp.tanh(tag(h, "h") if len(traced) == 1 else h)

    run = offloaded(layer, Policy({"h": "device"}))
    with pytest.raises(RuntimeError, match=r"\['h'\] were never reached"):
        jax.grad(lambda w: jnp.sum(run(w, jnp.ones((2, 4)))))(jnp.eye(4))
