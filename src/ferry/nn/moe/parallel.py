"""Expert parallelism under a mesh: routing on each device's own tokens, and the routed experts
split over the `expert` axis as a `shard_map`/`ppermute` ring over the expert group."""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from ferry.nn.moe.dispatch import (
    Dispatch,
    capacity_per_expert,
    combine_windows,
    dispatch,
    grouped_matmul,
    tagged_row_count,
    tagged_windows,
)
from ferry.nn.moe.experts import Experts, routed_experts
from ferry.sharding import (
    ACTIVATION_RULES,
    MeshError,
    batch_spec,
    check_divisible,
    context_mesh,
    data_parallel_size,
    mesh_axes,
)


def per_device_tokens(fn: Callable[[jax.Array, jax.Array], Any]) -> Callable[[jax.Array, jax.Array], Any]:
    """`fn(tokens, shared)`, token-wise independent, run on each device's own tokens under a mesh:
    XLA's partitioner would otherwise gather every token to run `top_k` and its scatter."""
    mesh = context_mesh()
    if mesh is None or mesh.size == 1:
        return fn

    def call(tokens: jax.Array, shared: jax.Array) -> Any:
        if tokens.shape[0] % data_parallel_size(mesh):
            return fn(tokens, shared)
        rows = batch_spec(mesh)
        return jax.shard_map(fn, mesh=mesh, in_specs=(rows, PartitionSpec()), out_specs=rows)(tokens, shared)

    return call


def per_device_experts(experts: Experts, mesh: Any) -> tuple[Experts, PartitionSpec]:
    """The expert weights with a leading axis of one copy per device of each expert shard, split
    over the batch axes, and its spec. A `shard_map` taking the weights unsplit over an axis
    would sum their gradient over it at every use (a full all-reduce per ring step and matmul);
    with a copy per device the ring steps' gradients add up on each device and the copies' sum,
    the transpose of the broadcast, is one reduce-scatter onto the FSDP-split weights."""
    copy_axes = tuple(axis for axis in mesh_axes("batch", ACTIVATION_RULES, mesh) if axis != "expert")
    copies = math.prod(mesh.shape[axis] for axis in copy_axes)
    spec = PartitionSpec(copy_axes or None, "expert" if mesh.shape["expert"] > 1 else None)

    def copy(w: jax.Array) -> jax.Array:
        w = jnp.broadcast_to(w[None], (copies, *w.shape))
        return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))

    return jax.tree.map(copy, experts), spec


def _from_device_ahead(a: jax.Array, shift: int, group: int) -> jax.Array:
    """Device j of the `expert` group receives `a` of device (j + shift) mod group."""
    return jax.lax.ppermute(a, "expert", [(s, (s - shift) % group) for s in range(group)])


def _to_device_ahead(a: jax.Array, shift: int, group: int) -> jax.Array:
    """Device j of the `expert` group sends `a` to device (j + shift) mod group."""
    return jax.lax.ppermute(a, "expert", [(s, (s + shift) % group) for s in range(group)])


def _queue_start(
    indices: Int[Array, "tokens k"], source: Int[Array, ""], first: Int[Array, ""], num_local: int, num_experts: int
) -> Int[Array, " local_experts"]:
    """Slots the group's devices before `source` route to each local expert: the queue is the
    group's tokens in order, as if they were one device's."""
    counts = jax.lax.all_gather(jnp.bincount(indices.reshape(-1), length=num_experts), "expert")
    before = jnp.cumsum(counts, axis=0) - counts
    return jax.lax.dynamic_slice_in_dim(before[source], first, num_local).astype(jnp.int32)


def _receive_and_dispatch(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    *,
    shift: int,
    group: int,
    num_experts: int,
    tile_rows: int | None,
    capacity: int | None,
    tagged_rows: int,
    kernel: str,
) -> tuple[jax.Array, tuple[Dispatch, ...]]:
    """One step of the ring, on one device: the tokens and routing of the device `shift` ahead
    in the group, and the dispatch of their slots to this device's experts (`tagged_windows`)."""
    num_local = num_experts // group
    position = jax.lax.axis_index("expert")
    first = position * num_local
    queue_start: jax.Array | int = 0
    if capacity is not None:
        queue_start = _queue_start(indices, (position + shift) % group, first, num_local, num_experts)
    if shift:
        x, indices, weights = (_from_device_ahead(a, shift, group) for a in (x, indices, weights))
    balanced = -(-indices.size // group)  # the slots of one device a balanced router sends each device
    d = dispatch(indices, weights, first, num_local, tile_rows, capacity, queue_start, kernel, balanced)
    return x, tagged_windows(d, tagged_rows)


def _combine_and_return(
    outs: tuple[jax.Array, ...], windows: tuple[Dispatch, ...], *, shift: int, group: int, tokens: int
) -> jax.Array:
    """The token sums of one ring step, sent back to the device whose tokens they are."""
    sums = combine_windows(outs, windows, tokens)
    return _to_device_ahead(sums, shift, group) if shift else sums


def expert_parallel_moe(
    x: Float[Array, "tokens dim"],
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    experts: Experts,
    mesh: Any,
    capacity_factor: float | None = None,
    tile_rows: int | None = None,
    tag_capacity_factor: float | None = None,
    kernel: str = "ragged_dot",
) -> Float[Array, "tokens dim"]:
    """Dropless MoE with the experts split over the mesh's `expert` axis and the tokens over its
    batch axes, as a ring over the `expert` group: at step s every device receives the tokens
    and routing of the device s ahead, runs its own experts on the slots routed to them, and
    sends the token sums back. Nothing is dropped, and a step's buffers hold at most one
    device's slots (tokens x k rows, all routed here) whatever the group size, where gathering
    the whole group would hold group x as many. The steps are unrolled and each expert product
    leaves the `shard_map`s, so the offload policy places it per step; only the rows up to
    `tag_capacity_factor` x a balanced step's load are tagged, so what a policy saves stays
    near the tokens x k rows a balanced router gives a device, not group x as many."""
    num_experts = experts.gate.shape[0]
    group = mesh.shape["expert"]
    check_divisible("num_experts", num_experts, "expert", group, "choose an expert size that divides it")
    rows = batch_spec(mesh)
    tokens, k = x.shape[0] // data_parallel_size(mesh), indices.shape[1]
    capacity = capacity_per_expert(capacity_factor, tokens * group, k, num_experts)
    tagged_rows = tagged_row_count(tag_capacity_factor, tokens, k, group)
    experts, expert_spec = per_device_experts(experts, mesh)
    check_vma = _kernel_checks_vma(kernel, tile_rows, mesh)

    def matmul(a: jax.Array, w: jax.Array, d: Dispatch, gather: bool) -> jax.Array:
        local = functools.partial(_copy_matmul, gather=gather)
        in_specs = (rows, expert_spec, rows)
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=rows, check_vma=check_vma)(a, w, d)

    total = None
    for shift in range(group):
        receive = functools.partial(
            _receive_and_dispatch,
            shift=shift,
            group=group,
            num_experts=num_experts,
            tile_rows=tile_rows,
            capacity=capacity,
            tagged_rows=tagged_rows,
            kernel=kernel,
        )
        x_ahead, windows = jax.shard_map(receive, mesh=mesh, in_specs=rows, out_specs=rows)(x, indices, weights)
        if total is not None:
            # Start once the last step is done, so one step's buffers are live at a time. The
            # weights pass the barrier too, each step using the last step's output: their
            # gradient then adds up step by step in the backward pass, where gradients of
            # independent uses would be fused into one sum, all of them live at once.
            (x_ahead, windows, experts), total = jax.lax.optimization_barrier(((x_ahead, windows, experts), total))
        outs = routed_experts(x_ahead, windows, experts, matmul)
        send = functools.partial(_combine_and_return, shift=shift, group=group, tokens=tokens)
        total_step = jax.shard_map(send, mesh=mesh, in_specs=rows, out_specs=rows)(outs, windows)
        total = total_step if total is None else total + total_step
    assert total is not None, "a ring has at least one step"
    return total


def _kernel_checks_vma(kernel: str, tile_rows: int | None, mesh: Any) -> bool:
    """Whether the experts' `shard_map` can check how its values vary over the mesh. Megablox
    declares its outputs without the varying axes such a check needs, so its `shard_map` runs
    unchecked; that is sound only where every axis of more than one device splits the operands
    (no value is replicated, so no gradient sum is left to the check): a tensor axis is refused."""
    if tile_rows is not None or kernel != "megablox":
        return True
    batch = mesh_axes("batch", ACTIVATION_RULES, mesh)
    replicated = [axis for axis in mesh.axis_names if axis not in batch and mesh.shape[axis] > 1]
    if replicated:
        raise MeshError(
            f"moe_matmul=megablox runs the experts on one device's tokens, but the mesh also splits "
            f"{', '.join(f'{a}={mesh.shape[a]}' for a in replicated)}; use moe_matmul=ragged_dot with that mesh"
        )
    return False


def _copy_matmul(x: jax.Array, weights: Float[Array, "1 experts d_in d_out"], d: Dispatch, gather: bool) -> jax.Array:
    """`grouped_matmul` on one device, with its copy of its experts (`per_device_experts`)."""
    return grouped_matmul(x, weights[0], d, gather)
