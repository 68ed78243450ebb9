"""RMSNorm, computed in float32 whatever the activation dtype, as Llama and DeepSeek do."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ferry.sharding import AbstractSharded, LogicalAxes


class RMSNorm(AbstractSharded):
    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    def param_axes(self) -> dict[str, LogicalAxes]:
        """The scale is small and every device reads it whole: replicated."""
        return {"weight": (None,)}

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight.astype(jnp.float32)).astype(x.dtype)
