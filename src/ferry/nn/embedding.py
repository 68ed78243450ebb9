"""Token embedding lookup."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray


class Embedding(eqx.Module):
    weight: Float[Array, "vocab dim"]

    def __init__(self, vocab_size: int, dim: int, *, key: PRNGKeyArray, std: float = 0.02):
        self.weight = std * jax.random.normal(key, (vocab_size, dim), jnp.float32)

    def __call__(self, tokens: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
        return jnp.take(self.weight, tokens, axis=0)
