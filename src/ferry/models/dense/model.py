"""The dense decoder: embedding, a scanned stack of pre-norm GQA + SwiGLU blocks, a final RMSNorm
and an output head (its own, or tied to the embedding). Llama and Qwen3 are this model: their
configs say how they differ."""

from typing import final

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ferry.data.segments import DocumentMask
from ferry.head.chunked import OutputHead
from ferry.head.loss import DEFAULT_HEAD, LossHead, whole_logits
from ferry.models.base import AbstractLanguageModel, dense_training_loss
from ferry.models.dense.config import AbstractDenseConfig
from ferry.nn.attention import Segments, grouped_query_attention
from ferry.nn.block import DecoderBlock
from ferry.nn.embedding import Embedding
from ferry.nn.linear import Linear
from ferry.nn.mlp import SwiGLU
from ferry.nn.norm import RMSNorm
from ferry.nn.stack import LayerStack
from ferry.offload.engine import SAVE_ALL, Policy
from ferry.offload.schedule import LayerKind


def dense_decoder_layer(config: AbstractDenseConfig, *, key: PRNGKeyArray) -> DecoderBlock:
    """One decoder layer: GQA (with per-head query and key norms where the family has them) and
    SwiGLU, each behind an RMSNorm."""
    k_attention, k_mlp = jax.random.split(key)
    attention = grouped_query_attention(
        config.dim,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.rope_theta,
        config.rope_scaling_of(),
        key=k_attention,
        attention=config.attention,
        qk_norm_eps=config.norm_eps if config.qk_norm else None,
    )
    return DecoderBlock(attention, SwiGLU(config.dim, config.mlp_dim, key=k_mlp), config.dim, config.norm_eps)


@final
class DenseDecoder(AbstractLanguageModel):
    """A dense decoder-only model: every dense family's model (its family is its config's)."""

    embed: Embedding
    layers: LayerStack
    final_norm: RMSNorm
    head: Linear | None  # None: tied, the logits read the embedding table
    config: AbstractDenseConfig = eqx.field(static=True)

    def __init__(self, config: AbstractDenseConfig, *, key: PRNGKeyArray):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        self.embed = Embedding(config.vocab_size, config.dim, key=k_embed)
        self.layers = LayerStack(
            lambda k: dense_decoder_layer(config, key=k),
            config.num_layers,
            key=k_layers,
            scan_layers=config.scan_layers,
            name="decoder",
        )
        self.final_norm = RMSNorm(config.dim, config.norm_eps)
        self.head = (
            None if config.tied_head() else Linear(config.dim, config.vocab_size, axes=("embed", "vocab"), key=k_head)
        )
        self.config = config

    def decoder_stacks(self) -> list[LayerStack]:
        return [self.layers]

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
        target_weights: Bool[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        return dense_training_loss(self, batch, policy, z_loss_weight, documents, head, target_weights)

    def after_step(self, stats: dict[str, Array]) -> "DenseDecoder":
        """A dense decoder has no state updated outside the gradient."""
        return self

    def layer_kinds(self) -> list[LayerKind]:
        config = self.config
        return [LayerKind.of_stack("decoder", lambda m: m.layers, self, lambda k: dense_decoder_layer(config, key=k))]
