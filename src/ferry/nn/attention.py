"""Causal grouped-query attention (Llama 3). Softmax in float32."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.nn.linear import Linear
from ferry.nn.rope import Llama3RopeScaling, apply_rope, rope_frequencies
from ferry.offload import tag
from ferry.sharding import EMBED, HEADS

QUERY_CHUNK = 512  # query rows whose scores exist at once in a long sequence

# Packed documents (data.document_mask): each token's segment id and its position in its document,
# both [batch, seq] integers (see ferry.data.segments); None: one causal sequence.
Segments = tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]


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
        context = _attend(q, k, v, scale, 0, segment_ids, segment_ids)
    else:
        num_chunks = -(-seq // query_chunk)
        padding = num_chunks * query_chunk - seq
        q = jnp.pad(q, ((0, 0), (0, padding), (0, 0), (0, 0), (0, 0)))
        chunks = q.reshape(batch, num_chunks, query_chunk, *q.shape[2:]).swapaxes(0, 1)
        starts = jnp.arange(num_chunks) * query_chunk
        if segment_ids is None:
            attend = jax.checkpoint(lambda chunk, start: _attend(chunk, k, v, scale, start))
            context = jax.lax.map(lambda args: attend(*args), (chunks, starts))
        else:  # each chunk's query rows carry their own segment ids (padding rows: none of the keys')
            rows = jnp.pad(segment_ids, ((0, 0), (0, padding)), constant_values=-1)
            rows = rows.reshape(batch, num_chunks, query_chunk).swapaxes(0, 1)
            attend = jax.checkpoint(lambda chunk, start, ids: _attend(chunk, k, v, scale, start, ids, segment_ids))
            context = jax.lax.map(lambda args: attend(*args), (chunks, starts, rows))
        context = context.swapaxes(0, 1)
        context = context.reshape(batch, num_chunks * query_chunk, *context.shape[3:])[:, :seq]
    return context.reshape(batch, seq, heads, v.shape[-1])


def _attend(
    q: Float[Array, "batch rows kv_heads group head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads v_dim"],
    scale: float,
    first_row: Int[Array, ""] | int,
    row_segments: Int[Array, "batch rows"] | None = None,
    key_segments: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch rows kv_heads group v_dim"]:
    """Query rows first_row, first_row + 1, ... against every key, causally masked (and, given
    segment ids, masked to the row's own segment)."""
    rows, seq = q.shape[1], k.shape[1]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = (first_row + jnp.arange(rows))[:, None] >= jnp.arange(seq)[None, :]
    if row_segments is not None and key_segments is not None:
        same_segment = row_segments[:, :, None] == key_segments[:, None, :]
        mask = (mask[None] & same_segment)[:, None, None]  # batch, 1, 1, rows, seq
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v)


class GroupedQueryAttention(eqx.Module):
    query: Linear
    key: Linear
    value: Linear
    out: Linear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    rope_scaling: Llama3RopeScaling | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float,
        rope_scaling: Llama3RopeScaling | None,
        *,
        key: PRNGKeyArray,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.query = Linear(dim, num_heads * head_dim, axes=("embed", "heads"), key=kq)
        self.key = Linear(dim, num_kv_heads * head_dim, axes=("embed", "heads"), key=kk)
        self.value = Linear(dim, num_kv_heads * head_dim, axes=("embed", "heads"), key=kv)
        self.out = Linear(num_heads * head_dim, dim, axes=("heads", "embed"), key=ko)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling

    def __call__(
        self, x: Float[Array, "batch seq dim"], segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"]:
        """`segments`: packed documents' segment ids and positions (None: one sequence)."""
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        q = tag(self.query(x), "query_proj", HEADS).reshape(heads)
        k = tag(self.key(x), "key_proj", HEADS).reshape(heads)
        v = tag(self.value(x), "value_proj", HEADS).reshape(heads)
        frequencies = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        segment_ids, positions = (None, None) if segments is None else segments
        q, k = apply_rope(q, frequencies, positions=positions), apply_rope(k, frequencies, positions=positions)
        context = causal_attention(q, k, v, scale=float(np.sqrt(1.0 / self.head_dim)), segment_ids=segment_ids)
        context = tag(context.reshape(batch, seq, self.num_heads * self.head_dim), "attention_out", HEADS)
        return tag(self.out(context), "out_proj", EMBED)
