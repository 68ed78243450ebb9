"""The Llama 3.1 family: published sizes, scan equivalence, causality, RoPE scaling, typing."""

import dataclasses

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from ferry.head.loss import next_token_loss
from ferry.models.dense import DenseDecoder
from ferry.models.registry import parameter_count
from ferry.nn.attention import causal_attention
from ferry.nn.norm import RMSNorm
from ferry.nn.rope import Llama3RopeScaling, rope_frequencies
from tests.conftest import load_model_config


@pytest.mark.parametrize(
    "name, expected",
    [("llama3_1_8b", 8_030_261_248), ("llama3_1_70b", 70_553_706_496), ("llama3_1_405b", 405_853_388_800)],
)
def test_published_parameter_counts(name, expected):
    assert parameter_count(load_model_config(name)) == expected


def test_scan_and_loop_give_the_same_logits(tiny_config):
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, tiny_config.vocab_size)
    scanned = DenseDecoder(tiny_config, key=jax.random.key(0))
    looped = DenseDecoder(dataclasses.replace(tiny_config, scan_layers=False), key=jax.random.key(0))
    np.testing.assert_allclose(scanned(tokens), looped(tokens), rtol=1e-5, atol=1e-6)


def test_logits_are_causal(tiny_config):
    model = DenseDecoder(tiny_config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, tiny_config.vocab_size)
    changed = tokens.at[0, 8:].set((tokens[0, 8:] + 1) % tiny_config.vocab_size)
    a, b = model(tokens), model(changed)
    np.testing.assert_allclose(a[0, :8], b[0, :8], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[0, 8:], b[0, 8:])


def test_llama3_rope_scaling_bands():
    """Meta's rule: wavelengths below original/high_freq_factor keep their frequency, those above
    original/low_freq_factor are divided by factor, the band between is interpolated."""
    scaling = Llama3RopeScaling()
    base = rope_frequencies(128, 500000.0, None)
    scaled = rope_frequencies(128, 500000.0, scaling)
    wavelen = 2 * np.pi / base
    high = wavelen < scaling.original_max_position / scaling.high_freq_factor
    low = wavelen > scaling.original_max_position / scaling.low_freq_factor
    np.testing.assert_allclose(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8)
    middle = ~high & ~low
    assert middle.any()
    assert np.all(scaled[middle] < base[middle]) and np.all(scaled[middle] > base[middle] / 8)


def test_shape_annotations_are_checked_in_tests():
    """The test run instruments ferry with jaxtyping + beartype (see pyproject's addopts)."""
    with pytest.raises(jaxtyping.TypeCheckError, match="targets"):
        next_token_loss(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(jaxtyping.TypeCheckError):
        RMSNorm(4, 1e-5)(jnp.zeros((2, 4), jnp.int32))


def test_chunked_attention_equals_whole_attention():
    """Long sequences attend a chunk of query rows at a time (rematerialised in the backward
    pass): values and gradients equal the whole-sequence attention's."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 32, 4, 8))
    k = jax.random.normal(kk, (2, 32, 2, 8))
    v = jax.random.normal(kv, (2, 32, 2, 8))

    def loss(q, k, v, chunk):
        return jnp.sum(jnp.sin(causal_attention(q, k, v, 0.35, query_chunk=chunk)))

    whole = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, 32)
    for chunk in (8, 7):  # 7: no multiple of it, as MTP's seq - 1 is of 512
        chunked = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, chunk)
        np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6)
        for a, b in zip(chunked[1], whole[1], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
