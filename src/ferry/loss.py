"""Next-token cross-entropy with an optional z-loss, in float32."""

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int


def next_token_loss(
    logits: Float[Array, "batch seq vocab"],
    targets: Int[Array, "batch seq"],
    z_loss_weight: float = 0.0,
    weights: Bool[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean cross-entropy, and the same plus `z_loss_weight * mean(logsumexp^2)` (PaLM's z-loss,
    which keeps the softmax normaliser near 1). `weights`: which predictions count (the means are
    over those; None: all)."""
    logits = logits.astype(jnp.float32)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mean = jnp.mean if weights is None else lambda x: _weighted_mean(x, weights)
    cross_entropy = mean(per_token)
    if z_loss_weight == 0.0:
        return cross_entropy, cross_entropy
    z = jax.nn.logsumexp(logits, axis=-1)
    return cross_entropy + z_loss_weight * mean(z * z), cross_entropy


def _weighted_mean(values: Float[Array, "batch seq"], weights: Bool[Array, "batch seq"]) -> Float[Array, ""]:
    counted = weights.astype(jnp.float32)
    return jnp.sum(values * counted) / jnp.maximum(jnp.sum(counted), 1.0)
