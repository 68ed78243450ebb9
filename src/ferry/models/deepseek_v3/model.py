"""DeepSeek-V3: MLA attention, dense then DeepSeekMoE layers, multi-token prediction, and the
auxiliary-loss-free router bias update. Facts: DeepSeek-V3 technical report; layout: Hugging Face's
`DeepseekV3ForCausalLM` (so weights map one-to-one)."""

from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ferry.data.loss_weights import counted
from ferry.data.segments import DocumentMask, document_segments, loss_weights
from ferry.head.chunked import OutputHead
from ferry.head.loss import DEFAULT_HEAD, LossHead, whole_logits
from ferry.models.base import AbstractLanguageModel
from ferry.models.deepseek_v3.config import DeepSeekV3Config
from ferry.nn.attention import Segments
from ferry.nn.block import AbstractDecoderBlock, DecoderBlock
from ferry.nn.embedding import Embedding
from ferry.nn.linear import Linear
from ferry.nn.mla import MultiHeadLatentAttention
from ferry.nn.mlp import SwiGLU
from ferry.nn.moe import DeepSeekMoE, MoEStats
from ferry.nn.norm import RMSNorm
from ferry.nn.stack import LayerStack, stack_trees
from ferry.offload.engine import SAVE_ALL, Policy, offloaded
from ferry.offload.schedule import LayerKind


def dense_layer(config: DeepSeekV3Config, *, key: PRNGKeyArray) -> DecoderBlock:
    """MLA + a SwiGLU feed-forward: DeepSeek-V3's first `num_dense_layers` layers."""
    k_attention, k_mlp = jax.random.split(key)
    mlp = SwiGLU(config.dim, config.dense_mlp_dim, key=k_mlp)
    return DecoderBlock(config.attention_layer(k_attention), mlp, config.dim, config.norm_eps)


@final
class MoEDecoderBlock(AbstractDecoderBlock):
    """MLA + DeepSeekMoE (routed experts plus the shared expert), reporting the MoE's stats."""

    attention_norm: RMSNorm
    attention: MultiHeadLatentAttention
    mlp_norm: RMSNorm
    mlp: DeepSeekMoE

    def __init__(self, config: DeepSeekV3Config, *, key: PRNGKeyArray):
        k_attention, k_moe = jax.random.split(key)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = config.attention_layer(k_attention)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = config.moe(k_moe)

    def feed_forward(self, x: Float[Array, "batch seq dim"]) -> tuple[Float[Array, "batch seq dim"], MoEStats]:
        return self.mlp(x)


def moe_layer(config: DeepSeekV3Config, *, key: PRNGKeyArray) -> MoEDecoderBlock:
    """DeepSeek-V3's layers after the dense ones (and each MTP depth's block)."""
    return MoEDecoderBlock(config, key=key)


@final
class MultiTokenPrediction(eqx.Module):
    """One MTP depth: h' = final_norm(block(proj[RMSNorm(emb(t + k)); RMSNorm(h)])), read out
    through the model's shared output head; h is the previous depth's h' (the main model's
    output after its final norm for depth 1), as Megatron-LM and Hugging Face chain them."""

    embedding_norm: RMSNorm
    hidden_norm: RMSNorm
    projection: Linear
    block: MoEDecoderBlock
    final_norm: RMSNorm

    def __init__(self, config: DeepSeekV3Config, *, key: PRNGKeyArray):
        k_projection, k_block = jax.random.split(key)
        self.embedding_norm = RMSNorm(config.dim, config.norm_eps)
        self.hidden_norm = RMSNorm(config.dim, config.norm_eps)
        self.projection = Linear(2 * config.dim, config.dim, axes=(None, "embed"), key=k_projection)
        self.block = moe_layer(config, key=k_block)
        self.final_norm = RMSNorm(config.dim, config.norm_eps)


def _expert_load_metrics(load: Float[Array, "layers experts"], prefix: str) -> dict[str, Array]:
    """Tokens per expert: min and max over all MoE layers, coefficient of variation averaged."""
    cv = jnp.std(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    return {f"{prefix}_min": load.min(), f"{prefix}_max": load.max(), f"{prefix}_cv": cv.mean()}


def _update_bias(moe: DeepSeekMoE, load: Float[Array, "... experts"], rate: float) -> DeepSeekMoE:
    """Auxiliary-loss-free balancing: lower the bias of overloaded experts, raise underloaded ones."""
    mean = load.mean(axis=-1, keepdims=True)
    return eqx.tree_at(lambda m: m.correction_bias, moe, moe.correction_bias + rate * jnp.sign(mean - load))


@final
class DeepSeekV3(AbstractLanguageModel):
    embed: Embedding
    dense_layers: LayerStack | None
    moe_layers: LayerStack | None
    final_norm: RMSNorm
    head: Linear
    mtp: tuple[MultiTokenPrediction, ...]
    config: DeepSeekV3Config = eqx.field(static=True)

    def __init__(self, config: DeepSeekV3Config, *, key: PRNGKeyArray):
        k_embed, k_dense, k_moe, k_head, k_mtp = jax.random.split(key, 5)
        num_moe = config.num_layers - config.num_dense_layers
        self.embed = Embedding(config.vocab_size, config.dim, key=k_embed)
        self.dense_layers = (
            LayerStack(
                lambda k: dense_layer(config, key=k),
                config.num_dense_layers,
                key=k_dense,
                scan_layers=config.scan_layers,
                name="dense",
            )
            if config.num_dense_layers
            else None
        )
        self.moe_layers = (
            LayerStack(
                lambda k: moe_layer(config, key=k), num_moe, key=k_moe, scan_layers=config.scan_layers, name="moe"
            )
            if num_moe
            else None
        )
        self.final_norm = RMSNorm(config.dim, config.norm_eps)
        self.head = Linear(config.dim, config.vocab_size, axes=("embed", "vocab"), key=k_head)
        self.mtp = (
            tuple(MultiTokenPrediction(config, key=k) for k in jax.random.split(k_mtp, config.mtp_depth))
            if config.mtp_depth
            else ()
        )
        self.config = config

    def decoder_stacks(self) -> list[LayerStack]:
        """The dense layers, then the MoE layers (the MTP blocks predict further tokens in training only)."""
        return [stack for stack in (self.dense_layers, self.moe_layers) if stack is not None]

    def layer_kinds(self) -> list[LayerKind]:
        config, kinds = self.config, []
        make_dense = lambda k: dense_layer(config, key=k)
        make_moe = lambda k: moe_layer(config, key=k)
        if self.dense_layers is not None:
            kinds.append(LayerKind.of_stack("dense", lambda m: m.dense_layers, self, make_dense))
        if self.moe_layers is not None:
            kinds.append(LayerKind.of_stack("moe", lambda m: m.moe_layers, self, make_moe))
        for depth in range(1, len(self.mtp) + 1):
            run_mtp = lambda m, x, i=depth - 1: m.mtp[i].block(x)
            kinds.append(LayerKind(f"mtp_{depth}", 1, run_mtp, seq_shrink=depth, make=make_moe))  # its block
        return kinds

    def hidden(
        self,
        tokens: Int[Array, "batch seq"],
        policy: Policy,
        segments: Segments | None = None,
    ) -> tuple[Float[Array, "batch seq dim"], MoEStats | None]:
        """The last decoder layer's output (before the final norm) and the MoE layers' stats;
        `segments` (packed documents' segment ids and positions) keep attention in each document."""
        extra = () if segments is None else (segments,)
        # each stack checks the policy's names against its own and the rest of the model's (tracing
        # the layers for them is needless when none are placed)
        tagged = self.tagged_names() if policy.names and not policy.keep_all else frozenset()
        x = self.embed(tokens)
        if self.dense_layers is not None:
            x, _ = self.dense_layers(x, policy, *extra, tagged_elsewhere=tagged)
        stats = None
        if self.moe_layers is not None:
            x, stats = self.moe_layers(x, policy, *extra, tagged_elsewhere=tagged)
        return x, stats

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        policy: Policy = SAVE_ALL,
        segments: Segments | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        return whole_logits(self.final_hidden(tokens, policy, segments), self.output_head())

    def final_hidden(
        self, tokens: Int[Array, "batch seq"], policy: Policy = SAVE_ALL, segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"]:
        return self.final_norm(self.hidden(tokens, policy, segments)[0])

    def output_head(self) -> OutputHead:
        return OutputHead(self.head.weight, self.head.axes)

    def multi_token_prediction(
        self,
        batch: Int[Array, "batch seq_plus_one"],
        h: Float[Array, "batch seq dim"],
        policy: Policy,
        segments: Segments | None = None,
        documents: DocumentMask | None = None,
        head: LossHead = DEFAULT_HEAD,
        target_weights: Bool[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, " depth"], MoEStats]:
        """Each MTP depth's cross-entropy (depth k predicts token t + k + 1 from the previous
        depth's normalised output and the embedding of token t + k; `h` is the main model's
        output after its final norm) and its MoE block's stats. With packed documents a position
        attends within, and is placed in, the document of the token it embeds (t + k)."""
        seq = batch.shape[1] - 1
        losses, stats = [], []
        for depth, module in enumerate(self.mtp, start=1):
            block = offloaded(lambda layer, x, *e: layer(x, *e), policy, check_names=False, name=f"mtp_{depth}")
            extra = () if segments is None else (tuple(a[:, depth:seq] for a in segments),)
            embedded = module.embedding_norm(self.embed(batch[:, depth:seq]))
            joined = jnp.concatenate([embedded, module.hidden_norm(h[:, : seq - depth])], axis=-1)
            out = block(module.block, module.projection(joined), *extra)
            h = module.final_norm(out.hidden)
            depth_targets = None if target_weights is None else target_weights[:, depth:]
            weights = counted(loss_weights(batch[:, depth:seq], documents), depth_targets)
            losses.append(head(h, self.output_head(), batch[:, depth + 1 :], weights=weights)[1])
            stats.append(out.stats)
        return jnp.stack(losses), stack_trees(stats)

    def training_loss(
        self,
        batch: Int[Array, "batch seq_plus_one"],
        policy: Policy,
        z_loss_weight: float = 0.0,
        documents: DocumentMask | None = None,
        head: LossHead = DEFAULT_HEAD,
        target_weights: Bool[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """Main next-token loss + alpha x the balance losses of every MoE layer (MTP blocks
        included) + lambda x the mean of the MTP depths' losses; with `documents`, attention and
        positions stay inside each packed document."""
        config = self.config
        inputs = batch[:, :-1]
        segments = None if documents is None else document_segments(inputs, documents.end_of_document)
        hidden, stats = self.hidden(inputs, policy, segments)
        h = self.final_norm(hidden)
        weights = counted(loss_weights(inputs, documents), target_weights)
        loss, cross_entropy = head(h, self.output_head(), batch[:, 1:], z_loss_weight, weights)
        metrics: dict[str, Array] = {"loss": cross_entropy, "balance_loss": jnp.zeros((), jnp.float32)}
        if stats is not None:
            metrics["balance_loss"] += stats.balance_loss.sum()
            metrics["moe_expert_load"] = stats.expert_load
            metrics |= _expert_load_metrics(stats.expert_load, "expert_load")
        if self.mtp:
            mtp_losses, mtp_stats = self.multi_token_prediction(
                batch, h, policy, segments, documents, head, target_weights
            )
            metrics["mtp_loss"] = mtp_losses.mean()
            metrics["mtp_expert_load"] = mtp_stats.expert_load
            metrics["balance_loss"] += mtp_stats.balance_loss.sum()
            loss = loss + config.mtp_loss_weight * metrics["mtp_loss"]
        return loss + config.balance_loss_weight * metrics["balance_loss"], metrics

    def after_step(self, stats: dict[str, Array]) -> "DeepSeekV3":
        """Move each router's correction bias towards balance by the load of this step."""
        rate = self.config.bias_update_rate
        model = self
        if "moe_expert_load" in stats:
            blocks = None if self.moe_layers is None else self.moe_layers.layers  # every MoE block, stacked
            assert isinstance(blocks, MoEDecoderBlock), "a MoE load comes from the MoE layers"
            model = eqx.tree_at(
                lambda m: m.moe_layers.layers.mlp, model, _update_bias(blocks.mlp, stats["moe_expert_load"], rate)
            )
        if "mtp_expert_load" in stats:
            mtp = tuple(
                eqx.tree_at(
                    lambda m: m.block.mlp, module, _update_bias(module.block.mlp, stats["mtp_expert_load"][i], rate)
                )
                for i, module in enumerate(model.mtp)
            )
            model = eqx.tree_at(lambda m: m.mtp, model, mtp)
        return model
