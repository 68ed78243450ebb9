"""A bias-free dense layer; weights are [in, out] so `x @ w` needs no transpose."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ferry.sharding import AbstractSharded, LogicalAxes


class Linear(AbstractSharded):
    weight: Float[Array, "in out"]
    axes: LogicalAxes = eqx.field(static=True)  # the weight's logical axes, (input's, output's)

    def __init__(self, in_features: int, out_features: int, *, axes: LogicalAxes, key: PRNGKeyArray, std: float = 0.02):
        if len(axes) != 2:
            raise ValueError(f"a Linear weight has 2 dimensions; axes {axes} name {len(axes)}")
        self.weight = std * jax.random.normal(key, (in_features, out_features), jnp.float32)
        self.axes = tuple(axes)

    def param_axes(self) -> dict[str, LogicalAxes]:
        return {"weight": self.axes}

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        return x @ self.weight
