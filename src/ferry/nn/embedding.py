"""Token embedding lookup."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.sharding import AbstractSharded, LogicalAxes, constrain


class Embedding(AbstractSharded):
    weight: Float[Array, "vocab dim"]

    def __init__(self, vocab_size: int, dim: int, *, key: PRNGKeyArray, std: float = 0.02):
        self.weight = std * jax.random.normal(key, (vocab_size, dim), jnp.float32)

    def param_axes(self) -> dict[str, LogicalAxes]:
        """The table is stored FSDP-sharded along its width and gathered whole to look up."""
        return {"weight": (None, "embed")}

    def __call__(self, tokens: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
        """Under a mesh the (FSDP-sharded) table is gathered whole first, so every device looks up
        its own rows locally; XLA's partitioner cannot reshard a gather sharded along the table."""
        table = constrain(self.weight, (None, None))
        return constrain(jnp.take(table, tokens, axis=0))
