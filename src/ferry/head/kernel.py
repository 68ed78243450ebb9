"""One chunk of the fused loss head (`ferry.head.fused`) as a Pallas TPU kernel
(`train.loss_kernel=pallas`): the chunk's logits, their log-sum-exp and target logit, the
logits' gradient and the hidden state's gradient, with the logits only ever in VMEM.

Why: XLA's fused head writes the chunk's float32 logits to HBM and reads them back for the
log-sum-exp and again for the softmax. On a v5e chip, in one chunk, the kernel is faster than both
XLA's fused head and the whole logits, alone and in a full_remat train step in less HBM; in eight
chunks it is faster than XLA's (the weight gradient's float32 sum read and written once per chunk
either way). The figures: docs/results/loss-head.md, "The Pallas kernel".

How: the grid walks blocks of `HeadTiles.rows` tokens; for each it walks the vocabulary in tiles of
`HeadTiles.columns` columns twice. The first walk makes each tile's logits (rounded to the compute
dtype, as the whole logits are), keeps them in a VMEM scratch of rows x vocabulary, and
folds them into a running maximum and sum (the log-sum-exp) and the target's logit. The second
walk reads them back from VMEM, writes the tile of the logits' gradient in the compute dtype
(the weight's gradient is one matmul of it with the hidden state, left to XLA: it sums over every
token, across the blocks) and adds its product with the weight's tile to the block's hidden-state
gradient, summed in float32. So the head still runs three logits-sized matmuls; the logits cost
no HBM traffic, the gradient of the logits one write and one read in the compute dtype.

The weight is walked in full once per pass per block of tokens: the block's rows set how often
(the weight's tile is pipelined under the matmul when the block has enough rows, about 240 on a
v5e chip). The scratch is rows x vocabulary x 2 bytes of VMEM (`vmem_bytes`); the
largest block within the core's VMEM less 16 MiB is taken (`choose_tiles`), as larger blocks walk
the weight less often and ran faster on v5e. Each step's vector work is on the tile before or after
its matmul's, so Mosaic issues the two side by side, which made the kernel faster than XLA
(docs/results/tpu-v5e.md, run 11).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from ferry.xla.expected_work import expected_work

BLOCK_ROWS = (
    1024,
    512,
    256,
    128,
    64,
    32,
    16,
    8,
)  # multiples of every sublane tile  # largest first: fewer walks of the weight
BLOCK_COLUMNS = 512
V5E_VMEM = 128 * 2**20  # a v5e TensorCore's VMEM (and a v6e's)
SPARE_VMEM = 16 * 2**20  # of a core's VMEM, left to Mosaic's own buffers


@dataclasses.dataclass(frozen=True)
class HeadTiles:
    """The kernel's blocks: `rows` tokens by `columns` vocabulary columns, within `vmem` bytes of
    VMEM (the core's)."""

    rows: int
    columns: int
    vmem: int = V5E_VMEM


def vmem_capacity(device_kind: str | None) -> int | None:
    """A TensorCore's VMEM on a TPU of `device_kind` ("TPU v5 lite": 128 MiB), from JAX's table of
    chips (a private module: None where it is missing or does not name the kind)."""
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError:
        return None
    chip = tpu_info.chip_version_from_device_kind(device_kind) if device_kind else None
    return None if chip is None else int(tpu_info.get_tpu_info_for_chip(chip, 1).vmem_capacity_bytes)


def vmem_bytes(tiles: HeadTiles, vocab: int, dim: int, itemsize: int = 2) -> int:
    """The kernel's VMEM: the logits scratch, the float32 hidden-gradient sum, and the pipeline's
    double buffers of the hidden rows, the weight's tile, and both gradients' blocks."""
    padded_vocab = pl.cdiv(vocab, tiles.columns) * tiles.columns
    scratch = tiles.rows * (padded_vocab + 2 * tiles.columns) * itemsize + tiles.rows * dim * 4
    buffers = 2 * itemsize * (2 * tiles.rows * dim + dim * tiles.columns + tiles.rows * tiles.columns)
    return scratch + buffers + 8 * tiles.rows * tiles.columns * 4  # float32 temporaries of a tile


def choose_tiles(tokens: int, vocab: int, dim: int, itemsize: int = 2, vmem: int = V5E_VMEM) -> HeadTiles:
    """The largest block of rows whose VMEM fits `vmem` less `SPARE_VMEM` and that divides the
    tokens padded to a whole sublane tile (`sublanes`: no padding, hence no copy, when the tokens
    fill whole tiles)."""
    padded = padded_tokens(tokens, itemsize)
    for rows in BLOCK_ROWS:
        tiles = HeadTiles(rows, BLOCK_COLUMNS, vmem)
        if rows <= padded and padded % rows == 0 and vmem_bytes(tiles, vocab, dim, itemsize) <= vmem - SPARE_VMEM:
            return tiles
    raise ValueError(f"no block of rows fits {vmem / 2**20:.0f} MiB of VMEM at a vocabulary of {vocab:,}")


def sublanes(itemsize: int) -> int:
    """Rows of a TPU vector register tile at this width: 8 of 32 bits, 16 of 16 (packed)."""
    return 8 * max(1, 4 // itemsize)


def padded_tokens(tokens: int, itemsize: int) -> int:
    return pl.cdiv(tokens, sublanes(itemsize)) * sublanes(itemsize)


def _block_specs(tiles: HeadTiles, dim: int, vocab_axis: int) -> tuple[list, list]:
    """The blocks each grid step (block of rows i, walk p, tile j) reads and writes: the rows'
    targets, shares and hidden states and the weight's tile j; the rows' log-sum-exp, target
    logit, their logits' gradient at tile j and their hidden-state gradient."""
    per_row = pl.BlockSpec((tiles.rows, 1), lambda i, p, j: (i, 0))
    if vocab_axis == 1:
        weight_tile = pl.BlockSpec((dim, tiles.columns), lambda i, p, j: (0, j))
    else:
        weight_tile = pl.BlockSpec((tiles.columns, dim), lambda i, p, j: (j, 0))
    rows = pl.BlockSpec((tiles.rows, dim), lambda i, p, j: (i, 0))
    # the second walk's tiles; during the first the block stays at column 0, unwritten
    d_logits = pl.BlockSpec((tiles.rows, tiles.columns), lambda i, p, j: (i, j * p))
    return [per_row, per_row, rows, weight_tile], [per_row, per_row, d_logits, rows]


@functools.partial(jax.jit, static_argnames=("tiles", "vocab_axis", "z_loss_weight", "interpret"))
def head_chunk(
    rows: Float[Array, "tokens dim"],
    weight: Float[Array, "..."],
    targets: Int[Array, " tokens"],
    share: Float[Array, " tokens"],
    tiles: HeadTiles,
    vocab_axis: int = 1,
    z_loss_weight: float = 0.0,
    interpret: bool = False,
) -> tuple[Float[Array, " tokens"], Float[Array, " tokens"], Float[Array, "tokens vocab"], Float[Array, "tokens dim"]]:
    """Each token's log-sum-exp and target logit (float32), the logits' gradient and the rows'
    gradient (compute dtype) of the loss `sum(share * (lse - target) + z * share * lse^2)`.
    `weight` is [dim, vocab] (`vocab_axis=1`) or [vocab, dim] (0, a tied embedding), in the rows'
    dtype."""
    tokens, dim = rows.shape
    vocab = weight.shape[vocab_axis]
    padded = padded_tokens(tokens, rows.dtype.itemsize)
    if padded != tokens:  # rows of no share: nothing counts them; their outputs are dropped
        rows, targets, share = (
            jnp.pad(x, [(0, padded - tokens)] + [(0, 0)] * (x.ndim - 1)) for x in (rows, targets, share)
        )
    walks = pl.cdiv(vocab, tiles.columns)
    kernel = functools.partial(
        _kernel, walks=walks, vocab=vocab, vocab_axis=vocab_axis, z=z_loss_weight, columns=tiles.columns
    )
    in_specs, out_specs = _block_specs(tiles, dim, vocab_axis)
    # for the planner: the body holds both walks' matmuls, each run in half the grid's steps (a scope
    # inside the body would put trace markers around its matmuls, which Mosaic keeps)
    with expected_work(1, 2):
        lse, target_logit, d_logits, d_rows = pl.pallas_call(
            kernel,
            grid=(padded // tiles.rows, 2, walks),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=[
                jax.ShapeDtypeStruct((padded, 1), jnp.float32),
                jax.ShapeDtypeStruct((padded, 1), jnp.float32),
                jax.ShapeDtypeStruct((padded, vocab), rows.dtype),
                jax.ShapeDtypeStruct((padded, dim), rows.dtype),
            ],
            scratch_shapes=[
                pltpu.VMEM((walks, tiles.rows, tiles.columns), rows.dtype),
                pltpu.VMEM((tiles.rows, 1), jnp.float32),  # running maximum
                pltpu.VMEM((tiles.rows, 1), jnp.float32),  # running sum of exponentials
                pltpu.VMEM((2, tiles.rows, tiles.columns), rows.dtype),  # the logits' gradient, a tile ahead
                pltpu.VMEM((tiles.rows, dim), jnp.float32),  # the rows' gradient, summed over tiles
            ],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                vmem_limit_bytes=min(vmem_bytes(tiles, vocab, dim, rows.dtype.itemsize) + SPARE_VMEM, tiles.vmem),
            ),
            interpret=interpret,
            cost_estimate=cost_estimate(padded, vocab, dim, tiles, rows.dtype.itemsize, weight.dtype.itemsize),
        )(targets[:, None].astype(jnp.int32), share[:, None].astype(jnp.float32), rows, weight)
    return lse[:tokens, 0], target_logit[:tokens, 0], d_logits[:tokens], d_rows[:tokens]


def cost_estimate(tokens: int, vocab: int, dim: int, tiles: HeadTiles, itemsize: int, weight_itemsize: int):
    """What the kernel does, for XLA's cost analysis and the planner (`ferry.xla.hlo_flops`,
    `ferry.xla.hlo_bytes`), which cannot see into a Mosaic kernel: two logits-sized matmuls (the
    logits, and the hidden state's gradient from the logits' gradient), an exponential per logit
    in each walk; in HBM the weight read in full twice per block of tokens, the rows read, and
    the logits' and the rows' gradients written."""
    blocks = tokens // tiles.rows
    moved = (
        blocks * 2 * vocab * dim * weight_itemsize
        + tokens * dim * itemsize * 2  # the rows in, their gradient out
        + tokens * vocab * itemsize  # the logits' gradient
        + tokens * 4 * 4  # targets and shares in, log-sum-exp and target logit out
    )
    return pl.CostEstimate(
        flops=4 * tokens * vocab * dim, transcendentals=2 * tokens * vocab, bytes_accessed=int(moved)
    )


def _kernel(
    targets_ref, share_ref, rows_ref, weight_ref, lse_ref, target_ref, d_logits_ref, d_rows_ref,
    logits_ref, max_ref, sum_ref, next_ref, d_sum_ref, *, walks, vocab, vocab_axis, z, columns,
):  # fmt: skip
    """One step of the grid: (block of rows, walk, tile)."""
    step = _Step(
        targets_ref, share_ref, rows_ref, weight_ref, lse_ref, target_ref, d_logits_ref, d_rows_ref,
        logits_ref, max_ref, sum_ref, next_ref, d_sum_ref, walks, vocab, vocab_axis, z, columns, pl.program_id(2),
    )  # fmt: skip
    pl.when(pl.program_id(1) == 0)(step.first_walk)
    pl.when(pl.program_id(1) == 1)(step.second_walk)


@dataclasses.dataclass
class _Step:
    """A grid step's refs and the kernel's static shape. Each step's vector work is on another
    tile than its matmul (the tile before in the first walk, the tile after in the second), so
    the two do not wait on each other and Mosaic can issue them side by side."""

    targets_ref: Any
    share_ref: Any
    rows_ref: Any
    weight_ref: Any
    lse_ref: Any
    target_ref: Any
    d_logits_ref: Any
    d_rows_ref: Any
    logits_ref: Any  # scratch: the block's logits, every tile, in the compute dtype
    max_ref: Any
    sum_ref: Any
    next_ref: Any  # scratch: the logits' gradient of this tile and the next (the second walk)
    d_sum_ref: Any
    walks: int
    vocab: int
    vocab_axis: int
    z: float
    columns: int
    tile: Array  # the grid's third index (read outside the walks' branches: interpret mode needs it so)

    def column(self, index: Array | int) -> Array:
        return index * self.columns + jax.lax.broadcasted_iota(jnp.int32, (self.rows_ref.shape[0], self.columns), 1)

    def logits_of(self, index: Array | int) -> Array:
        logits = self.logits_ref[index].astype(jnp.float32)
        if self.vocab % self.columns:  # the last tile reads past the vocabulary: no column there counts
            logits = jnp.where(self.column(index) < self.vocab, logits, -jnp.inf)
        return logits

    def fold(self, index: Array, counts: Array | bool) -> None:
        """Tile `index`'s logits into the running maximum, sum and target logit (where `counts`)."""
        logits = self.logits_of(index)
        target = self.target_ref[...] + jnp.sum(
            jnp.where(self.column(index) == self.targets_ref[...], logits, 0.0), axis=1, keepdims=True
        )
        new_max = jnp.maximum(self.max_ref[...], jnp.max(logits, axis=1, keepdims=True))
        new_sum = jnp.exp(self.max_ref[...] - new_max) * self.sum_ref[...]
        new_sum += jnp.sum(jnp.exp(logits - new_max), axis=1, keepdims=True)
        self.target_ref[...] = jnp.where(counts, target, self.target_ref[...])
        self.max_ref[...] = jnp.where(counts, new_max, self.max_ref[...])
        self.sum_ref[...] = jnp.where(counts, new_sum, self.sum_ref[...])

    def gradient(self, index: Array | int) -> Array:
        """Tile `index`'s gradient of the logits, in the compute dtype (zero past the vocabulary)."""
        lse, share = self.lse_ref[...], self.share_ref[...]
        softmax = jnp.exp(self.logits_of(index) - lse)
        hit = self.column(index) == self.targets_ref[...]
        return (share * (1.0 + 2.0 * self.z * lse) * softmax - jnp.where(hit, share, 0.0)).astype(self.next_ref.dtype)

    def first_walk(self) -> None:
        """This tile's logits into the scratch; the tile before folded into the log-sum-exp."""
        tile = self.tile

        @pl.when(tile == 0)
        def _start():
            self.max_ref[...] = jnp.full(self.max_ref.shape, -jnp.inf, jnp.float32)
            self.sum_ref[...] = jnp.zeros(self.sum_ref.shape, jnp.float32)
            self.target_ref[...] = jnp.zeros(self.target_ref.shape, jnp.float32)

        contract = ((1,), (0,)) if self.vocab_axis == 1 else ((1,), (1,))
        product = jax.lax.dot_general(
            self.rows_ref[...], self.weight_ref[...], (contract, ((), ())), preferred_element_type=jnp.float32
        )
        self.fold(jnp.maximum(tile - 1, 0), tile > 0)  # the tile before, made by the step before
        self.logits_ref[tile] = product.astype(self.logits_ref.dtype)  # rounded as the whole logits are

        @pl.when(tile == self.walks - 1)
        def _finish():
            self.fold(tile, True)
            self.lse_ref[...] = self.max_ref[...] + jnp.log(self.sum_ref[...])
            self.next_ref[0] = self.gradient(0)  # the second walk's first tile

    def second_walk(self) -> None:
        """This tile's logits' gradient written and multiplied into the rows' gradient; the next
        tile's made."""
        tile = self.tile

        @pl.when(tile == 0)
        def _start():
            self.d_sum_ref[...] = jnp.zeros(self.d_sum_ref.shape, jnp.float32)

        d_logits = self.next_ref[tile % 2]  # made by the step before
        self.d_logits_ref[...] = d_logits
        following = self.gradient(jnp.minimum(tile + 1, self.walks - 1))  # the next step's, past the end unused
        weight = self.weight_ref[...]
        if self.vocab % self.columns:  # past the vocabulary the tile holds whatever memory follows: zero it, NaNs too
            inside = tile * self.columns + jax.lax.broadcasted_iota(jnp.int32, weight.shape, self.vocab_axis)
            weight = jnp.where(inside < self.vocab, weight, jnp.zeros_like(weight))
        contract = ((1,), (1,)) if self.vocab_axis == 1 else ((1,), (0,))
        self.d_sum_ref[...] += jax.lax.dot_general(
            d_logits, weight, (contract, ((), ())), preferred_element_type=jnp.float32
        )
        self.next_ref[(tile + 1) % 2] = following

        @pl.when(tile == self.walks - 1)
        def _finish():
            self.d_rows_ref[...] = self.d_sum_ref[...].astype(self.d_rows_ref.dtype)
