"""The reference attention (`model.attention=xla`): causal grouped-query attention in einsums with
a float32 softmax, chunked over query rows. It runs on every backend; the kernels are checked
against it."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ferry.nn.kernels.flash import ATTENTION_OUT, AttentionKernel, SegmentIds
from ferry.offload.engine import tag
from ferry.sharding import HEADS

QUERY_CHUNK = 512  # query rows whose scores exist at once in a long sequence


def causal_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads v_dim"],
    scale: float,
    query_chunk: int = QUERY_CHUNK,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch seq heads v_dim"]:
    """softmax(q k^T * scale + causal mask) v, each group of heads sharing one key/value head.
    A sequence longer than `query_chunk` is attended `query_chunk` query rows at a time, each
    chunk rematerialised in the backward pass: every row's softmax still sees all its keys, so
    the result is the same, but only one chunk's float32 scores exist at once (DeepSeek-V3 at
    8 x 4096 tokens: 8 GiB instead of 64 GiB per buffer per device). A length that is no
    multiple of the chunk (MTP's seq - 1) pads the queries; the padding rows are dropped.
    With `segment_ids` a query also attends only keys of its own segment (packed documents)."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    if seq <= query_chunk:
        context = attend_rows(q, k, v, scale, 0, segment_ids, segment_ids)
    else:
        num_chunks = -(-seq // query_chunk)
        padding = num_chunks * query_chunk - seq
        q = jnp.pad(q, ((0, 0), (0, padding), (0, 0), (0, 0), (0, 0)))
        chunks = q.reshape(batch, num_chunks, query_chunk, *q.shape[2:]).swapaxes(0, 1)
        starts = jnp.arange(num_chunks) * query_chunk
        if segment_ids is None:
            attend = jax.checkpoint(lambda chunk, start: attend_rows(chunk, k, v, scale, start))
            context = jax.lax.map(lambda args: attend(*args), (chunks, starts))
        else:  # each chunk's query rows carry their own segment ids (padding rows: none of the keys')
            rows = jnp.pad(segment_ids, ((0, 0), (0, padding)), constant_values=-1)
            rows = rows.reshape(batch, num_chunks, query_chunk).swapaxes(0, 1)
            attend = jax.checkpoint(lambda chunk, start, ids: attend_rows(chunk, k, v, scale, start, ids, segment_ids))
            context = jax.lax.map(lambda args: attend(*args), (chunks, starts, rows))
        context = context.swapaxes(0, 1)
        context = context.reshape(batch, num_chunks * query_chunk, *context.shape[3:])[:, :seq]
    return context.reshape(batch, seq, heads, v.shape[-1])


def attend_rows(
    q: Float[Array, "batch rows kv_heads group head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads v_dim"],
    scale: float,
    first_row: Int[Array, ""] | int,
    row_segments: Int[Array, "batch rows"] | None = None,
    key_segments: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch rows kv_heads group v_dim"]:
    """Query rows first_row, first_row + 1, ... against every key, causally masked (and, given
    segment ids, masked to the row's own segment): a chunk of a sequence's queries, or a decode's
    new tokens against its whole preallocated cache (`ferry.generate`; its unwritten slots lie
    after every row, so the mask hides them)."""
    rows, seq = q.shape[1], k.shape[1]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = (first_row + jnp.arange(rows))[:, None] >= jnp.arange(seq)[None, :]
    if row_segments is not None and key_segments is not None:
        same_segment = row_segments[:, :, None] == key_segments[:, None, :]
        mask = (mask[None] & same_segment)[:, None, None]  # batch, 1, 1, rows, seq
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v)


class XlaAttention(AttentionKernel):
    """`causal_attention`, its context tagged `attention_out`. Its backward pass recomputes the
    scores and softmax from q and k (chunk by chunk), whatever the policy saves."""

    def __call__(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        k: Float[Array, "batch seq kv_heads qk_dim"],
        v: Float[Array, "batch seq kv_heads v_dim"],
        scale: float,
        segment_ids: SegmentIds = None,
    ) -> Float[Array, "batch seq heads_v_dim"]:
        batch, seq, heads, _ = q.shape
        context = causal_attention(q, k, v, scale, segment_ids=segment_ids)
        return tag(context.reshape(batch, seq, heads * v.shape[-1]), ATTENTION_OUT, HEADS)

    def describe(self) -> str:
        return "xla (query-chunked einsum softmax, the reference)"
