"""The dense MoE reference, for tests and the CPU benchmark: every expert on every token, masked by
the routing. The dropless dispatch must equal it."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ferry.nn.moe import Experts


def dense_moe(
    x: Float[Array, "tokens dim"],
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    experts: Experts,
) -> Float[Array, "tokens dim"]:
    """Every expert on every token, masked by the routing: the reference dropless dispatch must
    equal, and the baseline its benchmark compares against."""
    num_experts = experts.gate.shape[0]
    combine = (jax.nn.one_hot(indices, num_experts, dtype=weights.dtype) * weights[..., None]).sum(axis=1)
    gate = jnp.einsum("td,edh->eth", x, experts.gate)
    up = jnp.einsum("td,edh->eth", x, experts.up)
    out = jnp.einsum("eth,ehd->etd", jax.nn.silu(gate) * up, experts.down)
    return jnp.einsum("etd,te->td", out, combine.astype(out.dtype))
