"""Llama 3.1's architecture: dimensions, RoPE with llama3 scaling, RMSNorm's epsilon."""

import dataclasses

from ferry.config_schema import require_positive
from ferry.models.base import AbstractModelConfig, MeshDim
from ferry.models.flops import grouped_query_attention_flops, swiglu_flops
from ferry.nn.rope import Llama3RopeScaling, check_llama3_scaling


class LlamaConfig(AbstractModelConfig):
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 500000.0
    rope_scaling: Llama3RopeScaling | None = Llama3RopeScaling()
    norm_eps: float = 1e-5
    scan_layers: bool = True
    attention: str = "auto"  # the attention kernel: auto, xla, splash, cudnn (ferry.nn.kernels.choice)

    def __check_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
        require_positive("model.norm_eps", self.norm_eps, "RMSNorm divides by the root of the mean square plus it")
        require_positive("model.rope_theta", self.rope_theta, "RoPE's wavelengths are its powers")
        if self.rope_scaling is not None:
            check_llama3_scaling(self.rope_scaling, "model.rope_scaling")

    @property
    def mtp_depth(self) -> int:
        """Llama predicts the next token only."""
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
        projections, attention = grouped_query_attention_flops(
            batch, seq, self.dim, self.num_heads, self.num_kv_heads, self.head_dim
        )
        per_layer = projections + swiglu_flops(batch * seq, self.dim, self.mlp_dim)
        head = 2 * batch * seq * self.dim * self.vocab_size
        return per_layer * self.num_layers + head, attention * self.num_layers

    def for_platform(self, platform: str) -> "LlamaConfig":
        """Llama leaves nothing to the backend."""
        return self

    def without_mtp(self) -> "LlamaConfig":
        return self

    def stack_depths(self) -> dict[str, int]:
        return {"decoder": self.num_layers}

    def with_stack_depths(self, depths: dict[str, int]) -> "LlamaConfig":
        return dataclasses.replace(self, num_layers=depths["decoder"])
