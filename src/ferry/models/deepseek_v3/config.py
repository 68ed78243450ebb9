"""DeepSeek-V3's architecture and its model-side training settings (MoE dispatch, balancing,
multi-token prediction), and the layers it builds."""

import dataclasses
from typing import ClassVar, final

import jax
from jaxtyping import PRNGKeyArray

from ferry.config_schema import require_non_negative, require_positive
from ferry.models.base import AbstractModelConfig, MeshDim
from ferry.models.flops import causal_attention_flops, swiglu_flops
from ferry.nn.mla import MultiHeadLatentAttention
from ferry.nn.moe import DeepSeekMoE
from ferry.nn.rope import YarnScaling, check_yarn


@final
class DeepSeekV3Config(AbstractModelConfig):
    family: ClassVar[str] = "deepseek_v3"
    vocab_size: int  # rows of the embedding table and columns of the output head
    dim: int  # the model width: the hidden state's size between layers
    num_layers: int  # decoder layers, dense and MoE together
    num_dense_layers: int  # the first layers, whose MLP is dense; the rest are MoE layers
    dense_mlp_dim: int  # the dense layers' SwiGLU hidden size
    moe_mlp_dim: int  # each expert's SwiGLU hidden size (routed and shared)
    num_heads: int  # attention heads (MLA: each its own key and value)
    q_lora_rank: int  # MLA: the rank of the query's low-rank compression
    kv_lora_rank: int  # MLA: the width of the compressed key-value latent
    qk_nope_dim: int  # MLA: the per-head query and key width without RoPE
    qk_rope_dim: int  # MLA: the per-head query and key width with RoPE (the key's part shared by all heads)
    v_dim: int  # MLA: the per-head value width
    num_experts: int  # routed experts of each MoE layer
    num_shared_experts: int  # experts every token goes through, besides its routed ones
    experts_per_token: int  # routed experts per token (top-k)
    num_groups: int  # groups the routed experts are split into; a token's experts come from its best groups
    groups_per_token: int  # groups a token's experts may come from (scored by their top-2 experts)
    routed_scaling: float = 2.5  # the routed experts' weighted sum is scaled by it
    capacity_factor: float | None = None  # None: dropless
    # Grouped matmul of the routed experts: "megablox" (JAX's Pallas grouped kernels on TPU, the
    # ragged_dot reference elsewhere), "ragged_dot" (XLA's own grouped kernels on TPU, which add
    # a transposed copy of the expert weights per product), "tiled" (tiles of moe_tile_rows rows,
    # one expert each; XLA's CPU and GPU backends expand ragged_dot and its transposes into every
    # expert on every row), or "auto": megablox on TPU, tiled elsewhere.
    moe_matmul: str = "auto"
    moe_tile_rows: int = 32  # moe_matmul=tiled: rows per tile, each tile one expert's
    # Expert parallelism runs the experts in a ring of steps, one per device of the expert
    # group; per step, the expert products of up to this x the rows a balanced router sends a
    # device (tokens x k / group) are tagged, so an offload policy places them, and the rows
    # past it (an overloaded device's) are recomputed in the backward pass, never dropped.
    # None tags every row: group x a balanced load, the worst case of all slots routed here.
    moe_tag_capacity_factor: float | None = None
    bias_update_rate: float = 0.001  # gamma of the auxiliary-loss-free balancing
    balance_loss_weight: float = 1e-4  # alpha of the sequence-wise balance loss
    mtp_depth: int = 1  # 0 switches multi-token prediction off
    mtp_loss_weight: float = 0.3  # lambda
    rope_theta: float = 10000.0  # RoPE's base: its wavelengths are powers of it
    yarn: YarnScaling = YarnScaling()  # YaRN's extension of RoPE to a longer context
    norm_eps: float = 1e-6  # every RMSNorm's (the latents' norms too)
    scan_layers: bool = True  # each stack (dense, MoE) as one lax.scan over stacked weights; false: unrolled
    attention: str = "auto"  # the attention kernel: auto, xla, splash, cudnn (ferry.nn.kernels.choice)

    def __check_init__(self) -> None:
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        require(
            0 <= self.num_dense_layers <= self.num_layers,
            f"model.num_dense_layers {self.num_dense_layers} must lie in [0, num_layers={self.num_layers}]",
        )
        require(
            self.num_experts % self.num_groups == 0,
            f"model.num_experts {self.num_experts} is not a multiple of num_groups {self.num_groups}",
        )
        require(
            self.num_experts // self.num_groups >= 2,
            f"model.num_groups: each of the {self.num_groups} groups needs at least 2 experts "
            "(group score = its top-2 sum)",
        )
        require(
            1 <= self.groups_per_token <= self.num_groups,
            f"model.groups_per_token {self.groups_per_token} must lie in [1, num_groups={self.num_groups}]",
        )
        kept = self.groups_per_token * self.num_experts // self.num_groups
        require(
            1 <= self.experts_per_token <= kept,
            f"model.experts_per_token {self.experts_per_token} must lie in [1, {kept}] (experts in the kept groups)",
        )
        require(self.qk_rope_dim % 2 == 0, f"model.qk_rope_dim {self.qk_rope_dim} must be even for rotary embeddings")
        require(self.mtp_depth >= 0, f"model.mtp_depth must be >= 0, got {self.mtp_depth}")
        require(
            self.moe_matmul in ("auto", "megablox", "ragged_dot", "tiled"),
            f"model.moe_matmul is {self.moe_matmul!r}; use auto, megablox, ragged_dot or tiled",
        )
        require(self.moe_tile_rows >= 1, f"model.moe_tile_rows must be >= 1, got {self.moe_tile_rows}")
        require(
            self.moe_tag_capacity_factor is None or self.moe_tag_capacity_factor > 0,
            "model.moe_tag_capacity_factor must be positive or null (tag every row), "
            f"got {self.moe_tag_capacity_factor}",
        )
        require(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"model.capacity_factor must be positive or null (dropless), got {self.capacity_factor}",
        )
        require_positive("model.norm_eps", self.norm_eps, "RMSNorm divides by the root of the mean square plus it")
        require_positive("model.rope_theta", self.rope_theta, "RoPE's wavelengths are its powers")
        check_yarn(self.yarn, "model.yarn")
        require_positive("model.routed_scaling", self.routed_scaling, "it scales the routed experts' output")
        for name, why in (
            ("bias_update_rate", "a negative rate pushes load towards the busiest experts"),
            ("balance_loss_weight", "a negative weight rewards unbalanced routing"),
            ("mtp_loss_weight", "a negative weight maximises the multi-token prediction loss"),
        ):
            require_non_negative(f"model.{name}", getattr(self, name), why)

    def attention_heads(self) -> tuple[int, int, int, int]:
        """MLA: every head its own key and value; q/k heads qk_nope + qk_rope wide, v heads v_dim."""
        return (self.num_heads, self.num_heads, self.qk_nope_dim + self.qk_rope_dim, self.v_dim)

    def mesh_dims(self) -> list[MeshDim]:
        return [
            ("model.num_heads", self.num_heads, "tensor"),
            ("model.dense_mlp_dim", self.dense_mlp_dim, "tensor"),
            ("model.moe_mlp_dim", self.moe_mlp_dim, "tensor"),
            ("model.vocab_size", self.vocab_size, "tensor"),
            ("model.num_experts", self.num_experts, "expert"),
            ("model.dim", self.dim, "fsdp"),
            ("model.q_lora_rank", self.q_lora_rank, "fsdp"),
            ("model.kv_lora_rank", self.kv_lora_rank, "fsdp"),
        ]

    def attention_layer(self, key: PRNGKeyArray) -> MultiHeadLatentAttention:
        return MultiHeadLatentAttention(
            self.dim,
            self.num_heads,
            self.q_lora_rank,
            self.kv_lora_rank,
            self.qk_nope_dim,
            self.qk_rope_dim,
            self.v_dim,
            self.rope_theta,
            self.yarn,
            self.norm_eps,
            key=key,
            attention=self.attention,
        )

    def for_platform(self, platform: str) -> "DeepSeekV3Config":
        """moe_matmul=auto made: JAX's Pallas megablox kernels on a TPU, tiles elsewhere (XLA's
        CPU and GPU backends expand `ragged_dot` and its transposes into every expert on every row)."""
        if self.moe_matmul != "auto":
            return self
        return dataclasses.replace(self, moe_matmul="megablox" if platform == "tpu" else "tiled")

    def without_mtp(self) -> "DeepSeekV3Config":
        return dataclasses.replace(self, mtp_depth=0)

    def stack_depths(self) -> dict[str, int]:
        """The dense and the MoE layers (an MTP depth is one block, not a stack)."""
        depths = {"dense": self.num_dense_layers, "moe": self.num_layers - self.num_dense_layers}
        return {name: depth for name, depth in depths.items() if depth}

    def with_stack_depths(self, depths: dict[str, int]) -> "DeepSeekV3Config":
        dense = depths.get("dense", 0)
        return dataclasses.replace(self, num_dense_layers=dense, num_layers=dense + depths.get("moe", 0))

    def forward_flops(self, batch: int, seq: int) -> tuple[int, float]:
        """Multi-token prediction included: each depth's projection of [embedding; hidden], one
        MLA + MoE layer and the shared head, at its shorter sequence."""
        tokens = batch * seq
        mla_weights, mla_attention = self._mla_flops(batch, seq)
        num_moe = self.num_layers - self.num_dense_layers
        weights = mla_weights * self.num_layers
        weights += swiglu_flops(tokens, self.dim, self.dense_mlp_dim) * self.num_dense_layers
        weights += self._moe_flops(tokens) * num_moe
        weights += 2 * tokens * self.dim * self.vocab_size
        attention = mla_attention * self.num_layers
        for depth in range(1, self.mtp_depth + 1):
            mtp_seq = seq - depth
            mtp_tokens = batch * mtp_seq
            depth_weights, depth_attention = self._mla_flops(batch, mtp_seq)
            weights += 2 * mtp_tokens * 2 * self.dim * self.dim  # projection of [embedding; hidden]
            weights += depth_weights + self._moe_flops(mtp_tokens) + 2 * mtp_tokens * self.dim * self.vocab_size
            attention += depth_attention
        return weights, attention

    def _mla_flops(self, batch: int, seq: int) -> tuple[int, float]:
        """Multi-head latent attention forward: (projections, attention)."""
        tokens, heads = batch * seq, self.num_heads
        qk_dim = self.qk_nope_dim + self.qk_rope_dim
        query = 2 * tokens * (self.dim * self.q_lora_rank + self.q_lora_rank * heads * qk_dim)
        key_value = (
            2
            * tokens
            * (
                self.dim * (self.kv_lora_rank + self.qk_rope_dim)
                + self.kv_lora_rank * heads * (self.qk_nope_dim + self.v_dim)
            )
        )
        out = 2 * tokens * heads * self.v_dim * self.dim
        return query + key_value + out, causal_attention_flops(batch, seq, heads, qk_dim, self.v_dim)

    def _moe_flops(self, tokens: int) -> int:
        """Router, shared experts and the top-k routed experts, forward."""
        gate = 2 * tokens * self.dim * self.num_experts
        experts = self.num_shared_experts + self.experts_per_token
        return gate + experts * swiglu_flops(tokens, self.dim, self.moe_mlp_dim)

    def moe_matmul_here(self) -> str:
        """`moe_matmul` made for this process's backend (the planner makes it for its target
        first: `for_platform`)."""
        return self.for_platform(jax.default_backend()).moe_matmul

    def moe_tile_rows_or_none(self) -> int | None:
        """Tile rows for the tiled grouped matmul, or None for a grouped kernel."""
        return self.moe_tile_rows if self.moe_matmul_here() == "tiled" else None

    def moe(self, key: PRNGKeyArray) -> DeepSeekMoE:
        return DeepSeekMoE(
            self.dim,
            self.moe_mlp_dim,
            self.num_experts,
            self.num_shared_experts,
            self.num_groups,
            self.groups_per_token,
            self.experts_per_token,
            self.routed_scaling,
            self.capacity_factor,
            self.moe_tile_rows_or_none(),
            self.moe_tag_capacity_factor,
            "ragged_dot" if self.moe_matmul_here() == "tiled" else self.moe_matmul_here(),
            key=key,
        )
