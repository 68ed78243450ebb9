"""The pre-norm residual decoder block shared by Llama and DeepSeek-V3:
x + attention(norm(x)), then + feed_forward(norm(.))."""

from typing import Any

import equinox as eqx
from jaxtyping import Array, Float

from ferry.nn.attention import Segments
from ferry.nn.norm import RMSNorm


class DecoderBlock(eqx.Module):
    attention_norm: RMSNorm
    attention: eqx.Module
    mlp_norm: RMSNorm
    mlp: eqx.Module  # a SwiGLU, or a MoE that also returns statistics

    def __init__(self, attention: eqx.Module, mlp: eqx.Module, dim: int, norm_eps: float):
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.mlp_norm = RMSNorm(dim, norm_eps)
        self.mlp = mlp

    def __call__(
        self, x: Float[Array, "batch seq dim"], segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"] | tuple[Float[Array, "batch seq dim"], Any]:
        """The block's output, with the feed-forward's statistics when it returns some (MoE).
        `segments`: packed documents' segment ids and positions, for attention (None: one sequence)."""
        x = x + self.attention(self.attention_norm(x), segments)
        out = self.mlp(self.mlp_norm(x))
        if isinstance(out, tuple):
            out, stats = out
            return x + out, stats
        return x + out
