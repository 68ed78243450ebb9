"""Rotary position embeddings with Llama 3's frequency scaling.

ferry uses the rotate-half convention (the two halves of a head are the rotated pairs), which is
also the layout of Hugging Face's Llama checkpoints.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's long-context scaling: low frequencies are divided by `factor`, high ones kept,
    and the band between is interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def rope_frequencies(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """The head_dim/2 inverse wavelengths, in float64 numpy (static per model)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return freqs
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    return np.where(
        wavelen < high_wavelen, freqs, np.where(wavelen > low_wavelen, freqs / scaling.factor, interpolated)
    )


def apply_rope(
    x: Float[Array, "batch seq heads head_dim"], frequencies: np.ndarray
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate each (x[i], x[i + head_dim/2]) pair by position x frequency, in float32."""
    seq = x.shape[1]
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * jnp.asarray(frequencies, jnp.float32)[None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
