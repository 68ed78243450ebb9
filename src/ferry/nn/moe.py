"""DeepSeekMoE: sigmoid routing with group limits and a selection-only correction bias, dropless
dispatch through grouped matmuls, a shared expert, and the sequence-wise balance loss.

Weights map one-to-one onto Hugging Face's `DeepseekV3MoE`: `gate.weight`,
`gate.e_score_correction_bias`, `experts.{i}.{gate,up,down}_proj` (stacked here along a leading
expert axis), `shared_experts`.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.nn.megablox import megablox_matmul
from ferry.nn.mlp import SwiGLU
from ferry.offload import tag
from ferry.sharding import (
    ACTIVATION_RULES,
    MeshError,
    batch_spec,
    check_divisible,
    context_mesh,
    data_parallel_size,
    mesh_axes,
)


def route(
    scores: Float[Array, "tokens experts"],
    correction_bias: Float[Array, " experts"],
    num_groups: int,
    groups_per_token: int,
    experts_per_token: int,
    routed_scaling: float,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
    """DeepSeek-V3's selection: add the correction bias, score each group by the sum of its top-2
    biased scores, keep the best `groups_per_token` groups, take the top experts within them; weight
    them by their *unbiased* scores normalised to sum 1, times `routed_scaling`. Ties go to the
    lower index (`lax.top_k`)."""
    tokens, experts = scores.shape
    biased = scores + jax.lax.stop_gradient(correction_bias)
    grouped = biased.reshape(tokens, num_groups, experts // num_groups)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
    _, kept_groups = jax.lax.top_k(group_scores, groups_per_token)
    group_kept = jnp.zeros((tokens, num_groups), bool).at[jnp.arange(tokens)[:, None], kept_groups].set(True)
    expert_kept = jnp.repeat(group_kept, experts // num_groups, axis=-1)
    _, indices = jax.lax.top_k(jnp.where(expert_kept, biased, -jnp.inf), experts_per_token)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * routed_scaling
    return indices, weights


def sequence_balance_loss(
    scores: Float[Array, "batch seq experts"], indices: Int[Array, "batch seq k"]
) -> Float[Array, ""]:
    """DeepSeek-V3's sequence-wise balance loss without its alpha: per sequence,
    sum_i f_i P_i with f_i = E/(K T) x tokens routed to i and P_i = mean_t of normalised scores."""
    _, seq, experts = scores.shape
    k = indices.shape[-1]
    routed = jax.nn.one_hot(indices, experts, dtype=scores.dtype).sum(axis=(1, 2))  # [batch, experts]
    f = routed * experts / (k * seq)
    p = (scores / scores.sum(axis=-1, keepdims=True)).mean(axis=1)
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


class Experts(eqx.Module):
    """The routed SwiGLU experts, stacked: gate/up [E, dim, hidden], down [E, hidden, dim]."""

    gate: Float[Array, "experts dim hidden"]
    up: Float[Array, "experts dim hidden"]
    down: Float[Array, "experts hidden dim"]

    def __init__(self, num_experts: int, dim: int, hidden: int, *, key: PRNGKeyArray, std: float = 0.02):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = std * jax.random.normal(kg, (num_experts, dim, hidden), jnp.float32)
        self.up = std * jax.random.normal(ku, (num_experts, dim, hidden), jnp.float32)
        self.down = std * jax.random.normal(kd, (num_experts, hidden, dim), jnp.float32)


class TileLayout(eqx.Module):
    """The expert-sorted rows of a dispatch padded so that each expert's rows fill whole tiles:
    the tiled grouped matmul walks the tiles, one expert each."""

    row: Int[Array, " padded"]  # the sorted row at each padded position; padding: past the last row
    tile_expert: Int[Array, " tiles"]
    tile_rows: int = eqx.field(static=True)


def tile_layout(group_sizes: Int[Array, " experts"], num_rows: int, tile_rows: int) -> TileLayout:
    """Pad each expert's group to a multiple of `tile_rows`; at most one partial tile per expert,
    so ceil(rows / tile) + experts tiles always suffice (a static bound). Rows past the groups
    (slots routed to another device's experts) are in no tile."""
    num_experts = group_sizes.shape[0]
    num_tiles = -(-num_rows // tile_rows) + num_experts
    padded_sizes = -(-group_sizes // tile_rows) * tile_rows
    padded_ends = jnp.cumsum(padded_sizes)
    position = jnp.arange(num_tiles * tile_rows)
    expert = jnp.minimum(jnp.searchsorted(padded_ends, position, side="right"), num_experts - 1)
    offset = position - (padded_ends - padded_sizes)[expert]
    starts = jnp.cumsum(group_sizes) - group_sizes
    row = jnp.where(offset < group_sizes[expert], starts[expert] + offset, num_rows)
    return TileLayout(row, expert[::tile_rows], tile_rows)


def _tile_slice(index: Int[Array, " padded"], tile: Int[Array, ""], tile_rows: int) -> Int[Array, " tile_rows"]:
    return jax.lax.dynamic_slice_in_dim(index, tile * tile_rows, tile_rows)


def _rows(x: Float[Array, "n d"], index: Int[Array, " m"]) -> Float[Array, "m d"]:
    """x's rows at `index`; zeros where it points past x."""
    return x.at[index].get(mode="fill", fill_value=0)


def _varying_axes(*arrays: jax.Array) -> tuple[str, ...]:
    """The mesh axes inside a `shard_map` over which one of `arrays` varies from device to device."""
    return tuple(sorted(set().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))))


def _varying_zeros(shape: tuple[int, ...], dtype: Any, *like: jax.Array) -> jax.Array:
    """Zeros typed as varying wherever one of `like` varies, as `scan` and `cond` require of the
    values they join."""
    axes = _varying_axes(*like)
    zeros = jnp.zeros(shape, dtype)
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def _carry_zeros(shape: tuple[int, ...], dtype: Any, *operands: jax.Array) -> jax.Array:
    """A loop's initial zero carry, created once `operands` exist: XLA would otherwise copy
    every loop's zero carry at the start of the program, all ring steps' at once."""
    return jax.lax.optimization_barrier((_varying_zeros(shape, dtype, *operands), operands))[0]


def _cotangent_of(gradient: jax.Array, primal: jax.Array) -> jax.Array:
    """A gradient summed over the mesh axes along which it varies but its primal does not: the
    devices there share the primal, so its gradient is their sum."""
    shared = tuple(sorted(set(_varying_axes(gradient)) - set(_varying_axes(primal))))
    gradient = jax.lax.psum(gradient, shared) if shared else gradient
    return gradient.astype(primal.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tiled_matmul(
    num_out_rows: int,
    x: Float[Array, "n d_in"],
    weights: Float[Array, "experts d_in d_out"],
    source: Int[Array, " padded"],
    layout: TileLayout,
) -> Float[Array, "out_rows d_out"]:
    """Tile by tile, x's rows at `source` times the tile's expert matrix, written to the output
    rows `layout.row`. Nothing is materialised per tile but the tile (neither the gathered rows
    nor a copy of the expert's matrix), and a tile with no output row (padding) is skipped at
    run time (its FLOPs stay in the static HLO count: an upper bound)."""
    return _tiled_forward(num_out_rows, x, weights, source, layout)


def _tiled_forward(num_out_rows: int, x: jax.Array, weights: jax.Array, source: jax.Array, layout: TileLayout):
    tile_rows, d_out = layout.tile_rows, weights.shape[-1]
    dtype = jnp.result_type(x.dtype, weights.dtype)
    operands = (x, weights, source, layout.row, layout.tile_expert)

    def one_tile(out: jax.Array, tile: jax.Array) -> tuple[jax.Array, None]:
        def product() -> jax.Array:
            return _rows(x, _tile_slice(source, tile, tile_rows)) @ weights[layout.tile_expert[tile]]

        skip = functools.partial(_varying_zeros, (tile_rows, d_out), dtype, *operands)
        destination = _tile_slice(layout.row, tile, tile_rows)
        y = jax.lax.cond(jnp.any(destination < num_out_rows), product, skip)
        return out.at[destination].set(y, mode="drop"), None

    out = _carry_zeros((num_out_rows, d_out), dtype, *operands)
    return jax.lax.scan(one_tile, out, jnp.arange(layout.tile_expert.shape[0]))[0]


def _tiled_fwd(num_out_rows: int, x: jax.Array, weights: jax.Array, source: jax.Array, layout: TileLayout):
    return _tiled_forward(num_out_rows, x, weights, source, layout), (x, weights, source, layout)


def _tiled_bwd(num_out_rows: int, residuals: tuple, cotangent: jax.Array) -> tuple:
    """The same walk over the tiles: each tile's input gradient is added to the rows it read,
    its weight gradient to its expert's, both accumulated in at least float32."""
    x, weights, source, layout = residuals
    tile_rows = layout.tile_rows
    dx_dtype, dw_dtype = (jnp.promote_types(a.dtype, jnp.float32) for a in (x, weights))
    operands = (x, weights, source, layout.row, layout.tile_expert, cotangent)

    def one_tile(carry: tuple[jax.Array, jax.Array], tile: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
        dx, dw = carry
        expert = layout.tile_expert[tile]
        rows = _tile_slice(source, tile, tile_rows)
        destination = _tile_slice(layout.row, tile, tile_rows)
        g = _rows(cotangent, destination)

        def grads() -> tuple[jax.Array, jax.Array]:
            dx_tile = jnp.einsum("ro,io->ri", g, weights[expert], preferred_element_type=dx_dtype)
            dw_tile = jnp.einsum("ri,ro->io", _rows(x, rows), g, preferred_element_type=dw_dtype)
            return dx_tile, dw_tile

        def skip() -> tuple[jax.Array, jax.Array]:
            return (
                _varying_zeros((tile_rows, x.shape[1]), dx_dtype, *operands),
                _varying_zeros(weights.shape[1:], dw_dtype, *operands),
            )

        dx_tile, dw_tile = jax.lax.cond(jnp.any(destination < num_out_rows), grads, skip)
        return (dx.at[rows].add(dx_tile, mode="drop"), dw.at[expert].add(dw_tile)), None

    init = (_carry_zeros(x.shape, dx_dtype, *operands), _carry_zeros(weights.shape, dw_dtype, *operands))
    (dx, dw), _ = jax.lax.scan(one_tile, init, jnp.arange(layout.tile_expert.shape[0]))
    return _cotangent_of(dx, x), _cotangent_of(dw, weights), None, None


tiled_matmul.defvjp(_tiled_fwd, _tiled_bwd)


class Dispatch(eqx.Module):
    """The (token, expert) slots routed to one device's experts, sorted by expert: each row's
    token and routing weight, and each expert's group size. Rows past the groups (slots of other
    devices' experts) hold no token and weight zero."""

    row_token: Int[Array, " rows"]  # past the groups: the number of tokens (no token)
    row_weight: Float[Array, " rows"]
    group_sizes: Int[Array, " local_experts"]
    layout: TileLayout | None  # None: a grouped kernel (`kernel`)
    kernel: str = eqx.field(static=True, default="ragged_dot")  # without a layout: "ragged_dot" or "megablox"

    def window(self, start: int, stop: int) -> "Dispatch":
        """Rows [start, stop) as a dispatch of their own. Its tiles are those that can hold
        them: padding moves a row at most (experts - 1) x (tile_rows - 1) positions on."""
        ends = jnp.cumsum(self.group_sizes)
        group_sizes = jnp.clip(ends, start, stop) - jnp.clip(ends - self.group_sizes, start, stop)
        layout = self.layout
        if layout is not None:
            tile_rows, num_experts = layout.tile_rows, self.group_sizes.shape[0]
            first, last = start // tile_rows, min(layout.tile_expert.shape[0], -(-stop // tile_rows) + num_experts)
            row = layout.row[first * tile_rows : last * tile_rows]
            row = jnp.where((row >= start) & (row < stop), row - start, stop - start)
            layout = TileLayout(row, layout.tile_expert[first:last], tile_rows)
        return Dispatch(self.row_token[start:stop], self.row_weight[start:stop], group_sizes, layout, self.kernel)


def dispatch(
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    first_expert: Int[Array, ""] | int,
    num_local_experts: int,
    tile_rows: int | None = None,
    capacity: int | None = None,
    queue_start: Int[Array, " local_experts"] | int = 0,
    kernel: str = "ragged_dot",
) -> Dispatch:
    """Sort the slots routed to experts [first_expert, first_expert + num_local_experts) by
    expert. With a `capacity`, a slot whose place in its expert's queue (after `queue_start`
    slots queued elsewhere) is `capacity` or later gets weight zero (dropped), as
    capacity-based trainers do. Only index arrays: the tokens are read by the matmul itself.
    Without `tile_rows` the grouped matmul is `kernel` (`grouped_matmul`)."""
    tokens, k = indices.shape
    local_expert = indices.reshape(-1) - first_expert
    is_local = (local_expert >= 0) & (local_expert < num_local_experts)
    sort_key = jnp.where(is_local, local_expert, num_local_experts)
    order = jnp.argsort(sort_key, stable=True)
    group_sizes = jnp.bincount(sort_key, length=num_local_experts + 1)[:num_local_experts].astype(jnp.int32)
    in_group = jnp.arange(tokens * k) < group_sizes.sum()
    row_weight = jnp.where(in_group, weights.reshape(-1)[order], 0)
    if capacity is not None:
        starts = jnp.cumsum(group_sizes) - group_sizes - queue_start
        expert = jnp.minimum(sort_key[order], num_local_experts - 1)
        row_weight = jnp.where(jnp.arange(tokens * k) - starts[expert] < capacity, row_weight, 0)
    layout = None if tile_rows is None else tile_layout(group_sizes, tokens * k, tile_rows)
    return Dispatch(jnp.where(in_group, order // k, tokens), row_weight, group_sizes, layout, kernel)


def grouped_matmul(
    x: Float[Array, "n d_in"], weights: Float[Array, "experts d_in d_out"], d: Dispatch, gather: bool
) -> Float[Array, "rows d_out"]:
    """Each dispatched row times its expert's matrix; the row is x's row of the row's token
    (`gather`: x holds the tokens) or x's own row. Rows past the groups give zeros.
    Without a tile layout, the dispatch's grouped kernel: `megablox` (JAX's Pallas kernels on TPU,
    `ferry.nn.megablox`) or `lax.ragged_dot`; with one, tiles (`tiled_matmul`): XLA's CPU and GPU
    backends expand `ragged_dot` and its transposes into every expert on every row."""
    num_rows = d.row_token.shape[0]
    if d.layout is None:
        rows = _rows(x, d.row_token) if gather else x
        if d.kernel == "megablox":
            return megablox_matmul(rows, weights.astype(rows.dtype), d.group_sizes)
        in_group = (jnp.arange(num_rows) < d.group_sizes.sum())[:, None]
        return jnp.where(in_group, jax.lax.ragged_dot(rows, weights, d.group_sizes), 0)
    source = d.layout.row
    if gather:
        source = d.row_token.at[source].get(mode="fill", fill_value=x.shape[0])
    return tiled_matmul(num_rows, x, weights, source, d.layout)


def combine(out: Float[Array, "rows dim"], d: Dispatch, num_tokens: int) -> Float[Array, "tokens dim"]:
    """Each token's sum of its rows (already weighted by `expert_ffn`)."""
    return jnp.zeros((num_tokens, out.shape[1]), out.dtype).at[d.row_token].add(out, mode="drop")


Matmul = Callable[[jax.Array, jax.Array, Dispatch, bool], jax.Array]


def _weighted_down(gate: jax.Array, up: jax.Array, d: Dispatch, down: jax.Array, matmul: Matmul) -> jax.Array:
    """The routing weight scales the hidden rows before the down projection, so the combine is a
    plain sum and the backward pass needs no [rows, dim] residual for the weights' gradient."""
    hidden = jax.nn.silu(gate) * up * d.row_weight[:, None].astype(gate.dtype)
    return matmul(hidden, down, d, False)


def expert_ffn(
    x: Float[Array, "tokens dim"], d: Dispatch, experts: Experts, matmul: Matmul, tagged: bool = True
) -> Float[Array, "rows dim"]:
    """The experts' SwiGLU on the dispatched rows of x's tokens, weighted; its three products are
    tagged for offload (unless not `tagged`: then always recomputed). What lies between them is
    recomputed in the backward pass (`jax.checkpoint`): of a row, it keeps the two hidden
    products only."""

    def name(value: jax.Array, tensor: str) -> jax.Array:
        return tag(value, tensor) if tagged else value

    gate = name(matmul(x, experts.gate, d, True), "moe_mlpwi_0")
    up = name(matmul(x, experts.up, d, True), "moe_mlpwi_1")
    down = jax.checkpoint(functools.partial(_weighted_down, matmul=matmul))
    return name(down(gate, up, d, experts.down), "moe_mlpwo")


def tagged_windows(d: Dispatch, tagged_rows: int) -> tuple[Dispatch, ...]:
    """The dispatch split where its tagged rows end: the rows before, then the rest if any."""
    num_rows = d.row_token.shape[0]
    if tagged_rows >= num_rows:
        return (d,)
    return d.window(0, tagged_rows), d.window(tagged_rows, num_rows)


def routed_experts(
    x: Float[Array, "tokens dim"], windows: tuple[Dispatch, ...], experts: Experts, matmul: Matmul
) -> tuple[jax.Array, ...]:
    """`expert_ffn` on each window of a dispatch (`tagged_windows`), tagging only the first."""
    return tuple(expert_ffn(x, d, experts, matmul, tagged=i == 0) for i, d in enumerate(windows))


def combine_windows(outs: tuple[jax.Array, ...], windows: tuple[Dispatch, ...], num_tokens: int) -> jax.Array:
    """Each token's sum over the windows of its rows."""
    return sum(combine(out, d, num_tokens) for out, d in zip(outs, windows, strict=True))


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


def _capacity(capacity_factor: float | None, tokens: int, k: int, num_experts: int) -> int | None:
    """Slots per expert queue of `tokens` tokens: ceil(capacity_factor x tokens x k / experts)."""
    return None if capacity_factor is None else -(-int(capacity_factor * tokens * k) // num_experts)


def _tagged_rows(tag_capacity_factor: float | None, tokens: int, k: int, group: int) -> int:
    """Rows of a ring step whose expert products are tagged: ceil(factor x tokens x k / group),
    `factor` times what a balanced router sends a device per step; all (tokens x k) for None."""
    return tokens * k if tag_capacity_factor is None else -(-int(tag_capacity_factor * tokens * k) // group)


def dropless_moe(
    x: Float[Array, "tokens dim"],
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    experts: Experts,
    capacity_factor: float | None = None,
    tile_rows: int | None = None,
    tag_capacity_factor: float | None = None,
    kernel: str = "ragged_dot",
) -> Float[Array, "tokens dim"]:
    """Sort the (token, expert) slots by expert and run each expert on exactly its tokens with
    grouped matmuls (tiles of `tile_rows` rows, or else the grouped `kernel`): no token is dropped, no
    expert computes a token it was not routed. Under a mesh of several devices the dispatch is
    per device (`expert_parallel_moe`), unless the tokens do not split evenly over the batch axes
    (abstract traces with a toy shape), where XLA partitions the single-device dispatch. The
    expert products of the rows past `tag_capacity_factor` x a balanced load (`_tagged_rows`)
    are not tagged: the backward pass recomputes them whatever the offload policy."""
    mesh = context_mesh()
    if mesh is not None and mesh.size > 1 and x.shape[0] % data_parallel_size(mesh) == 0:
        return expert_parallel_moe(
            x, indices, weights, experts, mesh, capacity_factor, tile_rows, tag_capacity_factor, kernel
        )
    tokens, k = indices.shape
    num_experts = experts.gate.shape[0]
    capacity = _capacity(capacity_factor, tokens, k, num_experts)
    d = dispatch(indices, weights, 0, num_experts, tile_rows, capacity, kernel=kernel)
    windows = tagged_windows(d, _tagged_rows(tag_capacity_factor, tokens, k, 1))
    return combine_windows(routed_experts(x, windows, experts, grouped_matmul), windows, tokens)


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
    queue_start = 0
    if capacity is not None:
        queue_start = _queue_start(indices, (position + shift) % group, first, num_local, num_experts)
    if shift:
        x, indices, weights = (_from_device_ahead(a, shift, group) for a in (x, indices, weights))
    d = dispatch(indices, weights, first, num_local, tile_rows, capacity, queue_start, kernel)
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
    capacity = _capacity(capacity_factor, tokens * group, k, num_experts)
    tagged_rows = _tagged_rows(tag_capacity_factor, tokens, k, group)
    experts, expert_spec = per_device_experts(experts, mesh)

    check_vma = _kernel_checks_vma(kernel, tile_rows, mesh)

    def matmul(a: jax.Array, w: jax.Array, d: Dispatch, gather: bool) -> jax.Array:
        local = functools.partial(_copy_matmul, gather=gather)
        specs = {"in_specs": (rows, expert_spec, rows), "out_specs": rows, "check_vma": check_vma}
        return jax.shard_map(local, mesh=mesh, **specs)(a, w, d)

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


def dense_moe(
    x: Float[Array, "tokens dim"],
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    experts: Experts,
) -> Float[Array, "tokens dim"]:
    """Every expert on every token, masked by the routing: the reference dropless dispatch must
    equal, and the baseline its benchmark compares against."""
    num_experts = experts.gate.shape[0]
    combine = (jax.nn.one_hot(indices, num_experts, dtype=weights.dtype) * weights[..., None]).sum(axis=1)
    gate = jnp.einsum("td,edh->eth", x, experts.gate)
    up = jnp.einsum("td,edh->eth", x, experts.up)
    out = jnp.einsum("eth,ehd->etd", jax.nn.silu(gate) * up, experts.down)
    return jnp.einsum("etd,te->td", out, combine.astype(out.dtype))


class MoEStats(eqx.Module):
    """What a MoE layer reports besides its output: its balance loss and tokens per expert."""

    balance_loss: Float[Array, ""]
    expert_load: Float[Array, " experts"]


class DeepSeekMoE(eqx.Module):
    router: Float[Array, "dim experts"]
    correction_bias: Float[Array, " experts"]
    experts: Experts
    shared: SwiGLU
    num_groups: int = eqx.field(static=True)
    groups_per_token: int = eqx.field(static=True)
    experts_per_token: int = eqx.field(static=True)
    routed_scaling: float = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    tile_rows: int | None = eqx.field(static=True)
    tag_capacity_factor: float | None = eqx.field(static=True)
    kernel: str = eqx.field(static=True)  # the grouped kernel without tiles: "ragged_dot" or "megablox"

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        num_shared_experts: int,
        num_groups: int,
        groups_per_token: int,
        experts_per_token: int,
        routed_scaling: float,
        capacity_factor: float | None,
        tile_rows: int | None = None,
        tag_capacity_factor: float | None = None,
        kernel: str = "ragged_dot",
        *,
        key: PRNGKeyArray,
    ):
        k_router, k_experts, k_shared = jax.random.split(key, 3)
        self.router = 0.02 * jax.random.normal(k_router, (dim, num_experts), jnp.float32)
        self.correction_bias = jnp.zeros((num_experts,), jnp.float32)
        self.experts = Experts(num_experts, dim, hidden, key=k_experts)
        self.shared = SwiGLU(dim, hidden * num_shared_experts, key=k_shared)
        self.num_groups, self.groups_per_token = num_groups, groups_per_token
        self.experts_per_token, self.routed_scaling = experts_per_token, routed_scaling
        self.capacity_factor = capacity_factor
        self.tile_rows = tile_rows
        self.tag_capacity_factor = tag_capacity_factor
        self.kernel = kernel

    def __call__(self, x: Float[Array, "batch seq dim"]) -> tuple[Float[Array, "batch seq dim"], MoEStats]:
        batch, seq, dim = x.shape
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.router.astype(jnp.float32))
        flat_scores = scores.reshape(batch * seq, -1)
        select = functools.partial(
            route,
            num_groups=self.num_groups,
            groups_per_token=self.groups_per_token,
            experts_per_token=self.experts_per_token,
            routed_scaling=self.routed_scaling,
        )
        indices, weights = per_device_tokens(select)(flat_scores, self.correction_bias.astype(jnp.float32))
        routed = dropless_moe(
            x.reshape(batch * seq, dim),
            indices,
            weights,
            self.experts,
            self.capacity_factor,
            self.tile_rows,
            self.tag_capacity_factor,
            self.kernel,
        )
        out = routed.reshape(x.shape) + self.shared(x)
        load = jnp.bincount(indices.reshape(-1), length=scores.shape[-1]).astype(jnp.float32)
        stats = MoEStats(sequence_balance_loss(scores, indices.reshape(batch, seq, -1)), load)
        return out, stats
