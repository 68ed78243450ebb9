"""The train state in explicit memory kinds: AdamW's moments and the float32 master weights in
pinned host memory, streamed through HBM a layer at a time, train bit for bit as on the device."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ferry.models.registry import build_model
from ferry.train.config import TrainConfig
from ferry.train.optimizer import learning_rate_schedule, make_optimizer, streamed_update
from ferry.train.state_memory import (
    StatePlacement,
    StreamedUpdate,
    state_host_mask,
    state_map,
    with_memory_kinds,
)
from ferry.train.step import LossSettings, init_state, make_train_step, train_step_body
from tests.conftest import load_model_config, needs_cuda_plugin, preset_policy

PLACEMENTS = [StatePlacement("host", "device"), StatePlacement("device", "host"), StatePlacement("host", "host")]


def in_hbm(stream: StreamedUpdate) -> StreamedUpdate:
    """The same layer-by-layer update with every leaf left in HBM: the reference that isolates the
    memory placement. (XLA fuses AdamW inside the layer loop differently from the whole-tree
    update, moving the last bit of some weights, so that update is no bitwise reference.)"""
    return dataclasses.replace(stream, moves=False)


def train(model_name: str, placement: StatePlacement, steps: int, reference: bool = False):
    config = load_model_config(model_name)
    train = TrainConfig(steps=steps, warmup_steps=1, global_batch_size=4, micro_batch_size=2, seq_len=16)
    optimizer = make_optimizer(train)
    model = build_model(config, jax.random.key(0))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    state = init_state(model, optimizer, placement, train.compute_dtype)
    arrays, static = eqx.partition(state, eqx.is_array)
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), arrays)
    if placement.streams:
        params_host, state_host = state_host_mask(arrays.model, arrays.opt_state, state_map(model, placement))
        nowhere = jax.tree.map(lambda _: False, arrays)
        host = eqx.tree_at(lambda s: (s.model, s.opt_state), nowhere, (params_host, state_host))
        shardings = with_memory_kinds(shardings, host)
    arrays = jax.device_put(arrays, shardings)
    state = eqx.combine(arrays, static)
    settings = LossSettings(preset_policy("minimal_offloaded", model), train.compute_dtype)
    stream = streamed_update(train, model, placement, shardings.model)
    if reference:
        stream = in_hbm(stream)
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), arrays)
        state = eqx.combine(jax.device_put(arrays, shardings), static)
    schedule = learning_rate_schedule(train)
    step = make_train_step(optimizer, settings, schedule, train.micro_steps(), shardings, stream=stream)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        batch = rng.integers(0, config.vocab_size, (4, 17), dtype=np.int32)
        with jax.set_mesh(mesh):
            state, metrics = step(state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return losses, state


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"optimizer_{p.optimizer}-params_{p.params}")
def test_host_resident_state_trains_bit_for_bit_as_in_hbm(placement):
    expected, reference = train("llama_tiny", placement, 4, reference=True)
    losses, state = train("llama_tiny", placement, 4)
    np.testing.assert_array_equal(np.array(losses), np.array(expected))
    weights = lambda s: jax.tree.leaves(eqx.filter(s.model, eqx.is_array))  # noqa: E731
    for got, want in zip(weights(state), weights(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state) + jax.tree.leaves(state.model)}
    assert "pinned_host" in kinds


def compiled_memory(model_name: str, placement: StatePlacement):
    """The train step of `model_name` compiled for an H200 (deviceless) with the state placed."""
    from ferry.plan.planner import compile_only_mesh
    from ferry.plan.targets import TARGETS
    from ferry.sharding import MeshConfig, tree_shardings

    config = load_model_config(model_name)
    train = TrainConfig(steps=10, warmup_steps=1, global_batch_size=2, seq_len=32)
    optimizer = make_optimizer(train)
    mesh = compile_only_mesh(TARGETS["h200"], MeshConfig())
    model = eqx.filter_eval_shape(build_model, config, jax.random.key(0))
    shapes, static = eqx.partition(
        eqx.filter_eval_shape(init_state, model, optimizer, placement, train.compute_dtype),
        lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )
    shardings = tree_shardings(shapes, mesh)
    if placement.streams:
        params_host, state_host = state_host_mask(shapes.model, shapes.opt_state, state_map(model, placement))
        nowhere = jax.tree.map(lambda _: False, shapes)
        host = eqx.tree_at(lambda s: (s.model, s.opt_state), nowhere, (params_host, state_host))
        shardings = with_memory_kinds(shardings, host)
    settings = LossSettings(preset_policy("save_all", model), train.compute_dtype)
    stream = streamed_update(train, model, placement, shardings.model)
    body = train_step_body(optimizer, settings, learning_rate_schedule(train), 1, shardings, stream=stream)
    args = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    batch = jax.ShapeDtypeStruct((2, 33), np.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    step = lambda arrays, tokens: body(eqx.combine(arrays, static), tokens)  # noqa: E731
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=0).lower(args, batch).compile(TARGETS["h200"].compile_options({}))
    nbytes = lambda tree: sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    smap = state_map(model, placement)
    moved = compute_copies = largest_unit = 0
    if placement.streams:
        on_host = eqx.filter(shapes, host)
        moved, compute_copies = nbytes(on_host), nbytes(shapes.compute)
        params = jax.tree.leaves(shapes.model)
        for unit in set(smap.units):
            index = [i for i in smap.leaves_of(unit) if smap.host_params[i] or smap.host_moments[i]]
            layers = params[index[0]].shape[0] if unit and index else 1
            state = sum(nbytes(params[i]) * (smap.host_params[i] + 2 * smap.host_moments[i]) for i in index)
            largest_unit = max(largest_unit, state // layers)
    return compiled.memory_analysis(), moved, compute_copies, largest_unit


@needs_cuda_plugin
@pytest.mark.parametrize("model_name", ["llama_tiny", "deepseek_v3_tiny"])
@pytest.mark.parametrize("placement", PLACEMENTS[::2], ids=lambda p: f"optimizer_{p.optimizer}-params_{p.params}")
def test_on_h200_the_moved_state_leaves_hbm_for_pinned_host(model_name, placement):
    device, *_ = compiled_memory(model_name, StatePlacement())
    memory, moved, compute_copies, largest_unit = compiled_memory(model_name, placement)
    assert moved > 0
    assert memory.host_argument_size_in_bytes == moved  # every moved leaf arrives in pinned host
    assert device.argument_size_in_bytes - memory.argument_size_in_bytes == moved - compute_copies
    # HBM holds one unit's state at a time: a layer of a stack, or the unstacked parameters
    assert memory.temp_size_in_bytes - device.temp_size_in_bytes <= largest_unit
