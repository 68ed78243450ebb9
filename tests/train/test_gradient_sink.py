"""Gradient accumulation adds each micro batch's gradient of a layer stack into the running sum
inside the stack's backward loop (`ferry.train.gradient_sink`): the same sums as adding whole
gradients, bit for bit, under every path a stack runs by (ferry's loop, peeled, JAX's autodiff,
unscanned), and the loop's program holds one stack gradient where adding whole ones holds two."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.models.registry import build_model
from ferry.offload.policy import SAVE_ALL
from ferry.train.step import LossSettings, _float32_gradients, accumulated_loss_and_grad, batch_loss
from tests.conftest import load_model_config, needs_libtpu, preset_policy

MICRO_STEPS = 4


def whole_sums(model, batch, settings):
    """The reference: each micro batch's whole gradient, added."""
    value_and_grad = _float32_gradients(eqx.filter_value_and_grad(batch_loss, has_aux=True))
    parts = [value_and_grad(model, b, settings) for b in batch.reshape(MICRO_STEPS, -1, batch.shape[1])]
    total = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts)
    return jax.tree.map(lambda x: x / MICRO_STEPS, total)


def model_and_batch(name: str, **changes):
    config = dataclasses.replace(load_model_config(name), **changes)
    model = build_model(config, jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (8, 17), 0, config.vocab_size)
    return model, batch


@pytest.mark.parametrize(
    "policy_name, peel, changes",
    [
        ("full_remat", 0, {}),  # ferry's loop adds in place
        ("minimal_offloaded", 0, {}),  # offloaded residuals, pipelined
        ("full_remat", 1, {"num_layers": 4}),  # peeled: layers outside the loop add too
        ("save_all", 0, {}),  # JAX's autodiff: the sum taken once the gradient is whole
        ("full_remat", 0, {"scan_layers": False}),  # unscanned layers
    ],
)
def test_sums_equal_adding_whole_gradients_bit_for_bit(policy_name, peel, changes):
    model, batch = model_and_batch("llama_tiny", **changes)
    policy = SAVE_ALL if policy_name == "save_all" else preset_policy(policy_name, model)
    settings = LossSettings(dataclasses.replace(policy, peel=peel), "bfloat16")
    got = jax.jit(lambda m, b: accumulated_loss_and_grad(m, b, settings, MICRO_STEPS))(model, batch)
    want = jax.jit(lambda m, b: whole_sums(m, b, settings))(model, batch)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


def test_the_backward_loop_carries_the_float32_sum():
    """Compiled, the stack's backward loop carries the float32 sum of its gradient (the sink,
    updated in place) where adding whole gradients has it return the micro batch's own. At
    Qwen3-1.7B on one v5e this took the step's temporaries from 16.21 to 11.84 GiB
    (benchmarks/results/capacity_tpu_v5e.json); XLA's own buffer assignment does the same at
    small sizes, so the test reads the loop's carry, not the bytes."""
    model, _ = model_and_batch("llama_tiny", num_layers=4, dim=256, mlp_dim=1024)
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32)
    settings = LossSettings(preset_policy("full_remat", model), "bfloat16")

    def backward_loop_carry(fn) -> str:
        text = jax.jit(fn).lower(model, batch).compile().as_text()
        (line,) = [ln for ln in text.splitlines() if " while(" in ln and "transpose(jvp())/while" in ln]
        return line.split(" while(")[0]

    def whole(m, b):  # the micro batches' whole gradients added, in a loop as the step has them
        value_and_grad = _float32_gradients(eqx.filter_value_and_grad(batch_loss, has_aux=True))
        shapes = eqx.filter_eval_shape(value_and_grad, m, b[:2], settings)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        add = lambda total, mb: (jax.tree.map(jnp.add, total, value_and_grad(m, mb, settings)), None)
        return jax.lax.scan(add, zeros, b.reshape(MICRO_STEPS, 2, -1))[0]

    w_up = "f32[4,1024,256]"  # the MLP's output projection, stacked over the 4 layers
    assert w_up in backward_loop_carry(lambda m, b: accumulated_loss_and_grad(m, b, settings, MICRO_STEPS))
    if jax.__version_info__ >= (0, 12):  # jax 0.10.2's XLA moves the whole gradients' add into this loop itself
        assert w_up not in backward_loop_carry(whole)


@needs_libtpu
def test_the_v5e_programs_backward_loop_carries_the_float32_sum():
    """The same in the program compiled for a v5e without the chip (libtpu's compiler, not the CPU's)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from ferry.plan.planner import compile_only_mesh
    from ferry.sharding import MeshConfig
    from ferry.xla.targets import named_target

    config = dataclasses.replace(load_model_config("llama_tiny"), num_layers=4, dim=256, mlp_dim=1024)
    mesh = compile_only_mesh(named_target("v5e"), MeshConfig())
    replicated = NamedSharding(mesh, PartitionSpec())
    model = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
        eqx.filter_eval_shape(build_model, config, jax.random.key(0)),
    )
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=replicated)
    settings = LossSettings(preset_policy("full_remat", model), "bfloat16")
    with jax.set_mesh(mesh):
        step = jax.jit(lambda m, b: accumulated_loss_and_grad(m, b, settings, MICRO_STEPS))
        text = step.lower(model, batch).compile().as_text()
    loops = [ln.split(" while(")[0] for ln in text.splitlines() if " while(" in ln and "transpose(jvp())/while" in ln]
    assert any("f32[4,1024,256]" in carry for carry in loops)
