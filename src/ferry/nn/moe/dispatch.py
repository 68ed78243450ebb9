"""Dispatch algebra: the (token, expert) slots routed to one device's experts sorted by expert,
windows of them, their rows through a grouped matmul, and the tokens' sums back."""

import functools
import operator

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ferry.nn.moe.megablox import megablox_matmul
from ferry.nn.moe.tiled import TileLayout, gather_rows, tile_layout, tiled_matmul


class Dispatch(eqx.Module):
    """The (token, expert) slots routed to one device's experts, sorted by expert: each row's
    token and routing weight, and each expert's group size. Rows past the groups (slots of other
    devices' experts) hold no token and weight zero."""

    row_token: Int[Array, " rows"]  # past the groups: the number of tokens (no token)
    row_weight: Float[Array, " rows"]
    group_sizes: Int[Array, " local_experts"]
    layout: TileLayout | None  # None: a grouped kernel (`kernel`)
    kernel: str = eqx.field(static=True, default="ragged_dot")  # without a layout: "ragged_dot" or "megablox"
    # the rows a router spreading slots evenly over the experts fills (the first: rows are sorted by
    # expert, other devices' slots last); the planner counts the tiles they need (`expected_work`)
    balanced_rows: int | None = eqx.field(static=True, default=None)  # None: every row

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
        balanced = None if self.balanced_rows is None else max(0, min(self.balanced_rows, stop) - start)
        return Dispatch(
            self.row_token[start:stop], self.row_weight[start:stop], group_sizes, layout, self.kernel, balanced
        )

    def expected_tiles(self) -> int:
        """Of the tile layout's tiles, those the balanced rows fill: each local expert's share of
        them, rounded up to whole tiles."""
        layout = self.layout
        assert layout is not None, "only a tiled dispatch has tiles"
        tiles, experts = layout.tile_expert.shape[0], self.group_sizes.shape[0]
        rows = self.row_token.shape[0] if self.balanced_rows is None else self.balanced_rows
        return min(tiles, experts * -(-rows // (experts * layout.tile_rows)))


def dispatch(
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    first_expert: Int[Array, ""] | int,
    num_local_experts: int,
    tile_rows: int | None = None,
    capacity: int | None = None,
    queue_start: Int[Array, " local_experts"] | int = 0,
    kernel: str = "ragged_dot",
    balanced_rows: int | None = None,
) -> Dispatch:
    """Sort the slots routed to experts [first_expert, first_expert + num_local_experts) by
    expert. With a `capacity`, a slot whose place in its expert's queue (after `queue_start`
    slots queued elsewhere) is `capacity` or later gets weight zero (dropped), as
    capacity-based trainers do. Only index arrays: the tokens are read by the matmul itself.
    Without `tile_rows` the grouped matmul is `kernel` (`grouped_matmul`). `balanced_rows`: how
    many slots a router spreading them evenly sends these experts (None: every slot is theirs)."""
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
    return Dispatch(jnp.where(in_group, order // k, tokens), row_weight, group_sizes, layout, kernel, balanced_rows)


def grouped_matmul(
    x: Float[Array, "n d_in"], weights: Float[Array, "experts d_in d_out"], d: Dispatch, gather: bool
) -> Float[Array, "rows d_out"]:
    """Each dispatched row times its expert's matrix; the row is x's row of the row's token
    (`gather`: x holds the tokens) or x's own row. Rows past the groups give zeros.
    Without a tile layout, the dispatch's grouped kernel: `megablox` (JAX's Pallas kernels on TPU,
    `ferry.nn.moe.megablox`) or `lax.ragged_dot`; with one, tiles (`tiled_matmul`): XLA's CPU and GPU
    backends expand `ragged_dot` and its transposes into every expert on every row."""
    num_rows = d.row_token.shape[0]
    if d.layout is None:
        rows = gather_rows(x, d.row_token) if gather else x
        if d.kernel == "megablox":
            return megablox_matmul(rows, weights.astype(rows.dtype), d.group_sizes)
        in_group = (jnp.arange(num_rows) < d.group_sizes.sum())[:, None]
        return jnp.where(in_group, jax.lax.ragged_dot(rows, weights, d.group_sizes), 0)
    source = d.layout.row
    if gather:
        source = d.row_token.at[source].get(mode="fill", fill_value=x.shape[0])
    return tiled_matmul(num_rows, d.expected_tiles(), x, weights, source, d.layout)


def combine(out: Float[Array, "rows dim"], d: Dispatch, num_tokens: int) -> Float[Array, "tokens dim"]:
    """Each token's sum of its rows (already weighted by `expert_ffn`)."""
    return jnp.zeros((num_tokens, out.shape[1]), out.dtype).at[d.row_token].add(out, mode="drop")


def tagged_windows(d: Dispatch, tagged_rows: int) -> tuple[Dispatch, ...]:
    """The dispatch split where its tagged rows end: the rows before, then the rest if any."""
    num_rows = d.row_token.shape[0]
    if tagged_rows >= num_rows:
        return (d,)
    return d.window(0, tagged_rows), d.window(tagged_rows, num_rows)


def combine_windows(outs: tuple[jax.Array, ...], windows: tuple[Dispatch, ...], num_tokens: int) -> jax.Array:
    """Each token's sum over the windows of its rows."""
    return functools.reduce(operator.add, (combine(out, d, num_tokens) for out, d in zip(outs, windows, strict=True)))


def capacity_per_expert(capacity_factor: float | None, tokens: int, k: int, num_experts: int) -> int | None:
    """Slots per expert queue of `tokens` tokens: ceil(capacity_factor x tokens x k / experts)."""
    return None if capacity_factor is None else -(-int(capacity_factor * tokens * k) // num_experts)


def tagged_row_count(tag_capacity_factor: float | None, tokens: int, k: int, group: int) -> int:
    """Rows of a ring step whose expert products are tagged: ceil(factor x tokens x k / group),
    `factor` times what a balanced router sends a device per step; all (tokens x k) for None."""
    return tokens * k if tag_capacity_factor is None else -(-int(tag_capacity_factor * tokens * k) // group)
