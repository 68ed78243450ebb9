"""Causal grouped-query attention (Llama 3; Qwen3's with per-head query and key norms). Softmax in
float32; the kernel is `model.attention`'s (`ferry.nn.kernels.choice`)."""

import abc
from typing import Any, final

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.final import refuse_final_bases
from ferry.nn.kernels.choice import attend
from ferry.nn.kernels.xla import QUERY_CHUNK, causal_attention
from ferry.nn.linear import Linear
from ferry.nn.norm import RMSNorm
from ferry.nn.rope import Llama3RopeScaling, apply_rope, rope_frequencies
from ferry.offload.engine import tag
from ferry.sharding import EMBED, HEADS

__all__ = [
    "QUERY_CHUNK",
    "AbstractGroupedQueryAttention",
    "GroupedQueryAttention",
    "QKNormedAttention",
    "Segments",
    "causal_attention",
    "grouped_query_attention",
]

# Packed documents (data.document_mask): each token's segment id and its position in its document,
# both [batch, seq] integers (see ferry.data.segments); None: one causal sequence.
Segments = tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]


class AbstractGroupedQueryAttention(eqx.Module):
    """Causal GQA with RoPE (llama3-scaled where `rope_scaling` says), scale head_dim^-0.5: the fields
    and the forward pass every variant shares; a final class says which query and key heads RoPE
    rotates (and adds what it needs for that). Built by `grouped_query_attention`."""

    query: Linear
    key: Linear
    value: Linear
    out: Linear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    rope_scaling: Llama3RopeScaling | None = eqx.field(static=True)
    attention: str = eqx.field(static=True)  # model.attention: auto, xla, splash or cudnn

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_final_bases(cls)

    @abc.abstractmethod
    def query_and_key(
        self, q: Float[Array, "batch seq heads head_dim"], k: Float[Array, "batch seq kv_heads head_dim"]
    ) -> tuple[Float[Array, "batch seq heads head_dim"], Float[Array, "batch seq kv_heads head_dim"]]:
        """The query and key heads RoPE rotates, from the projections'."""

    def softmax_scale(self) -> float:
        """head_dim^-0.5, what the attention scores are multiplied by."""
        return float(np.sqrt(1.0 / self.head_dim))

    def rotated_heads(
        self, x: Float[Array, "batch seq dim"], positions: Int[Array, "batch seq"] | None = None
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """The query, key and value heads attention reads, RoPE applied at `positions` (None: 0,
        1, ...): the forward pass's, and what a decode with a cache (`ferry.generate`) keeps."""
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        # the projections are tagged (linear outputs: a saved value's tangent needs nothing
        # recomputed); per-head norms and RoPE are recomputed from them
        q = tag(self.query(x), "query_proj", HEADS).reshape(heads)
        k = tag(self.key(x), "key_proj", HEADS).reshape(heads)
        q, k = self.query_and_key(q, k)
        v = tag(self.value(x), "value_proj", HEADS).reshape(heads)
        frequencies = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        q, k = apply_rope(q, frequencies, positions=positions), apply_rope(k, frequencies, positions=positions)
        return q, k, v

    def __call__(
        self, x: Float[Array, "batch seq dim"], segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"]:
        """`segments`: packed documents' segment ids and positions (None: one sequence)."""
        segment_ids, positions = (None, None) if segments is None else segments
        q, k, v = self.rotated_heads(x, positions)
        context = attend(self.attention, q, k, v, self.softmax_scale(), segment_ids)
        return tag(self.out(context), "out_proj", EMBED)


@final
class GroupedQueryAttention(AbstractGroupedQueryAttention):
    """Llama's GQA: RoPE rotates the projections' query and key heads as they are."""

    def query_and_key(
        self, q: Float[Array, "batch seq heads head_dim"], k: Float[Array, "batch seq kv_heads head_dim"]
    ) -> tuple[Float[Array, "batch seq heads head_dim"], Float[Array, "batch seq kv_heads head_dim"]]:
        return q, k


@final
class QKNormedAttention(AbstractGroupedQueryAttention):
    """GQA whose query and key heads each pass an RMSNorm over head_dim (one weight shared by all
    heads) before RoPE, as Hugging Face's `Qwen3Attention`. A class of its own, not a field that
    may be None, so plain GQA's parameter tree (its checkpoints) is unchanged."""

    query_norm: RMSNorm
    key_norm: RMSNorm

    def query_and_key(
        self, q: Float[Array, "batch seq heads head_dim"], k: Float[Array, "batch seq kv_heads head_dim"]
    ) -> tuple[Float[Array, "batch seq heads head_dim"], Float[Array, "batch seq kv_heads head_dim"]]:
        return self.query_norm(q), self.key_norm(k)


def grouped_query_attention(
    dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope_theta: float,
    rope_scaling: Llama3RopeScaling | None,
    *,
    key: PRNGKeyArray,
    attention: str = "auto",
    qk_norm_eps: float | None = None,
) -> AbstractGroupedQueryAttention:
    """GQA with one option: `qk_norm_eps` (not None) norms every query and key head
    (`QKNormedAttention`, Qwen3's); without it, `GroupedQueryAttention`."""
    kq, kk, kv, ko = jax.random.split(key, 4)
    fields = (  # every variant's, in the order its fields are declared
        Linear(dim, num_heads * head_dim, axes=("embed", "heads"), key=kq),  # query
        Linear(dim, num_kv_heads * head_dim, axes=("embed", "heads"), key=kk),  # key
        Linear(dim, num_kv_heads * head_dim, axes=("embed", "heads"), key=kv),  # value
        Linear(num_heads * head_dim, dim, axes=("heads", "embed"), key=ko),  # out
        num_heads,
        num_kv_heads,
        head_dim,
        rope_theta,
        rope_scaling,
        attention,
    )
    if qk_norm_eps is None:
        return GroupedQueryAttention(*fields)
    return QKNormedAttention(*fields, RMSNorm(head_dim, qk_norm_eps), RMSNorm(head_dim, qk_norm_eps))
