"""YaRN frequencies and temperature against values computed here, and MLA's scale."""

import math

import jax
import numpy as np

from ferry.nn.rope import YarnScaling, yarn_frequencies, yarn_mscale
from tests.conftest import load_model_config


def yarn_by_hand(dim=64, base=10000.0, factor=40.0, original=4096, beta_fast=32.0, beta_slow=1.0):
    """YaRN per dimension pair, written from the paper: pairs that rotate more than beta_fast times
    over the original context keep their frequency, fewer than beta_slow times are divided by
    factor, linear in between (dims found by solving dim d: original / wavelength(d) = beta)."""

    def boundary(beta):
        return dim * math.log(original / (beta * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(boundary(beta_fast)), 0), min(math.ceil(boundary(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(theta * (1 - ramp) + theta / factor * ramp)
    return np.array(out), low, high


def test_yarn_frequencies_match_the_hand_computation():
    expected, low, high = yarn_by_hand()
    frequencies, cos_sin_scale = yarn_frequencies(64, 10000.0, YarnScaling())
    np.testing.assert_allclose(frequencies, expected, rtol=1e-12)
    assert (low, high) == (10, 23)  # DeepSeek-V3's published configuration
    assert frequencies[0] == 1.0 and math.isclose(frequencies[-1], 10000.0 ** (-62 / 64) / 40)
    assert cos_sin_scale == 1.0  # mscale == mscale_all_dim


def test_yarn_mscale_and_the_mla_softmax_scale():
    mscale = 0.1 * math.log(40) + 1
    assert math.isclose(yarn_mscale(40.0, 1.0), mscale)
    assert math.isclose(mscale, 1.3688879454113936)
    config = load_model_config("deepseek_v3")
    abstract = jax.eval_shape(lambda: config.attention_layer(jax.random.key(0)))
    assert math.isclose(abstract.softmax_scale(), 192**-0.5 * mscale**2)
