"""The architecture every dense family shares: pre-norm blocks of grouped-query attention with RoPE
and a SwiGLU feed-forward. A family is a final subclass of `AbstractDenseConfig` with its defaults
and options."""

import abc
import dataclasses

from equinox import AbstractClassVar

from ferry.config_schema import require_positive
from ferry.models.base import AbstractModelConfig, MeshDim
from ferry.models.flops import grouped_query_attention_flops, swiglu_flops
from ferry.nn.rope import Llama3RopeScaling


class AbstractDenseConfig(AbstractModelConfig):
    """A dense decoder's dimensions, declared once for every dense family. The options a family
    sets in code, not in its config: `qk_norm` (an RMSNorm over every query and key head before
    RoPE, Qwen3's), `rope_scaling_of` (Llama 3.1's frequency scaling) and `tied_head` (the head
    reads the embedding table)."""

    vocab_size: int  # rows of the embedding table and columns of the output head
    dim: int  # the model width: the hidden state's size between layers
    num_layers: int  # decoder layers
    num_heads: int  # query heads of each attention layer
    num_kv_heads: int  # key and value heads (grouped-query attention; num_heads is a multiple of it)
    head_dim: int  # the width of each query, key and value head
    mlp_dim: int  # the SwiGLU MLP's hidden size
    rope_theta: float  # RoPE's base: its wavelengths are powers of it
    norm_eps: float  # every RMSNorm's (the per-head query and key norms' too)
    scan_layers: bool = True  # the layers as one lax.scan over stacked weights (one layer compiled); false: unrolled
    attention: str = "auto"  # the attention kernel: auto, xla, splash, cudnn (ferry.nn.kernels.choice)

    qk_norm: AbstractClassVar[bool]

    def __check_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
        require_positive("model.norm_eps", self.norm_eps, "RMSNorm divides by the root of the mean square plus it")
        require_positive("model.rope_theta", self.rope_theta, "RoPE's wavelengths are its powers")

    @abc.abstractmethod
    def rope_scaling_of(self) -> Llama3RopeScaling | None:
        """RoPE's frequency scaling (None: plain RoPE)."""

    @abc.abstractmethod
    def tied_head(self) -> bool:
        """Does the output head read the embedding table (no head of its own)?"""

    @property
    def mtp_depth(self) -> int:
        """A dense decoder predicts the next token only."""
        return 0

    def attention_heads(self) -> tuple[int, int, int, int]:
        return (self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim)

    def mesh_dims(self) -> list[MeshDim]:
        return [
            ("model.num_heads", self.num_heads, "tensor"),
            ("model.num_kv_heads", self.num_kv_heads, "tensor"),
            ("model.mlp_dim", self.mlp_dim, "tensor"),
            ("model.vocab_size", self.vocab_size, "tensor"),
            ("model.dim", self.dim, "fsdp"),
        ]

    def forward_flops(self, batch: int, seq: int) -> tuple[int, float]:
        """The query and key norms are elementwise work; a tied head is still a matmul with a weight."""
        projections, attention = grouped_query_attention_flops(
            batch, seq, self.dim, self.num_heads, self.num_kv_heads, self.head_dim
        )
        per_layer = projections + swiglu_flops(batch * seq, self.dim, self.mlp_dim)
        head = 2 * batch * seq * self.dim * self.vocab_size
        return per_layer * self.num_layers + head, attention * self.num_layers

    def for_platform(self, platform: str) -> "AbstractDenseConfig":
        """A dense decoder leaves nothing to the backend."""
        return self

    def without_mtp(self) -> "AbstractDenseConfig":
        return self

    def stack_depths(self) -> dict[str, int]:
        return {"decoder": self.num_layers}

    def with_stack_depths(self, depths: dict[str, int]) -> "AbstractDenseConfig":
        return dataclasses.replace(self, num_layers=depths["decoder"])
