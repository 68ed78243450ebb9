"""Llama 3.1's and 3.2's architecture: the dense decoder with llama3-scaled RoPE (theta 500000; factor 8
in 3.1, 32 in 3.2) and RMSNorm epsilon 1e-5; Llama 3.2's 1B and 3B tie the output head to the
embedding."""

from typing import ClassVar, final

from ferry.models.dense.config import AbstractDenseConfig
from ferry.nn.rope import Llama3RopeScaling, check_llama3_scaling


@final
class LlamaConfig(AbstractDenseConfig):
    family: ClassVar[str] = "llama"
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    # Llama 3.1's long-context RoPE scaling; null: plain RoPE
    rope_scaling: Llama3RopeScaling | None = Llama3RopeScaling()
    tie_embeddings: bool = False  # the head reads the embedding table (Llama 3.2 1B and 3B)

    qk_norm: ClassVar[bool] = False

    def __check_init__(self) -> None:
        if self.rope_scaling is not None:
            check_llama3_scaling(self.rope_scaling, "model.rope_scaling")

    def rope_scaling_of(self) -> Llama3RopeScaling | None:
        return self.rope_scaling

    def tied_head(self) -> bool:
        return self.tie_embeddings
