"""The SwiGLU feed-forward block: wo(silu(wi_0 x) * wi_1 x)."""

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from ferry.nn.linear import Linear
from ferry.offload.engine import tag
from ferry.sharding import EMBED, MLP


class SwiGLU(eqx.Module):
    wi_0: Linear
    wi_1: Linear
    wo: Linear

    def __init__(self, dim: int, hidden: int, *, key: PRNGKeyArray):
        k0, k1, ko = jax.random.split(key, 3)
        self.wi_0 = Linear(dim, hidden, axes=("embed", "mlp"), key=k0)
        self.wi_1 = Linear(dim, hidden, axes=("embed", "mlp"), key=k1)
        self.wo = Linear(hidden, dim, axes=("mlp", "embed"), key=ko)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        gate = tag(self.wi_0(x), "mlpwi_0", MLP)
        up = tag(self.wi_1(x), "mlpwi_1", MLP)
        return tag(self.wo(jax.nn.silu(gate) * up), "mlpwo", EMBED)
