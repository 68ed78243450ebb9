"""`ferry.generate` against the model it decodes and against `transformers`: the cached forward
pass (prefill, chunks, single tokens) gives the full forward pass's logits at every position for
each family, so a change to a model that the decode path does not follow fails here; greedy
generation equals `transformers`' `generate` on the Hugging Face export; sampling draws from the
temperature's distribution within the nucleus."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.generate import GREEDY, Sampling, SamplingError, cached_logits, empty_cache, generate, new_tokens
from ferry.generate.sampling import next_token, nucleus
from ferry.models import registry
from tests.conftest import load_model_config

FAMILIES = ["llama_tiny", "qwen3_tiny", "deepseek_v3_tiny"]
ATOL = 2e-5  # float32 logits: the same arithmetic in another order


def randomised(name: str, seed: int = 0, **overrides):
    """A tiny model whose every weight ~ N(0, 0.1), norms ~ N(1, 0.1), router biases ~ N(0, 0.05):
    logits far from uniform (greedy choices with margins) and a misplaced norm visible."""
    model = registry.build_model(load_model_config(name, attention="xla", **overrides), jax.random.key(seed))
    leaves, tree = jax.tree_util.tree_flatten_with_path(model)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))

    def draw(path, leaf, key):
        if not eqx.is_inexact_array(leaf):
            return leaf
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(key, leaf.shape, leaf.dtype)
        if "norm" in name:
            return 1 + 0.1 * noise
        return (0.05 if "correction_bias" in name else 0.1) * noise

    return jax.tree_util.tree_unflatten(tree, [draw(p, x, k) for (p, x), k in zip(leaves, keys, strict=True)])


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return randomised(request.param)


step_logits = eqx.filter_jit(cached_logits)


def test_cached_logits_equal_the_full_forward_pass_at_every_position(model):
    """The prompt's prefill, a chunk, then a token at a time through the cache: the logits of
    every position are the full forward pass's."""
    chunks = (3, 4, 1, 1, 1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, sum(chunks))), jnp.int32)
    full = eqx.filter_jit(lambda m, t: m(t))(model, tokens)
    cache = empty_cache(model, 2, sum(chunks) + 3)  # room to spare: the unwritten slots are never read
    start, pieces = 0, []
    for length in chunks:
        logits, cache = step_logits(model, tokens[:, start : start + length], cache, start)
        pieces.append(logits)
        start += length
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=1)), np.asarray(full), rtol=0, atol=ATOL)


def test_the_cache_holds_each_layers_keys_and_values(model):
    cache = empty_cache(model, 3, 10)
    assert [k.shape[0] for k in cache.keys] == [s.num_layers for s in model.decoder_stacks()]
    assert cache.length == 10 and all(k.shape[1:3] == (3, 10) for k in cache.keys + cache.values)
    _, filled = step_logits(model, jnp.ones((3, 4), jnp.int32), cache, 0)
    for keys in filled.keys:
        assert np.all(np.asarray(keys[:, :, 4:]) == 0) and np.any(np.asarray(keys[:, :, :4]) != 0)


generate_jit = eqx.filter_jit(generate)


def test_greedy_generation_is_the_full_forward_passs_argmax(model):
    """Each new token is the argmax of the full forward pass over the prompt and the tokens before it."""
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 5)), jnp.int32)
    made = generate_jit(model, prompt, jax.random.key(0), 6, GREEDY, None)
    assert int(made.steps) == 6
    sequence = jnp.concatenate([prompt, made.tokens], axis=1)
    expected = jnp.argmax(eqx.filter_jit(lambda m, t: m(t))(model, sequence)[:, 4:-1], axis=-1)
    np.testing.assert_array_equal(np.asarray(made.tokens), np.asarray(expected))


def test_generation_stops_at_the_stop_token(model):
    prompt = jnp.asarray(np.random.default_rng(3).integers(0, 256, (1, 4)), jnp.int32)
    free = generate_jit(model, prompt, jax.random.key(0), 8, GREEDY, None)
    stop = int(free.tokens[0, 2])
    first = [int(t) for t in free.tokens[0]].index(stop)  # the stop token may come earlier still
    stopped = generate_jit(model, prompt, jax.random.key(0), 8, GREEDY, stop)
    assert int(stopped.steps) == first + 1
    assert new_tokens(stopped, stop_token=stop) == [int(t) for t in free.tokens[0, :first]]
    assert np.all(np.asarray(stopped.tokens[0, first:]) == stop)


def test_sampling_is_reproducible_by_key_and_differs_between_keys(model):
    prompt = jnp.zeros((1, 3), jnp.int32)
    hot = Sampling(temperature=1.5, top_p=0.95)
    one = generate_jit(model, prompt, jax.random.key(1), 12, hot, None)
    again = generate_jit(model, prompt, jax.random.key(1), 12, hot, None)
    other = generate_jit(model, prompt, jax.random.key(2), 12, hot, None)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(again.tokens))
    assert not np.array_equal(np.asarray(one.tokens), np.asarray(other.tokens))


PROBABILITIES = np.array([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.4, [0]), (0.5, [0]), (0.7, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])]
)
def test_the_nucleus_is_the_fewest_likeliest_tokens_reaching_top_p(top_p, kept):
    logits = jnp.log(jnp.asarray(PROBABILITIES[[2, 0, 3, 1]]))[None]  # not in order of probability
    finite = np.isfinite(np.asarray(nucleus(logits, top_p))[0])
    assert sorted(np.array([2, 0, 3, 1])[finite].tolist()) == kept


def draws(logits, sampling, count=4000):
    keys = jax.random.split(jax.random.key(0), count)
    tokens = jax.jit(jax.vmap(lambda k: next_token(logits, k, sampling)[0]))(keys)
    return np.bincount(np.asarray(tokens), minlength=logits.shape[-1]) / count


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_sampling_draws_the_tempered_distribution(temperature):
    logits = jnp.log(jnp.asarray(PROBABILITIES))[None]
    tempered = PROBABILITIES ** (1 / temperature) / np.sum(PROBABILITIES ** (1 / temperature))
    np.testing.assert_allclose(draws(logits, Sampling(temperature)), tempered, atol=0.03)


def test_top_p_draws_within_the_nucleus_renormalised():
    frequencies = draws(jnp.log(jnp.asarray(PROBABILITIES))[None], Sampling(1.0, top_p=0.7))
    np.testing.assert_allclose(frequencies, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.03)


def test_greedy_and_vocab_size_limit_the_choice():
    logits = jnp.asarray([[0.0, 1.0, 3.0, 2.0]])
    assert int(next_token(logits, jax.random.key(0), GREEDY)[0]) == 2
    assert int(next_token(logits, jax.random.key(0), Sampling(vocab_size=2))[0]) == 1
    assert draws(logits, Sampling(5.0, vocab_size=2))[2:].sum() == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": -0.5}, "temperature -0.5 must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature nan"),
        ({"temperature": float("inf")}, "temperature inf"),
        ({"top_p": 0.0}, r"top-p 0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top-p 1.5"),
        ({"top_p": float("nan")}, "top-p nan"),
    ],
)
def test_settings_that_choose_no_distribution_are_refused(settings, message):
    with pytest.raises(SamplingError, match=message):
        Sampling(**settings)
