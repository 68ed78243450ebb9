"""Generation in one compiled program: the prompt's prefill, then a `lax.while_loop` of decode
steps over a cache preallocated for the prompt and every new token, ending early once every
sequence has produced its stop token."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from ferry.generate.cache import empty_cache
from ferry.generate.decode import cached_hidden, cached_logits
from ferry.generate.sampling import GREEDY, Sampling, next_token
from ferry.head.loss import whole_logits
from ferry.models.base import AbstractLanguageModel


class Generation(eqx.Module):
    """The new tokens of each sequence ([batch, max_new_tokens]; after a sequence's stop token,
    the stop token again) and the decode steps run (at most max_new_tokens; fewer when every
    sequence stopped)."""

    tokens: Int[Array, "batch max_new_tokens"]
    steps: Int[Array, ""]


def generate(
    model: AbstractLanguageModel,
    prompt: Int[Array, "batch prompt"],
    key: PRNGKeyArray,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    stop_token: int | None = None,
) -> Generation:
    """Up to `max_new_tokens` tokens after each prompt (all of one length), chosen by `sampling`;
    a sequence ends at `stop_token` (None: none ends early). Compile it with `eqx.filter_jit`:
    `max_new_tokens`, `sampling` and `stop_token` are static."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    batch, prompt_length = prompt.shape
    cache = empty_cache(model, batch, prompt_length + max_new_tokens)
    hidden, cache = cached_hidden(model, prompt, cache, 0)
    last_logits = whole_logits(hidden[:, -1:], model.output_head())[:, 0]  # the head of the last token only
    first = next_token(last_logits, jax.random.fold_in(key, 0), sampling)
    fill = jnp.int32(0 if stop_token is None else stop_token)
    tokens = jnp.full((batch, max_new_tokens), fill).at[:, 0].set(first)
    done = first == stop_token if stop_token is not None else jnp.zeros((batch,), bool)

    def running(state: tuple) -> jax.Array:
        step, _, _, done = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def decode(state: tuple) -> tuple:
        step, tokens, cache, done = state
        previous = jax.lax.dynamic_index_in_dim(tokens, step - 1, axis=1)  # [batch, 1]
        logits, cache = cached_logits(model, previous, cache, prompt_length + step - 1)
        token = jnp.where(done, fill, next_token(logits[:, 0], jax.random.fold_in(key, step), sampling))
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, step, axis=1)
        if stop_token is not None:
            done = done | (token == stop_token)
        return step + 1, tokens, cache, done

    steps, tokens, _, _ = jax.lax.while_loop(running, decode, (jnp.int32(1), tokens, cache, done))
    return Generation(tokens, steps)


def new_tokens(generation: Generation, row: int = 0, stop_token: int | None = None) -> list[int]:
    """One sequence's new tokens as a list, up to (not including) its stop token."""
    tokens = [int(t) for t in jax.device_get(generation.tokens[row, : int(generation.steps)])]
    if stop_token is not None and stop_token in tokens:
        return tokens[: tokens.index(stop_token)]
    return tokens
