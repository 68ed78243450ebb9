"""The pre-norm residual decoder block: x + attention(norm(x)), then + feed_forward(norm(.)).

Every decoder layer returns a `LayerOutput`: the hidden state and the statistics its feed-forward
reports (None for a dense one; a MoE's balance loss and expert load), so a stack of layers never
asks what a layer returned."""

import abc
from typing import Any, Protocol, final, runtime_checkable

import equinox as eqx
from equinox import AbstractVar
from jaxtyping import Array, Float, Int

from ferry.final import refuse_final_bases
from ferry.nn.attention import Segments
from ferry.nn.linear import Linear
from ferry.nn.mlp import SwiGLU
from ferry.nn.norm import RMSNorm


@runtime_checkable
class Attention(Protocol):
    """What a decoder block's attention is: `(x, segments) -> x` (GQA, MLA), made of its rotated
    query, key and value heads, its softmax scale and its output projection (which a decode with
    a cache, `ferry.generate`, runs apart)."""

    out: Linear

    def __call__(
        self, x: Float[Array, "batch seq dim"], segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"]: ...

    def rotated_heads(
        self, x: Float[Array, "batch seq dim"], positions: Int[Array, "batch seq"] | None = None
    ) -> tuple[
        Float[Array, "batch seq heads qk_dim"],
        Float[Array, "batch seq kv_heads qk_dim"],
        Float[Array, "batch seq kv_heads v_dim"],
    ]: ...

    def softmax_scale(self) -> float: ...


@final
class LayerOutput(eqx.Module):
    """What a decoder layer returns: the next hidden state and the statistics it reports."""

    hidden: Float[Array, "batch seq dim"]
    stats: Any = None  # a pytree of arrays, or None when the layer reports none


class AbstractDecoderBlock(eqx.Module):
    """A pre-norm block; its final subclasses say what their feed-forward is and reports."""

    attention_norm: AbstractVar[RMSNorm]
    attention: AbstractVar[Attention]
    mlp_norm: AbstractVar[RMSNorm]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_final_bases(cls)

    @abc.abstractmethod
    def feed_forward(self, x: Float[Array, "batch seq dim"]) -> tuple[Float[Array, "batch seq dim"], Any]:
        """The feed-forward's output and its statistics (None for none)."""

    def __call__(self, x: Float[Array, "batch seq dim"], segments: Segments | None = None) -> LayerOutput:
        """`segments`: packed documents' segment ids and positions, for attention (None: one sequence)."""
        x = x + self.attention(self.attention_norm(x), segments)
        out, stats = self.feed_forward(self.mlp_norm(x))
        return LayerOutput(x + out, stats)


@final
class DecoderBlock(AbstractDecoderBlock):
    """Attention and a SwiGLU feed-forward (Llama's and Qwen3's layers, DeepSeek-V3's dense ones)."""

    attention_norm: RMSNorm
    attention: Attention
    mlp_norm: RMSNorm
    mlp: SwiGLU

    def __init__(self, attention: Attention, mlp: SwiGLU, dim: int, norm_eps: float):
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.mlp_norm = RMSNorm(dim, norm_eps)
        self.mlp = mlp

    def feed_forward(self, x: Float[Array, "batch seq dim"]) -> tuple[Float[Array, "batch seq dim"], None]:
        return self.mlp(x), None
