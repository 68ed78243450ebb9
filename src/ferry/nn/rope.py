"""Rotary position embeddings: Llama 3's frequency scaling and DeepSeek-V3's YaRN.

Llama uses the rotate-half convention (the two halves of a head are the rotated pairs), the
layout of Hugging Face's Llama checkpoints; DeepSeek rotates interleaved pairs (x[2i], x[2i+1]).
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ferry.config_schema import require_positive
from ferry.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's long-context scaling: low frequencies are divided by `factor`, high ones kept,
    and the band between is interpolated smoothly."""

    factor: float = 8.0  # the low frequencies are divided by it
    low_freq_factor: float = 1.0  # wavelengths above original_max_position / low_freq_factor are scaled
    high_freq_factor: float = 4.0  # wavelengths below original_max_position / high_freq_factor are kept
    original_max_position: int = 8192  # the context length the model was first trained at


def check_llama3_scaling(scaling: Llama3RopeScaling, key: str) -> None:
    """Refuse a scaling whose frequencies would be infinite or NaN (`key`: where it was set)."""
    why = "the low frequencies are divided by it"
    require_positive(f"{key}.factor", scaling.factor, why)
    for name in ("low_freq_factor", "high_freq_factor"):
        require_positive(f"{key}.{name}", getattr(scaling, name), "the band's wavelengths are divided by it")
    if not scaling.high_freq_factor > scaling.low_freq_factor:
        raise ConfigError(
            f"{key}.high_freq_factor={scaling.high_freq_factor} must be greater than {key}.low_freq_factor="
            f"{scaling.low_freq_factor}: the band between them is interpolated over their difference"
        )
    if scaling.original_max_position < 1:
        raise ConfigError(f"{key}.original_max_position={scaling.original_max_position} must be at least 1")


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


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023) as DeepSeek-V3 configures it: wavelengths longer than the original
    context are interpolated by `factor`, short ones kept, with a linear ramp between the dims
    that turn `beta_fast` and `beta_slow` times over the original context."""

    factor: float = 40.0  # wavelengths longer than the original context are interpolated by it
    original_max_position: int = 4096  # the context length the model was first trained at
    beta_fast: float = 32.0  # dims that turn more often than this over the original context are kept
    beta_slow: float = 1.0  # dims that turn less often than this over the original context are interpolated
    # YaRN's temperature is 0.1 * m * ln(factor) + 1 for a coefficient m; RoPE's cos and sin are
    # multiplied by mscale's temperature and divided by mscale_all_dim's
    mscale: float = 1.0
    # the coefficient of the temperature whose square multiplies the softmax scale (and divides cos and sin)
    mscale_all_dim: float = 1.0


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def check_yarn(scaling: YarnScaling, key: str) -> None:
    """Refuse a YaRN scaling whose frequencies or attention temperature would be infinite or NaN."""
    require_positive(f"{key}.factor", scaling.factor, "the long wavelengths are divided by it")
    for name in ("beta_fast", "beta_slow"):
        require_positive(f"{key}.{name}", getattr(scaling, name), "YaRN's ramp takes its logarithm")
    if scaling.original_max_position < 1:
        raise ConfigError(f"{key}.original_max_position={scaling.original_max_position} must be at least 1")
    for name in ("mscale", "mscale_all_dim"):
        temperature = yarn_mscale(scaling.factor, getattr(scaling, name))
        if not temperature > 0:
            raise ConfigError(
                f"{key}.{name}={getattr(scaling, name)} gives YaRN's temperature 0.1 x {name} x ln(factor) + 1 = "
                f"{temperature:.3g}; it divides the rotations and scales the attention logits, so it must be above 0"
            )


def yarn_frequencies(head_dim: int, theta: float, scaling: YarnScaling) -> tuple[np.ndarray, float]:
    """The head_dim/2 inverse wavelengths and the factor YaRN applies to cos and sin."""
    extrapolated = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    interpolated = extrapolated / scaling.factor

    def dim_turning(rotations: float) -> float:
        """The dim whose wavelength turns `rotations` times over the original context."""
        return head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_turning(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_turning(scaling.beta_slow)), head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    frequencies = interpolated * (1 - keep) + extrapolated * keep
    cos_sin_scale = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return frequencies, cos_sin_scale


def apply_rope(
    x: Float[Array, "batch seq heads head_dim"],
    frequencies: np.ndarray,
    *,
    interleaved: bool = False,
    cos_sin_scale: float = 1.0,
    positions: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate pairs of x by position x frequency, in float32: pairs (x[i], x[i + head_dim/2]), or
    (x[2i], x[2i+1]) when `interleaved`. Positions are 0, 1, ... unless given per token (packed
    documents restart them at each document)."""
    if positions is None:
        seq = x.shape[1]
        angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * jnp.asarray(frequencies, jnp.float32)[None, :]
        cos = cos_sin_scale * jnp.cos(angles)[None, :, None, :]
        sin = cos_sin_scale * jnp.sin(angles)[None, :, None, :]
    else:
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(frequencies, jnp.float32)
        cos = cos_sin_scale * jnp.cos(angles)[:, :, None, :]
        sin = cos_sin_scale * jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        first, second = x32[..., 0::2], x32[..., 1::2]
        rotated = jnp.stack([first * cos - second * sin, second * cos + first * sin], axis=-1)
        return rotated.reshape(x.shape).astype(x.dtype)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
