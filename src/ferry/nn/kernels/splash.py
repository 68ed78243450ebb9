"""JAX's Pallas splash attention on TPU (`model.attention=splash`, and `auto` on a TPU), in Pallas
interpret mode elsewhere (slow: for the CPU tests).

Shapes the kernel does not take directly are padded, never refused:
- Grouped-query attention runs the MQA kernel once per key/value head (vmapped over batch and
  key/value heads: each call attends that head's group of query heads to one key and one value),
  or, with `gqa="mha"`, the MHA kernel over all heads at once (it maps query heads to key heads).
- The sequence is padded to a multiple of 128 (the lane width) with zero rows (of segment -1
  with packed documents), and the block size is the largest of 1024, 512, 256, 128 that divides
  it (`block_size`). Causality keeps real queries off the padded keys; the padded query rows are
  dropped. DeepSeek's MTP block
  (seq - 1 tokens) pads one row per sequence.
- Head widths are padded with zero columns to a multiple of `head_multiple` (128: a whole MXU
  pass). Zero columns of q and k add nothing to q k^T, zero columns of v give zero output columns
  that are dropped. DeepSeek-V3's MLA (q/k heads 192, v heads 128) pads q and k to 256: the two
  score products (q k^T forward, and again in each backward kernel) cost 256/192 = 1.33x their
  FLOPs and q and k are read 1.33x the bytes; the products with v (v_dim 128) cost nothing more.
  Attention is ~10% of a DeepSeek-V3 layer's FLOPs at seq 4096, so about +2% per layer.
  Mosaic also compiles 192-wide heads unpadded (`head_multiple=64`);
  `benchmarks/attention_tpu.py` measures both.

The forward is the public kernel with `save_residuals=True` (output and log-sum-exp). The backward
calls the kernel module's own backward (`_splash_attention_bwd`, the dq and dkv kernels, or the
fused one) from saved residuals: JAX exposes it only as the kernel's custom VJP, which would
recompute the forward.
"""

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

from ferry.errors import FerryError
from ferry.nn.kernels.flash import FlashAttention, SegmentIds
from ferry.sharding import activation_spec, context_mesh
from ferry.xla.expected_work import expected_work

LANES = 128  # the TPU vector lane width: sequence padding and the smallest block
BLOCK_SIZES = (1024, 512, 256, 128)  # largest first: the largest measured fastest on v5e (`block_size`)
PADDING_SEGMENT = -1  # segment id of padded rows: no real token's (`ferry.data.segments` counts from 0)

# `_splash_attention_bwd`'s parameters in jax 0.10.2 and 0.12 (the kernel module is jax's, not a
# public API: checked, so another release fails with a clear message rather than a TypeError)
_BACKWARD_PARAMETERS = (
    "save_residuals",
    "mask_value",
    "is_mqa",
    "block_sizes",
    "residual_checkpoint_name",
    "mask_function",
    "attn_logits_soft_cap",
    "interpret",
    "res",
    "do",
)


class SplashUnavailableError(FerryError, RuntimeError):
    """This jax's splash kernel module has another backward than the one ferry calls."""


def splash_backward_available() -> bool:
    """Does this jax's splash kernel module have the backward ferry calls?"""
    backward = getattr(splash_kernel, "_splash_attention_bwd", None)
    return backward is not None and tuple(inspect.signature(backward).parameters) == _BACKWARD_PARAMETERS


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def block_size(seq: int) -> int:
    """The splash block (query, key, and their backward blocks alike) for a sequence of `seq`
    tokens: the largest of 1024, 512, 256, 128 dividing `seq` padded to a multiple of 128, as
    blocks of 1024 ran a layer's forward and backward faster than blocks of 512 on a v5e chip
    (docs/results/tpu-v5e.md#attention-kernels)."""
    padded = round_up(seq, LANES)
    return next(b for b in BLOCK_SIZES if padded % b == 0)


class SplashAttention(FlashAttention):
    """Splash attention; `interpret` runs the kernels in Pallas interpret mode (any backend).
    `block` overrides `block_size`'s rule, `fused_backward` (the default) uses the one-kernel
    backward, measured faster on a v5e than the separate dq and dkv kernels, `gqa` chooses the MQA
    kernel per key/value head ("mqa") or the MHA kernel over all heads ("mha"; unfused, it ran slower
    than "mqa" with the fused backward: docs/results/tpu-v5e.md#attention-kernels)."""

    interpret: bool = False
    block: int | None = None
    block_kv_compute: int | None = None
    fused_backward: bool = True
    gqa: str = "mqa"
    head_multiple: int = LANES

    def __check_init__(self) -> None:
        if self.gqa not in ("mqa", "mha"):
            raise ValueError(f"gqa is {self.gqa!r}; use mqa or mha")

    def describe(self) -> str:
        mode = ", Pallas interpret mode" if self.interpret else ""
        blocks = "blocks by sequence" if self.block is None else f"blocks {self.block}"
        return f"splash (Pallas TPU kernel, GQA via {self.gqa.upper()}, {blocks}{mode})"

    def block_sizes(self, seq: int) -> splash.BlockSizes:
        b = self.block or block_size(seq)
        compute = self.block_kv_compute or b
        dq = None if self.fused_backward else b  # the fused backward has no dq kernel (BlockSizes refuses its blocks)
        return splash.BlockSizes(
            block_q=b,
            block_kv=b,
            block_kv_compute=compute,
            block_q_dkv=b,
            block_kv_dkv=b,
            block_kv_dkv_compute=compute,
            block_q_dq=dq,
            block_kv_dq=dq,
            use_fused_bwd_kernel=self.fused_backward,
        )

    def _kernel(self, seq: int, heads: int) -> Any:
        """The kernel for `heads` query heads (a group in MQA mode) over `seq` (padded) tokens;
        its masks' block tables are built once per shape by jax (`_process_mask` is cached)."""
        mask = splash.MultiHeadMask([splash.CausalMask((seq, seq))] * heads)
        make = splash.make_splash_mqa_single_device if self.gqa == "mqa" else splash.make_splash_mha_single_device
        return make(mask, block_sizes=self.block_sizes(seq), save_residuals=True, interpret=self.interpret)

    def _causal_work(self, seq: int) -> Any:
        """The share of the kernel's grid that runs: the block pairs the causal mask leaves a query
        to attend to (n (n + 1) / 2 of n x n blocks, each computed whole), marked for the planner's
        FLOP count (`ferry.xla.expected_work`); packed documents skip more, unknown before the data."""
        blocks = seq // self.block_sizes(seq).block_q
        return expected_work(blocks * (blocks + 1) // 2, blocks * blocks)

    # ---------------------------------------------------------------------------------------
    # Layout: ferry's (batch, seq, heads, dim) <-> the kernel's (batch, [kv_heads,] heads, seq, dim)

    def _to_kernel(
        self, q: Array, k: Array, v: Array, scale: float, segment_ids: SegmentIds
    ) -> tuple[Array, Array, Array, Array]:
        batch, seq, heads, _ = q.shape
        kv_heads = k.shape[2]
        padded_seq = round_up(seq, LANES)
        qk_dim, v_dim = round_up(q.shape[-1], self.head_multiple), round_up(v.shape[-1], self.head_multiple)

        def pad(t: Array, width: int) -> Array:
            return jnp.pad(t, ((0, 0), (0, padded_seq - seq), (0, 0), (0, width - t.shape[-1])))

        q = pad((q.astype(jnp.float32) * scale).astype(q.dtype), qk_dim)  # splash takes pre-scaled queries
        k, v = pad(k, qk_dim), pad(v, v_dim)
        if self.gqa == "mqa":  # (batch, kv_heads, group, seq, dim)
            q = q.reshape(batch, padded_seq, kv_heads, heads // kv_heads, qk_dim).transpose(0, 2, 3, 1, 4)
        else:  # (batch, heads, seq, dim)
            q = q.transpose(0, 2, 1, 3)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        ids = jnp.zeros((batch, seq), jnp.int32) if segment_ids is None else segment_ids
        ids = jnp.pad(ids, ((0, 0), (0, padded_seq - seq)), constant_values=PADDING_SEGMENT)
        return q, k, v, ids

    def _rows_to_kernel(self, t: Array, kv_heads: int, width: int | None) -> Array:
        """An output-shaped (batch, seq, heads[, dim]) value in the kernel's layout, padded."""
        batch, seq, heads = t.shape[:3]
        padded_seq = round_up(seq, LANES)
        pads = [(0, 0), (0, padded_seq - seq), (0, 0)] + ([] if width is None else [(0, width - t.shape[-1])])
        t = jnp.pad(t, pads)
        if self.gqa == "mqa":
            t = t.reshape(batch, padded_seq, kv_heads, heads // kv_heads, *t.shape[3:])
            return jnp.moveaxis(t, 1, 3)  # (batch, kv_heads, group, seq[, dim])
        return jnp.moveaxis(t, 1, 2)  # (batch, heads, seq[, dim])

    def _rows_from_kernel(self, t: Array, seq: int, width: int | None) -> Array:
        """The inverse of `_rows_to_kernel`: (batch, seq, heads[, dim]), padding dropped."""
        if self.gqa == "mqa":
            t = jnp.moveaxis(t, 3, 1)
            t = t.reshape(t.shape[0], t.shape[1], -1, *t.shape[4:])
        else:
            t = jnp.moveaxis(t, 2, 1)
        t = t[:, :seq]
        return t if width is None else t[..., :width]

    def _per_example(self, fn: Callable[..., Any], *args: Array) -> Any:
        """`fn(q, k, v, segment_ids, *rest)` of one example (and one key/value head in MQA mode),
        mapped over the batch (and the key/value heads, which the segment ids do not have)."""
        if self.gqa == "mqa":
            fn = jax.vmap(fn, in_axes=(0, 0, 0, None) + (0,) * (len(args) - 4))
        return jax.vmap(fn)(*args)

    # ---------------------------------------------------------------------------------------

    def forward(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        k: Float[Array, "batch seq kv_heads qk_dim"],
        v: Float[Array, "batch seq kv_heads v_dim"],
        scale: float,
        segment_ids: SegmentIds,
    ) -> tuple[Float[Array, "batch seq heads v_dim"], Float[Array, "batch seq heads"]]:
        seq, v_dim = q.shape[1], v.shape[-1]

        def local(q: Array, k: Array, v: Array, ids: Array) -> tuple[Array, Array]:
            kq, kk, kv, kids = self._to_kernel(q, k, v, scale, ids if segment_ids is not None else None)
            kernel = self._kernel(kq.shape[-2], kq.shape[-3])

            def one(q: Array, k: Array, v: Array, ids: Array) -> tuple[Array, Array]:
                with self._causal_work(kq.shape[-2]):
                    out, (lse,) = kernel(q, k, v, _segments(ids, segment_ids is not None))
                return out, lse

            out, lse = self._per_example(one, kq, kk, kv, kids)
            return self._rows_from_kernel(out, seq, v_dim), self._rows_from_kernel(lse, seq, None)

        return _sharded(local, q, k, v, segment_ids, outputs=("out", "lse"))

    def backward(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        k: Float[Array, "batch seq kv_heads qk_dim"],
        v: Float[Array, "batch seq kv_heads v_dim"],
        out: Float[Array, "batch seq heads v_dim"],
        lse: Float[Array, "batch seq heads"],
        d_out: Float[Array, "batch seq heads v_dim"],
        scale: float,
        segment_ids: SegmentIds,
    ) -> tuple[Array, Array, Array]:
        if not splash_backward_available():
            raise SplashUnavailableError(
                f"jax {jax.__version__}'s splash kernel module has no backward ferry knows how to call "
                "(_splash_attention_bwd changed); use model.attention=xla"
            )
        seq, qk_dim, v_dim = q.shape[1], q.shape[-1], v.shape[-1]
        out_dtype = out.dtype

        def local(q: Array, k: Array, v: Array, ids: Array, out: Array, lse: Array, d_out: Array) -> tuple:
            kv_heads = k.shape[2]  # this device's, under a mesh that splits the heads
            kq, kk, kv, kids = self._to_kernel(q, k, v, scale, ids if segment_ids is not None else None)
            kernel = self._kernel(kq.shape[-2], kq.shape[-3])
            options = kernel.kwargs
            width = kv.shape[-1]
            # padded rows: zero output, cotangent and log-sum-exp; their q is zero, so every
            # probability is 0 or 1 and the zero cotangent adds nothing
            kout = self._rows_to_kernel(out.astype(out_dtype), kv_heads, width)
            klse = self._rows_to_kernel(lse, kv_heads, None)
            kd_out = self._rows_to_kernel(d_out.astype(out_dtype), kv_heads, width)
            dq_info, dkv_info = (_collapsed(i) for i in (kernel.dq_mask_info, kernel.dkv_mask_info))

            def one(q: Array, k: Array, v: Array, ids: Array, out: Array, lse: Array, d_out: Array) -> tuple:
                segments = _segments(ids, segment_ids is not None)
                residuals = (q, k, v, segments, None, out, lse, dq_info, dkv_info)
                with self._causal_work(kq.shape[-2]):
                    grads = splash_kernel._splash_attention_bwd(  # noqa: SLF001 (see the module docstring)
                        False,
                        options["mask_value"],
                        options["is_mqa"],
                        options["block_sizes"],
                        None,
                        options["mask_function"],
                        options["attn_logits_soft_cap"],
                        self.interpret,
                        residuals,
                        d_out,
                    )
                return grads[3:6]

            dq, dk, dv = self._per_example(one, kq, kk, kv, kids, kout, klse, kd_out)
            dq = self._rows_from_kernel(dq, seq, qk_dim).astype(jnp.float32) * scale
            dk = jnp.moveaxis(dk, 2, 1)[:, :seq, :, :qk_dim]
            dv = jnp.moveaxis(dv, 2, 1)[:, :seq, :, :v_dim]
            return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

        return _sharded(local, q, k, v, segment_ids, out, lse, d_out, outputs=("q", "k", "v"))


def _segments(ids: Array, segmented: bool) -> Any:
    """The kernel's segment ids: only for packed documents. Padded rows need none: they follow
    every real token, which the causal mask keeps off them (and the unsegmented kernels skip the
    per-block id comparisons)."""
    return splash.SegmentIds(ids, ids) if segmented else None


def _collapsed(info: Any) -> Any:
    """A mask table as the kernel's own entry point passes it on (partial mask blocks flattened
    to one leading axis, as `_splash_attention` does)."""
    if info is None or info.partial_mask_blocks is None:
        return info
    return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(-1, *info.partial_mask_blocks.shape[-2:]))


# ------------------------------------------------------------------------------------------
# Sharding: a Pallas kernel has no partitioning rule, so on a mesh of several devices it runs
# under shard_map on each device's rows and heads (batch over the batch axes, heads over
# `tensor` where both the query and the key heads divide; the sequence is never split).


def _sharded(
    fn: Callable[..., Any],
    q: Array,
    k: Array,
    v: Array,
    segment_ids: SegmentIds,
    *rest: Array,
    outputs: tuple[str, ...],
) -> Any:
    mesh = context_mesh()
    ids = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
    if mesh is None or mesh.size == 1:
        return fn(q, k, v, ids, *rest)
    heads_split = activation_spec(q, ("batch", "seq", "heads", None), mesh)[2] is not None and (
        activation_spec(k, ("batch", "seq", "heads", None), mesh)[2] is not None
    )
    heads = "heads" if heads_split else None
    batch_spec = activation_spec(q, ("batch", "seq", heads, None), mesh)
    spec = {
        4: batch_spec,
        3: PartitionSpec(*batch_spec[:3]),
        2: PartitionSpec(*batch_spec[:1], None),
    }
    args = (q, k, v, ids, *rest)
    in_specs = tuple(spec[a.ndim] for a in args)
    out_specs = {"out": spec[4], "lse": spec[3], "q": spec[4], "k": spec[4], "v": spec[4]}
    return jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=tuple(out_specs[o] for o in outputs), check_vma=False
    )(*args)
