"""DeepSeekMoE, the layer: sigmoid routing, dropless dispatch through grouped matmuls (expert
parallel under a mesh), a shared expert, and the sequence-wise balance loss.

Weights map one-to-one onto Hugging Face's `DeepseekV3MoE`: `gate.weight`,
`gate.e_score_correction_bias`, `experts.{i}.{gate,up,down}_proj` (stacked here along a leading
expert axis), `shared_experts`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.nn.mlp import SwiGLU
from ferry.nn.moe.dispatch import (
    capacity_per_expert,
    combine_windows,
    dispatch,
    grouped_matmul,
    tagged_row_count,
    tagged_windows,
)
from ferry.nn.moe.experts import Experts, routed_experts
from ferry.nn.moe.parallel import expert_parallel_moe, per_device_tokens
from ferry.nn.moe.routing import route, sequence_balance_loss
from ferry.sharding import AbstractSharded, LogicalAxes, context_mesh, data_parallel_size


def dropless_moe(
    x: Float[Array, "tokens dim"],
    indices: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    experts: Experts,
    capacity_factor: float | None = None,
    tile_rows: int | None = None,
    tag_capacity_factor: float | None = None,
    kernel: str = "ragged_dot",
) -> Float[Array, "tokens dim"]:
    """Sort the (token, expert) slots by expert and run each expert on exactly its tokens with
    grouped matmuls (tiles of `tile_rows` rows, or else the grouped `kernel`): no token is dropped, no
    expert computes a token it was not routed. Under a mesh of several devices the dispatch is
    per device (`expert_parallel_moe`), unless the tokens do not split evenly over the batch axes
    (abstract traces with a toy shape), where XLA partitions the single-device dispatch. The
    expert products of the rows past `tag_capacity_factor` x a balanced load (`tagged_row_count`)
    are not tagged: the backward pass recomputes them whatever the offload policy."""
    mesh = context_mesh()
    if mesh is not None and mesh.size > 1 and x.shape[0] % data_parallel_size(mesh) == 0:
        return expert_parallel_moe(
            x, indices, weights, experts, mesh, capacity_factor, tile_rows, tag_capacity_factor, kernel
        )
    tokens, k = indices.shape
    num_experts = experts.gate.shape[0]
    capacity = capacity_per_expert(capacity_factor, tokens, k, num_experts)
    d = dispatch(indices, weights, 0, num_experts, tile_rows, capacity, kernel=kernel)
    windows = tagged_windows(d, tagged_row_count(tag_capacity_factor, tokens, k, 1))
    return combine_windows(routed_experts(x, windows, experts, grouped_matmul), windows, tokens)


class MoEStats(eqx.Module):
    """What a MoE layer reports besides its output: its balance loss and tokens per expert."""

    balance_loss: Float[Array, ""]
    expert_load: Float[Array, " experts"]


class DeepSeekMoE(AbstractSharded):
    router: Float[Array, "dim experts"]
    correction_bias: Float[Array, " experts"]
    experts: Experts
    shared: SwiGLU
    num_groups: int = eqx.field(static=True)
    groups_per_token: int = eqx.field(static=True)
    experts_per_token: int = eqx.field(static=True)
    routed_scaling: float = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    tile_rows: int | None = eqx.field(static=True)
    tag_capacity_factor: float | None = eqx.field(static=True)
    kernel: str = eqx.field(static=True)  # the grouped kernel without tiles: "ragged_dot" or "megablox"

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        num_shared_experts: int,
        num_groups: int,
        groups_per_token: int,
        experts_per_token: int,
        routed_scaling: float,
        capacity_factor: float | None,
        tile_rows: int | None = None,
        tag_capacity_factor: float | None = None,
        kernel: str = "ragged_dot",
        *,
        key: PRNGKeyArray,
    ):
        k_router, k_experts, k_shared = jax.random.split(key, 3)
        self.router = 0.02 * jax.random.normal(k_router, (dim, num_experts), jnp.float32)
        self.correction_bias = jnp.zeros((num_experts,), jnp.float32)
        self.experts = Experts(num_experts, dim, hidden, key=k_experts)
        self.shared = SwiGLU(dim, hidden * num_shared_experts, key=k_shared)
        self.num_groups, self.groups_per_token = num_groups, groups_per_token
        self.experts_per_token, self.routed_scaling = experts_per_token, routed_scaling
        self.capacity_factor = capacity_factor
        self.tile_rows = tile_rows
        self.tag_capacity_factor = tag_capacity_factor
        self.kernel = kernel

    def param_axes(self) -> dict[str, LogicalAxes]:
        """The router's columns (the experts) stay whole; the correction bias is replicated."""
        return {"router": ("embed", None), "correction_bias": (None,)}

    def __call__(self, x: Float[Array, "batch seq dim"]) -> tuple[Float[Array, "batch seq dim"], MoEStats]:
        batch, seq, dim = x.shape
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.router.astype(jnp.float32))
        flat_scores = scores.reshape(batch * seq, -1)
        select = functools.partial(
            route,
            num_groups=self.num_groups,
            groups_per_token=self.groups_per_token,
            experts_per_token=self.experts_per_token,
            routed_scaling=self.routed_scaling,
        )
        indices, weights = per_device_tokens(select)(flat_scores, self.correction_bias.astype(jnp.float32))
        routed = dropless_moe(
            x.reshape(batch * seq, dim),
            indices,
            weights,
            self.experts,
            self.capacity_factor,
            self.tile_rows,
            self.tag_capacity_factor,
            self.kernel,
        )
        out = routed.reshape(x.shape) + self.shared(x)
        load = jnp.bincount(indices.reshape(-1), length=scores.shape[-1]).astype(jnp.float32)
        stats = MoEStats(sequence_balance_loss(scores, indices.reshape(batch, seq, -1)), load)
        return out, stats
