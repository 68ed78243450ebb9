"""The tiled grouped matmul and its own backward pass: expert-sorted rows padded into tiles of one
expert each, walked by a `scan`. XLA's CPU and GPU backends expand `lax.ragged_dot` and its
transposes into every expert on every row; the tiles cost only the routed rows."""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ferry.xla.expected_work import expected_work


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


def gather_rows(x: Float[Array, "n d"], index: Int[Array, " m"]) -> Float[Array, "m d"]:
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def tiled_matmul(
    num_out_rows: int,
    expected_tiles: int,
    x: Float[Array, "n d_in"],
    weights: Float[Array, "experts d_in d_out"],
    source: Int[Array, " padded"],
    layout: TileLayout,
) -> Float[Array, "out_rows d_out"]:
    """Tile by tile, x's rows at `source` times the tile's expert matrix, written to the output
    rows `layout.row`. Nothing is materialised per tile but the tile (neither the gathered rows
    nor a copy of the expert's matrix), and a tile with no output row (padding) is skipped at
    run time: the program's static count of the tiles' FLOPs is an upper bound, of which
    `expected_tiles` run where the router balances the experts (`ferry.xla.expected_work`)."""
    return _tiled_forward(num_out_rows, expected_tiles, x, weights, source, layout)


def _tiled_forward(
    num_out_rows: int, expected_tiles: int, x: jax.Array, weights: jax.Array, source: jax.Array, layout: TileLayout
):
    tile_rows, d_out = layout.tile_rows, weights.shape[-1]
    dtype = jnp.result_type(x.dtype, weights.dtype)
    operands = (x, weights, source, layout.row, layout.tile_expert)

    def one_tile(out: jax.Array, tile: jax.Array) -> tuple[jax.Array, None]:
        def product() -> jax.Array:
            return gather_rows(x, _tile_slice(source, tile, tile_rows)) @ weights[layout.tile_expert[tile]]

        skip = functools.partial(_varying_zeros, (tile_rows, d_out), dtype, *operands)
        destination = _tile_slice(layout.row, tile, tile_rows)
        y = jax.lax.cond(jnp.any(destination < num_out_rows), product, skip)
        return out.at[destination].set(y, mode="drop"), None

    out = _carry_zeros((num_out_rows, d_out), dtype, *operands)
    tiles = layout.tile_expert.shape[0]
    with expected_work(expected_tiles, tiles):  # on the loop: XLA may share one body between loops
        return jax.lax.scan(one_tile, out, jnp.arange(tiles))[0]


def _tiled_fwd(
    num_out_rows: int, expected_tiles: int, x: jax.Array, weights: jax.Array, source: jax.Array, layout: TileLayout
):
    return _tiled_forward(num_out_rows, expected_tiles, x, weights, source, layout), (x, weights, source, layout)


def _tiled_bwd(num_out_rows: int, expected_tiles: int, residuals: tuple, cotangent: jax.Array) -> tuple:
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
        g = gather_rows(cotangent, destination)

        def grads() -> tuple[jax.Array, jax.Array]:
            dx_tile = jnp.einsum("ro,io->ri", g, weights[expert], preferred_element_type=dx_dtype)
            dw_tile = jnp.einsum("ri,ro->io", gather_rows(x, rows), g, preferred_element_type=dw_dtype)
            return dx_tile, dw_tile

        def skip() -> tuple[jax.Array, jax.Array]:
            return (
                _varying_zeros((tile_rows, x.shape[1]), dx_dtype, *operands),
                _varying_zeros(weights.shape[1:], dw_dtype, *operands),
            )

        dx_tile, dw_tile = jax.lax.cond(jnp.any(destination < num_out_rows), grads, skip)
        return (dx.at[rows].add(dx_tile, mode="drop"), dw.at[expert].add(dw_tile)), None

    init = (_carry_zeros(x.shape, dx_dtype, *operands), _carry_zeros(weights.shape, dw_dtype, *operands))
    tiles = layout.tile_expert.shape[0]
    with expected_work(expected_tiles, tiles):
        (dx, dw), _ = jax.lax.scan(one_tile, init, jnp.arange(tiles))
    return _cotangent_of(dx, x), _cotangent_of(dw, weights), None, None


tiled_matmul.defvjp(_tiled_fwd, _tiled_bwd)
