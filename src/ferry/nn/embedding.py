"""Token embedding lookup."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.sharding import constrain


class Embedding(eqx.Module):
    weight: Float[Array, "vocab dim"]

    def __init__(self, vocab_size: int, dim: int, *, key: PRNGKeyArray, std: float = 0.02):
        self.weight = std * jax.random.normal(key, (vocab_size, dim), jnp.float32)

    def __call__(self, tokens: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
        """Under a mesh the (FSDP-sharded) table is gathered whole first, so every device looks up
        its own rows locally; XLA's partitioner cannot reshard a gather sharded along the table."""
        table = constrain(self.weight, (None, None))
        return constrain(jnp.take(table, tokens, axis=0))
