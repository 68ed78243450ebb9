"""The routed SwiGLU experts: their stacked weights and their products on a dispatch's rows,
tagged for offload."""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ferry.nn.moe.dispatch import Dispatch
from ferry.offload.engine import tag
from ferry.sharding import AbstractSharded, LogicalAxes


class Experts(AbstractSharded):
    """The routed SwiGLU experts, stacked: gate/up [E, dim, hidden], down [E, hidden, dim]."""

    gate: Float[Array, "experts dim hidden"]
    up: Float[Array, "experts dim hidden"]
    down: Float[Array, "experts hidden dim"]

    def __init__(self, num_experts: int, dim: int, hidden: int, *, key: PRNGKeyArray, std: float = 0.02):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = std * jax.random.normal(kg, (num_experts, dim, hidden), jnp.float32)
        self.up = std * jax.random.normal(ku, (num_experts, dim, hidden), jnp.float32)
        self.down = std * jax.random.normal(kd, (num_experts, hidden, dim), jnp.float32)

    def param_axes(self) -> dict[str, LogicalAxes]:
        gate_up = ("experts", "embed", "mlp")
        return {"gate": gate_up, "up": gate_up, "down": ("experts", "mlp", "embed")}


Matmul = Callable[[jax.Array, jax.Array, Dispatch, bool], jax.Array]


def _weighted_down(gate: jax.Array, up: jax.Array, d: Dispatch, down: jax.Array, matmul: Matmul) -> jax.Array:
    """The routing weight scales the hidden rows before the down projection, so the combine is a
    plain sum and the backward pass needs no [rows, dim] residual for the weights' gradient."""
    hidden = jax.nn.silu(gate) * up * d.row_weight[:, None].astype(gate.dtype)
    return matmul(hidden, down, d, False)


def expert_ffn(
    x: Float[Array, "tokens dim"], d: Dispatch, experts: Experts, matmul: Matmul, tagged: bool = True
) -> Float[Array, "rows dim"]:
    """The experts' SwiGLU on the dispatched rows of x's tokens, weighted; its three products are
    tagged for offload (unless not `tagged`: then always recomputed). What lies between them is
    recomputed in the backward pass (`jax.checkpoint`): of a row, it keeps the two hidden
    products only."""

    def name(value: jax.Array, tensor: str) -> jax.Array:
        return tag(value, tensor) if tagged else value

    gate = name(matmul(x, experts.gate, d, True), "moe_mlpwi_0")
    up = name(matmul(x, experts.up, d, True), "moe_mlpwi_1")
    down = jax.checkpoint(functools.partial(_weighted_down, matmul=matmul))
    return name(down(gate, up, d, experts.down), "moe_mlpwo")


def routed_experts(
    x: Float[Array, "tokens dim"], windows: tuple[Dispatch, ...], experts: Experts, matmul: Matmul
) -> tuple[jax.Array, ...]:
    """`expert_ffn` on each window of a dispatch (`tagged_windows`), tagging only the first."""
    return tuple(expert_ffn(x, d, experts, matmul, tagged=i == 0) for i, d in enumerate(windows))
