"""Qwen3's dense architecture: the dense decoder with an RMSNorm on every query and key head, no
biases, plain RoPE (theta 1e6) and, in its small models, the output head tied to the embedding."""

from typing import ClassVar, final

from ferry.models.dense.config import AbstractDenseConfig
from ferry.nn.rope import Llama3RopeScaling


@final
class Qwen3Config(AbstractDenseConfig):
    family: ClassVar[str] = "qwen3"
    head_dim: int  # Qwen3 sets it apart from dim / num_heads (128 in every size)
    rope_theta: float = 1000000.0
    norm_eps: float = 1e-6  # every RMSNorm's, the per-head query and key norms' too
    tie_embeddings: bool = False  # the head reads the embedding table (Qwen3 0.6B, 1.7B, 4B)

    qk_norm: ClassVar[bool] = True

    def rope_scaling_of(self) -> Llama3RopeScaling | None:
        """Plain RoPE: ferry's Qwen3 refuses checkpoints with a RoPE scaling."""
        return None

    def tied_head(self) -> bool:
        return self.tie_embeddings
