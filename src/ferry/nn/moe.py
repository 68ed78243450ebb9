"""DeepSeekMoE: sigmoid routing with group limits and a selection-only correction bias, dropless
dispatch through grouped matmuls, a shared expert, and the sequence-wise balance loss.

Weights map one-to-one onto Hugging Face's `DeepseekV3MoE`: `gate.weight`,
`gate.e_score_correction_bias`, `experts.{i}.{gate,up,down}_proj` (stacked here along a leading
expert axis), `shared_experts`.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.nn.mlp import SwiGLU
from ferry.offload import tag
from ferry.sharding import batch_spec, check_divisible, context_mesh, data_parallel_size


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
    """Where each expert-sorted row goes when every expert's rows are padded to whole tiles."""

    destination: Int[Array, " rows"]  # padded row of each sorted row; rows in no group: the scratch row
    tile_expert: Int[Array, " tiles"]  # the expert every tile belongs to
    tile_rows: int = eqx.field(static=True)


def tile_layout(group_sizes: Int[Array, " experts"], num_rows: int, tile_rows: int) -> TileLayout:
    """Pad each expert's group to a multiple of `tile_rows`; at most one partial tile per expert,
    so ceil(rows / tile) + experts tiles always suffice (a static bound). Rows past the groups
    (slots routed to another device's experts) go to a scratch row that is never computed."""
    num_experts = group_sizes.shape[0]
    num_tiles = -(-num_rows // tile_rows) + num_experts
    padded_sizes = -(-group_sizes // tile_rows) * tile_rows
    padded_ends = jnp.cumsum(padded_sizes)
    starts = jnp.cumsum(group_sizes) - group_sizes
    row_expert = jnp.repeat(jnp.arange(num_experts), group_sizes, total_repeat_length=num_rows)
    destination = padded_ends[row_expert] - padded_sizes[row_expert] + jnp.arange(num_rows) - starts[row_expert]
    in_group = jnp.arange(num_rows) < group_sizes.sum()
    destination = jnp.where(in_group, destination, num_tiles * tile_rows)
    tile_start = jnp.arange(num_tiles) * tile_rows
    tile_expert = jnp.minimum(jnp.searchsorted(padded_ends, tile_start, side="right"), num_experts - 1)
    return TileLayout(destination, tile_expert, tile_rows)


def grouped_matmul(
    x: Float[Array, "rows d_in"],
    weights: Float[Array, "experts d_in d_out"],
    group_sizes: Int[Array, " experts"],
    layout: TileLayout | None,
) -> Float[Array, "rows d_out"]:
    """Rows sorted by expert times their expert's matrix; rows past the groups give zeros.
    `lax.ragged_dot` (one grouped GEMM on GPU and TPU) when `layout` is None; otherwise tiles of
    rows, each multiplied by its expert's matrix: XLA's CPU backend expands `ragged_dot` into
    every expert on every row, tiles don't."""
    if layout is None:
        in_group = (jnp.arange(x.shape[0]) < group_sizes.sum())[:, None]
        return jnp.where(in_group, jax.lax.ragged_dot(x, weights, group_sizes), 0)
    num_tiles = layout.tile_expert.shape[0]
    scratch = num_tiles * layout.tile_rows  # one extra row receives the rows in no group
    padded = jnp.zeros((scratch + 1, x.shape[1]), x.dtype).at[layout.destination].set(x)
    tiles = padded[:scratch].reshape(num_tiles, layout.tile_rows, x.shape[1])
    out = jnp.einsum("tmi,tio->tmo", tiles, weights[layout.tile_expert]).reshape(scratch, -1)
    return jnp.concatenate([out, jnp.zeros((1, out.shape[1]), out.dtype)])[layout.destination]


class Dispatch(eqx.Module):
    """The (token, expert) slots of one device's experts, sorted by expert: the tokens' rows, the
    group size of each expert, and where each row's output goes back with which weight. Slots
    of other devices' experts sort last, outside every group, with weight zero."""

    rows: Float[Array, "slots dim"]
    group_sizes: Int[Array, " local_experts"]
    slot_token: Int[Array, " slots"]
    slot_weight: Float[Array, " slots"]
    layout: TileLayout | None


def dispatch(
    x: Float[Array, "tokens dim"],
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    first_expert: Int[Array, ""] | int,
    num_local_experts: int,
    num_experts: int,
    capacity_factor: float | None = None,
    tile_rows: int | None = None,
) -> Dispatch:
    """Sort the slots routed to experts [first_expert, first_expert + num_local_experts) by
    expert. With a `capacity_factor`, slots past ceil(capacity_factor x tokens x k / experts) in
    an expert's queue get weight zero (dropped), as capacity-based trainers do."""
    tokens, k = indices.shape
    local_expert = indices.reshape(-1) - first_expert
    is_local = (local_expert >= 0) & (local_expert < num_local_experts)
    sort_key = jnp.where(is_local, local_expert, num_local_experts)
    order = jnp.argsort(sort_key, stable=True)
    group_sizes = jnp.bincount(sort_key, length=num_local_experts + 1)[:num_local_experts].astype(jnp.int32)
    slot_weight = jnp.where(is_local, weights.reshape(-1), 0)[order]
    if capacity_factor is not None:
        capacity = -(-int(capacity_factor * tokens * k) // num_experts)
        starts = jnp.concatenate([jnp.cumsum(group_sizes) - group_sizes, jnp.zeros((1,), jnp.int32)])
        position = jnp.arange(tokens * k) - starts[sort_key[order]]
        slot_weight = jnp.where(position < capacity, slot_weight, 0)
    layout = None if tile_rows is None else tile_layout(group_sizes, tokens * k, tile_rows)
    slot_token = order // k
    return Dispatch(x[slot_token], group_sizes, slot_token, slot_weight, layout)


def combine(out: Float[Array, "slots dim"], d: Dispatch, num_tokens: int) -> Float[Array, "tokens dim"]:
    """Each token's weighted sum of its experts' outputs."""
    weighted = out * d.slot_weight[:, None].astype(out.dtype)
    return jnp.zeros((num_tokens, out.shape[1]), out.dtype).at[d.slot_token].add(weighted)


def expert_ffn(
    d: Dispatch, experts: "Experts", matmul: Callable[[jax.Array, jax.Array, Dispatch], jax.Array]
) -> Float[Array, "slots dim"]:
    """The experts' SwiGLU on the dispatched rows; its three products are tagged for offload."""
    gate = tag(matmul(d.rows, experts.gate, d), "moe_mlpwi_0")
    up = tag(matmul(d.rows, experts.up, d), "moe_mlpwi_1")
    return tag(matmul(jax.nn.silu(gate) * up, experts.down, d), "moe_mlpwo")


def _local_matmul(x: jax.Array, weights: jax.Array, d: Dispatch) -> jax.Array:
    return grouped_matmul(x, weights, d.group_sizes, d.layout)


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


def dropless_moe(
    x: Float[Array, "tokens dim"],
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    experts: Experts,
    capacity_factor: float | None = None,
    tile_rows: int | None = None,
) -> Float[Array, "tokens dim"]:
    """Sort the (token, expert) slots by expert and run each expert on exactly its tokens with
    grouped matmuls (`lax.ragged_dot`, or tiles of `tile_rows` rows): no token is dropped, no
    expert computes a token it was not routed. Under a mesh of several devices the dispatch is
    per device (`expert_parallel_moe`), unless the tokens do not split evenly over the batch axes
    (abstract traces with a toy shape), where XLA partitions the single-device dispatch."""
    mesh = context_mesh()
    if mesh is not None and mesh.size > 1 and x.shape[0] % data_parallel_size(mesh) == 0:
        return expert_parallel_moe(x, indices, weights, experts, mesh, capacity_factor, tile_rows)
    num_experts = experts.gate.shape[0]
    d = dispatch(x, indices, weights, 0, num_experts, num_experts, capacity_factor, tile_rows)
    return combine(expert_ffn(d, experts, _local_matmul), d, x.shape[0])


def expert_parallel_moe(
    x: Float[Array, "tokens dim"],
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    experts: Experts,
    mesh: Any,
    capacity_factor: float | None = None,
    tile_rows: int | None = None,
) -> Float[Array, "tokens dim"]:
    """Dropless MoE with the experts split over the mesh's `expert` axis and the tokens over its
    batch axes. Each device all-gathers the tokens of its `expert` group (the token exchange),
    sorts the slots routed to its own experts, runs them, and a reduce-scatter returns every
    token's sum to the device that holds it. Nothing is dropped: a device's buffers hold every
    slot of its group, the worst case of all of them choosing its experts. The three expert
    products leave the `shard_map` between stages so the offload policy can tag them."""
    num_experts = experts.gate.shape[0]
    expert_shards = mesh.shape["expert"] if "expert" in mesh.axis_names else 1
    check_divisible("num_experts", num_experts, "expert", expert_shards, "choose an expert size that divides it")
    local_experts = num_experts // expert_shards
    rows = batch_spec(mesh)
    expert_split = PartitionSpec("expert") if expert_shards > 1 else PartitionSpec()

    def local_dispatch(x: jax.Array, indices: jax.Array, weights: jax.Array) -> Dispatch:
        first = 0
        if expert_shards > 1:
            x, indices, weights = (jax.lax.all_gather(a, "expert", tiled=True) for a in (x, indices, weights))
            first = jax.lax.axis_index("expert") * local_experts
        return dispatch(x, indices, weights, first, local_experts, num_experts, capacity_factor, tile_rows)

    def local_combine(out: jax.Array, d: Dispatch) -> jax.Array:
        tokens = combine(out, d, d.slot_token.shape[0] // indices.shape[1])
        return jax.lax.psum_scatter(tokens, "expert", tiled=True) if expert_shards > 1 else tokens

    d = jax.shard_map(local_dispatch, mesh=mesh, in_specs=rows, out_specs=rows)(x, indices, weights)
    matmul = jax.shard_map(_local_matmul, mesh=mesh, in_specs=(rows, expert_split, rows), out_specs=rows)
    out = expert_ffn(d, experts, matmul)
    return jax.shard_map(local_combine, mesh=mesh, in_specs=rows, out_specs=rows)(out, d)


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
            x.reshape(batch * seq, dim), indices, weights, self.experts, self.capacity_factor, self.tile_rows
        )
        out = routed.reshape(x.shape) + self.shared(x)
        load = jnp.bincount(indices.reshape(-1), length=scores.shape[-1]).astype(jnp.float32)
        stats = MoEStats(sequence_balance_loss(scores, indices.reshape(batch, seq, -1)), load)
        return out, stats
