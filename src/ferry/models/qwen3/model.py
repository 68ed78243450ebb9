"""Qwen3 (dense): grouped-query attention whose query and key heads each pass an RMSNorm before
RoPE, SwiGLU, pre-norm blocks; the head untied or tied to the embedding. Its tensors carry Llama's
names (query_proj ... mlpwo), so every offload preset applies unchanged."""

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.chunked_head import OutputHead
from ferry.data.segments import DocumentMask
from ferry.loss import DEFAULT_HEAD, LossHead, whole_logits
from ferry.models.base import AbstractLanguageModel, dense_training_loss
from ferry.models.qwen3.config import Qwen3Config
from ferry.nn.attention import Segments
from ferry.nn.block import DecoderBlock
from ferry.nn.embedding import Embedding
from ferry.nn.kernels.choice import attend
from ferry.nn.linear import Linear
from ferry.nn.mlp import SwiGLU
from ferry.nn.norm import RMSNorm
from ferry.nn.rope import apply_rope, rope_frequencies
from ferry.nn.stack import LayerStack
from ferry.offload import SAVE_ALL, Policy, tag
from ferry.schedule import LayerKind
from ferry.sharding import EMBED, HEADS


class Qwen3Attention(eqx.Module):
    """Causal GQA with q_norm and k_norm (one RMSNorm over head_dim, shared by all heads) and
    rotate-half RoPE, as Hugging Face's `Qwen3Attention`; scale head_dim^-0.5."""

    query: Linear
    key: Linear
    value: Linear
    out: Linear
    query_norm: RMSNorm
    key_norm: RMSNorm
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    attention: str = eqx.field(static=True)  # model.attention: auto, xla, splash or cudnn

    def __init__(self, config: Qwen3Config, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        heads, kv_heads, head_dim = (config.num_heads, config.num_kv_heads, config.head_dim)
        self.query = Linear(config.dim, heads * head_dim, axes=("embed", "heads"), key=kq)
        self.key = Linear(config.dim, kv_heads * head_dim, axes=("embed", "heads"), key=kk)
        self.value = Linear(config.dim, kv_heads * head_dim, axes=("embed", "heads"), key=kv)
        self.out = Linear(heads * head_dim, config.dim, axes=("heads", "embed"), key=ko)
        self.query_norm = RMSNorm(head_dim, config.norm_eps)
        self.key_norm = RMSNorm(head_dim, config.norm_eps)
        self.num_heads, self.head_dim, self.rope_theta = (heads, head_dim, config.rope_theta)
        self.attention = config.attention

    def __call__(
        self, x: Float[Array, "batch seq dim"], segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"]:
        """`segments`: packed documents' segment ids and positions (None: one sequence)."""
        batch, seq, _ = x.shape
        heads = (batch, seq, -1, self.head_dim)
        # the projections are tagged (linear outputs: a saved value's tangent needs nothing
        # recomputed), the per-head norms and RoPE are recomputed from them
        q = self.query_norm(tag(self.query(x), "query_proj", HEADS).reshape(heads))
        k = self.key_norm(tag(self.key(x), "key_proj", HEADS).reshape(heads))
        v = tag(self.value(x), "value_proj", HEADS).reshape(heads)
        frequencies = rope_frequencies(self.head_dim, self.rope_theta, None)
        segment_ids, positions = (None, None) if segments is None else segments
        q, k = (apply_rope(q, frequencies, positions=positions), apply_rope(k, frequencies, positions=positions))
        context = attend(self.attention, q, k, v, float(np.sqrt(1.0 / self.head_dim)), segment_ids)
        return tag(self.out(context), "out_proj", EMBED)


def qwen3_decoder_layer(config: Qwen3Config, *, key: PRNGKeyArray) -> DecoderBlock:
    k_attention, k_mlp = jax.random.split(key)
    attention = Qwen3Attention(config, key=k_attention)
    return DecoderBlock(attention, SwiGLU(config.dim, config.mlp_dim, key=k_mlp), config.dim, config.norm_eps)


class Qwen3(AbstractLanguageModel):
    embed: Embedding
    layers: LayerStack
    final_norm: RMSNorm
    head: Linear | None  # None: tied, the logits read the embedding table
    config: Qwen3Config = eqx.field(static=True)

    def __init__(self, config: Qwen3Config, *, key: PRNGKeyArray):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        self.embed = Embedding(config.vocab_size, config.dim, key=k_embed)
        self.layers = LayerStack(
            lambda k: qwen3_decoder_layer(config, key=k),
            config.num_layers,
            key=k_layers,
            scan_layers=config.scan_layers,
            name="decoder",
        )
        self.final_norm = RMSNorm(config.dim, config.norm_eps)
        self.head = (
            None
            if config.tie_embeddings
            else Linear(config.dim, config.vocab_size, axes=("embed", "vocab"), key=k_head)
        )
        self.config = config

    def final_hidden(
        self, tokens: Int[Array, "batch seq"], policy: Policy = SAVE_ALL, segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"]:
        extra = () if segments is None else (segments,)
        x, _ = self.layers(self.embed(tokens), policy, *extra)  # the stack checks the policy's names
        return self.final_norm(x)

    def output_head(self) -> OutputHead:
        """The output head, or the embedding table when tied (its vocabulary is its first axis)."""
        if self.head is None:
            return OutputHead(self.embed.weight, self.embed.param_axes()["weight"], vocab_axis=0)
        return OutputHead(self.head.weight, self.head.axes)

    def __call__(
        self, tokens: Int[Array, "batch seq"], policy: Policy = SAVE_ALL, segments: Segments | None = None
    ) -> Float[Array, "batch seq vocab"]:
        return whole_logits(self.final_hidden(tokens, policy, segments), self.output_head())

    def training_loss(
        self,
        batch: Int[Array, "batch seq_plus_one"],
        policy: Policy,
        z_loss_weight: float = 0.0,
        documents: DocumentMask | None = None,
        head: LossHead = DEFAULT_HEAD,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        return dense_training_loss(self, batch, policy, z_loss_weight, documents, head)

    def after_step(self, stats: dict[str, Array]) -> "Qwen3":
        """Qwen3 has no state updated outside the gradient."""
        return self

    def layer_kinds(self) -> list[LayerKind]:
        make = lambda k: qwen3_decoder_layer(self.config, key=k)  # noqa: E731
        return [LayerKind.of_stack("decoder", lambda m: m.layers, self, make)]
