"""DeepSeek-V3's Multi-head Latent Attention: queries and keys/values pass through low-rank
latents; a single rotary key head is shared by all heads. Weights map one-to-one onto Hugging
Face's `DeepseekV3Attention` (q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj), transposed to [in, out]."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.nn.attention import Segments
from ferry.nn.kernels.choice import attend
from ferry.nn.linear import Linear
from ferry.nn.norm import RMSNorm
from ferry.nn.rope import YarnScaling, apply_rope, yarn_frequencies, yarn_mscale
from ferry.offload.engine import tag
from ferry.sharding import EMBED, HEADS, LATENT, SPLIT_HEADS


class MultiHeadLatentAttention(eqx.Module):
    q_a: Linear
    q_a_norm: RMSNorm
    q_b: Linear
    kv_a: Linear
    kv_a_norm: RMSNorm
    kv_b: Linear
    out: Linear
    num_heads: int = eqx.field(static=True)
    qk_nope_dim: int = eqx.field(static=True)
    qk_rope_dim: int = eqx.field(static=True)
    v_dim: int = eqx.field(static=True)
    kv_lora_rank: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    yarn: YarnScaling = eqx.field(static=True)
    attention: str = eqx.field(static=True)  # model.attention: auto, xla, splash or cudnn

    def __init__(
        self,
        dim: int,
        num_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_dim: int,
        qk_rope_dim: int,
        v_dim: int,
        rope_theta: float,
        yarn: YarnScaling,
        norm_eps: float,
        *,
        key: PRNGKeyArray,
        attention: str = "auto",
    ):
        keys = jax.random.split(key, 5)
        self.q_a = Linear(dim, q_lora_rank, axes=("embed", None), key=keys[0])
        self.q_a_norm = RMSNorm(q_lora_rank, norm_eps)
        self.q_b = Linear(q_lora_rank, num_heads * (qk_nope_dim + qk_rope_dim), axes=("latent", "heads"), key=keys[1])
        self.kv_a = Linear(dim, kv_lora_rank + qk_rope_dim, axes=("embed", None), key=keys[2])
        self.kv_a_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b = Linear(kv_lora_rank, num_heads * (qk_nope_dim + v_dim), axes=("latent", "heads"), key=keys[3])
        self.out = Linear(num_heads * v_dim, dim, axes=("heads", "embed"), key=keys[4])
        self.num_heads, self.qk_nope_dim, self.qk_rope_dim, self.v_dim = num_heads, qk_nope_dim, qk_rope_dim, v_dim
        self.kv_lora_rank, self.rope_theta, self.yarn = kv_lora_rank, rope_theta, yarn
        self.attention = attention

    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-0.5 x mscale^2, YaRN's temperature applied to the logits."""
        mscale = yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim)
        return (self.qk_nope_dim + self.qk_rope_dim) ** -0.5 * mscale * mscale

    def rotated_heads(
        self, x: Float[Array, "batch seq dim"], positions: Int[Array, "batch seq"] | None = None
    ) -> tuple[
        Float[Array, "batch seq heads qk_dim"],
        Float[Array, "batch seq heads qk_dim"],
        Float[Array, "batch seq heads v_dim"],
    ]:
        """The query, key and value heads attention reads (keys and values decompressed from the
        latent, the rotary key head shared by all heads), RoPE applied at `positions` (None: 0,
        1, ...): the forward pass's, and what a decode with a cache (`ferry.generate`) keeps."""
        batch, seq, _ = x.shape
        frequencies, cos_sin_scale = yarn_frequencies(self.qk_rope_dim, self.rope_theta, self.yarn)

        def rope(t: jax.Array) -> jax.Array:
            return apply_rope(t, frequencies, interleaved=True, cos_sin_scale=cos_sin_scale, positions=positions)

        q_latent = tag(self.q_a(x), "query_wa_proj", LATENT)
        q = tag(self.q_b(self.q_a_norm(q_latent)), "mla_q", HEADS).reshape(batch, seq, self.num_heads, -1)
        q_nope, q_rope = jnp.split(q, [self.qk_nope_dim], axis=-1)
        query = tag(jnp.concatenate([q_nope, rope(q_rope)], axis=-1), "query_proj", SPLIT_HEADS)

        kv_latent = tag(self.kv_a(x), "kv_wa_proj", LATENT)
        latent, k_rope = jnp.split(kv_latent, [self.kv_lora_rank], axis=-1)
        kv = tag(self.kv_b(self.kv_a_norm(latent)), "mla_kv", HEADS).reshape(batch, seq, self.num_heads, -1)
        k_nope, value = jnp.split(kv, [self.qk_nope_dim], axis=-1)
        k_rope = jnp.broadcast_to(rope(k_rope[:, :, None, :]), (batch, seq, self.num_heads, self.qk_rope_dim))
        key = tag(jnp.concatenate([k_nope, k_rope], axis=-1), "key_proj", SPLIT_HEADS)
        return query, key, tag(value, "value_proj", SPLIT_HEADS)

    def __call__(
        self, x: Float[Array, "batch seq dim"], segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"]:
        """`segments`: packed documents' segment ids and positions (None: one sequence)."""
        segment_ids, positions = (None, None) if segments is None else segments
        query, key, value = self.rotated_heads(x, positions)
        context = attend(self.attention, query, key, value, self.softmax_scale(), segment_ids)
        return tag(self.out(context), "out_proj", EMBED)
