"""A bias-free dense layer; weights are [in, out] so `x @ w` needs no transpose."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


class Linear(eqx.Module):
    weight: Float[Array, "in out"]

    def __init__(self, in_features: int, out_features: int, *, key: PRNGKeyArray, std: float = 0.02):
        self.weight = std * jax.random.normal(key, (in_features, out_features), jnp.float32)

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        return x @ self.weight
