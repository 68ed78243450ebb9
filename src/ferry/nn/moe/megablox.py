"""The routed experts' grouped matmul on TPU: JAX's Pallas megablox kernels (`gmm` for the forward
and input-gradient products, `tgmm` for the weight gradient), each costing the routed rows.

XLA:TPU lowers `lax.ragged_dot` and both its transposes to grouped kernels too, at the same FLOPs,
but it feeds the input-gradient kernel a transposed copy of every expert's matrix (a second
[experts, hidden, dim] buffer per product, 7 GiB at DeepSeek-V3's width in bfloat16); `gmm` reads
the matrix transposed in place (`transpose_rhs`). Other backends run the reference (`ragged_dot`
and its VJP): the platform is chosen when the program is lowered, so a CPU process that compiles
for a TPU gets the kernels. `interpret=True` runs the kernels themselves on any backend (tests).
"""

import functools

import jax
import jax.numpy as jnp

# No public API switches shard_map's varying-axes check off around one call: `_unchecked` below.
from jax._src import config as jax_config

# The kernels, from their own module: the package (`jax.experimental.pallas.ops.tpu.megablox`)
# exports only `gmm`, a wrapper with its own VJP and tiling, whose name hides this module as an
# attribute (hence `from ... .gmm import`); ferry's VJP calls the forward kernel (with
# `transpose_rhs` for the input gradient) and the weight-gradient kernel `tgmm` itself.
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm as gmm_kernel
from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm as tgmm_kernel
from jaxtyping import Array, Float, Int

Tile = tuple[int, int, int]  # rows x contracted x output columns per kernel step
# MaxText's default megablox tiling, for the products no measurement chose one for
TILING: Tile = (512, 1024, 1024)
# an expert matrix's (d_in, d_out) -> the tile of its three kernels (forward, input and weight
# gradients), the fastest forward + backward measured on a TPU v5e at DeepSeek-V3's widths, and
# faster than XLA's ragged_dot (`benchmarks/moe_tpu.py`; docs/results/tpu-v5e.md#moe-on-the-chip);
# no tile larger than these fits the kernels' VMEM
TUNED: dict[tuple[int, int], Tile] = {(7168, 2048): (512, 1024, 1024), (2048, 7168): (256, 1024, 1024)}


def _chosen(w: jax.Array, tile: Tile | None) -> Tile:
    """`tile`, or the one measured for `w`'s width (TUNED), or TILING."""
    return tile or TUNED.get((w.shape[1], w.shape[2]), TILING)


def _tiling(m: int, k: int, n: int, tile: Tile) -> Tile:
    """`tile` clipped to the product's shape; rows stay a multiple of 8 (a TPU sublane), so
    small (test) widths take one tile."""
    tm, tk, tn = tile
    return min(tm, -(-m // 8) * 8), min(tk, k), min(tn, n)


def _padded_rows(a: jax.Array, tm: int) -> jax.Array:
    """`a` with zero rows appended up to a multiple of the row tile, as the kernels require
    (none at real widths: tokens x top-k rows are a multiple of 512)."""
    pad = -a.shape[0] % tm
    return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def _unchecked(kernel):
    """`kernel` run without shard_map's varying-axes check, its result typed as varying where
    its operands do: megablox declares its outputs without the varying mesh axes that a kernel
    inside `jax.shard_map` (per-device experts, `ferry.nn.moe.parallel`) must name."""

    @functools.wraps(kernel)
    def call(*operands: object, **kwargs: object) -> jax.Array:
        arrays = [a for a in operands if isinstance(a, jax.Array)]
        axes = tuple(sorted(set().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))))
        with jax_config._check_vma(False):
            out = kernel(*operands, **kwargs)
        return jax.lax.pcast(out, axes, to="varying") if axes else out

    return call


def _in_groups(rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Zeros in the rows past the groups, which `gmm` leaves unwritten when every group is local."""
    return jnp.where((jnp.arange(rows.shape[0]) < group_sizes.sum())[:, None], rows, 0)


def _forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array, interpret: bool, tile: Tile) -> jax.Array:
    m, k = x.shape
    tiling = _tiling(m, k, w.shape[2], tile)
    out = _unchecked(gmm_kernel)(_padded_rows(x, tiling[0]), w, group_sizes, x.dtype, tiling, interpret=interpret)
    return _in_groups(out[:m], group_sizes)


def _input_gradient(g: jax.Array, w: jax.Array, group_sizes: jax.Array, dtype: jnp.dtype, interpret: bool, tile):
    m, n = g.shape
    tiling = _tiling(m, n, w.shape[1], tile)
    gmm = _unchecked(gmm_kernel)
    dx = gmm(_padded_rows(g, tiling[0]), w, group_sizes, dtype, tiling, transpose_rhs=True, interpret=interpret)
    return _in_groups(dx[:m], group_sizes)


def _weight_gradient(x: jax.Array, g: jax.Array, group_sizes: jax.Array, dtype: jnp.dtype, interpret: bool, tile):
    m, k = x.shape
    tiling = _tiling(m, k, g.shape[1], tile)
    x, g = _padded_rows(x, tiling[0]), _padded_rows(g, tiling[0])
    return _unchecked(tgmm_kernel)(x.swapaxes(0, 1), g, group_sizes, dtype, tiling, interpret=interpret)


def _reference_forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, group_sizes)


def _reference_gradients(x: jax.Array, w: jax.Array, group_sizes: jax.Array, g: jax.Array):
    _, pullback = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, group_sizes), x, w)
    return pullback(g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def megablox_matmul(
    x: Float[Array, "rows d_in"],
    w: Float[Array, "experts d_in d_out"],
    group_sizes: Int[Array, " experts"],
    interpret: bool = False,
    tile: Tile | None = None,
) -> Float[Array, "rows d_out"]:
    """Rows [sum(group_sizes[:e]), sum(group_sizes[:e + 1])) of x times expert e's matrix; rows
    past the groups give zeros. x and w share a dtype (the compute dtype). `tile`: every kernel's
    tile (default: `_tiling`'s choice per product)."""
    return _megablox_forward(x, w, group_sizes, interpret, tile)


def _kernel_dtypes(*arrays: jax.Array) -> bool:
    """The kernels take bfloat16 and float32 (a float64 test runs the reference everywhere)."""
    return all(a.dtype in (jnp.bfloat16, jnp.float32) for a in arrays)


def _megablox_forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array, interpret: bool, tile) -> jax.Array:
    tile = _chosen(w, tile)
    if interpret:
        return _forward(x, w, group_sizes, True, tile)
    if not _kernel_dtypes(x, w):
        return _reference_forward(x, w, group_sizes)
    return jax.lax.platform_dependent(
        x, w, group_sizes, tpu=functools.partial(_forward, interpret=False, tile=tile), default=_reference_forward
    )


def _megablox_fwd(x: jax.Array, w: jax.Array, group_sizes: jax.Array, interpret: bool, tile):
    return _megablox_forward(x, w, group_sizes, interpret, tile), (x, w, group_sizes)


def _megablox_bwd(interpret: bool, tile: Tile | None, residuals: tuple, g: jax.Array) -> tuple:
    """Input gradient `gmm(g, w^T)`, weight gradient `tgmm(x^T, g)`: both over the routed rows."""
    x, w, group_sizes = residuals
    g, tile = g.astype(x.dtype), _chosen(w, tile)

    def kernels_(x: jax.Array, w: jax.Array, group_sizes: jax.Array, g: jax.Array, interpret: bool):
        return (
            _input_gradient(g, w, group_sizes, x.dtype, interpret, tile),
            _weight_gradient(x, g, group_sizes, w.dtype, interpret, tile),
        )

    if interpret:
        dx, dw = kernels_(x, w, group_sizes, g, True)
    elif not _kernel_dtypes(x, w):
        dx, dw = _reference_gradients(x, w, group_sizes, g)
    else:
        dx, dw = jax.lax.platform_dependent(
            x,
            w,
            group_sizes,
            g,
            tpu=functools.partial(kernels_, interpret=False),
            default=_reference_gradients,
        )
    return dx, dw, None


megablox_matmul.defvjp(_megablox_fwd, _megablox_bwd)
