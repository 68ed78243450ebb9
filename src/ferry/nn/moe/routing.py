"""DeepSeek-V3's router: sigmoid scores grouped with group limits, a selection-only correction
bias, and the sequence-wise balance loss."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def route(
    scores: Float[Array, "tokens experts"],
    correction_bias: Float[Array, " experts"],
    num_groups: int,
    groups_per_token: int,
    experts_per_token: int,
    routed_scaling: float,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
    """DeepSeek-V3's selection: add the correction bias, score each group by the sum of its top-2
    biased scores, keep the best `groups_per_token` groups, take the top experts within them; weight
    them by their *unbiased* scores normalised to sum 1, times `routed_scaling`. Ties go to the
    lower index (`lax.top_k`)."""
    tokens, experts = scores.shape
    biased = scores + jax.lax.stop_gradient(correction_bias)
    grouped = biased.reshape(tokens, num_groups, experts // num_groups)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
    _, kept_groups = jax.lax.top_k(group_scores, groups_per_token)
    group_kept = jnp.zeros((tokens, num_groups), bool).at[jnp.arange(tokens)[:, None], kept_groups].set(True)
    expert_kept = jnp.repeat(group_kept, experts // num_groups, axis=-1)
    _, indices = jax.lax.top_k(jnp.where(expert_kept, biased, -jnp.inf), experts_per_token)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * routed_scaling
    return indices, weights


def sequence_balance_loss(
    scores: Float[Array, "batch seq experts"], indices: Int[Array, "batch seq k"]
) -> Float[Array, ""]:
    """DeepSeek-V3's sequence-wise balance loss without its alpha: per sequence,
    sum_i f_i P_i with f_i = E/(K T) x tokens routed to i and P_i = mean_t of normalised scores."""
    _, seq, experts = scores.shape
    k = indices.shape[-1]
    routed = jax.nn.one_hot(indices, experts, dtype=scores.dtype).sum(axis=(1, 2))  # [batch, experts]
    f = routed * experts / (k * seq)
    p = (scores / scores.sum(axis=-1, keepdims=True)).mean(axis=1)
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))
