"""Next-token cross-entropy with an optional z-loss, in float32."""

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int


def next_token_loss(
    logits: Float[Array, "batch seq vocab"],
    targets: Int[Array, "batch seq"],
    z_loss_weight: float = 0.0,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean cross-entropy, and the same plus `z_loss_weight * mean(logsumexp^2)` (PaLM's z-loss,
    which keeps the softmax normaliser near 1)."""
    logits = logits.astype(jnp.float32)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    if z_loss_weight == 0.0:
        return cross_entropy, cross_entropy
    z = jax.nn.logsumexp(logits, axis=-1)
    return cross_entropy + z_loss_weight * jnp.mean(z * z), cross_entropy
