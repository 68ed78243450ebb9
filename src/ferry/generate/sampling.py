"""How the next token is chosen from its logits: greedily (temperature 0), or drawn from the
softmax at a temperature, kept to the nucleus of the most likely tokens whose probability adds
up to `top_p` (Holtzman et al. 2019)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ferry.errors import FerryError


class SamplingError(FerryError, ValueError):
    """A temperature or top-p that chooses no distribution."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """`temperature` 0: the most likely token (greedy); above 0 the logits are divided by it and a
    token drawn. `top_p` < 1 draws only from the fewest most likely tokens whose probabilities
    reach it. `vocab_size` (None: all): only ids below it are chosen, for a model whose vocabulary
    is padded past its tokenizer's."""

    temperature: float = 0.0
    top_p: float = 1.0
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError(
                f"temperature {self.temperature} must be a finite number >= 0 "
                "(0: greedy, 1: the model's own distribution)"
            )
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise SamplingError(f"top-p {self.top_p} must be in (0, 1] (1: every token may be drawn)")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise SamplingError(f"vocab_size {self.vocab_size} must be at least 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def nucleus(logits: Float[Array, "batch vocab"], top_p: float) -> Float[Array, "batch vocab"]:
    """The logits with every token outside the nucleus at -inf: sorted by probability, a token is
    kept while the probability of the tokens before it is below `top_p` (so the likeliest always is)."""
    probabilities = jax.nn.softmax(logits, axis=-1)
    order = jnp.argsort(-probabilities, axis=-1, stable=True)
    sorted_probabilities = jnp.take_along_axis(probabilities, order, axis=-1)
    before = jnp.cumsum(sorted_probabilities, axis=-1) - sorted_probabilities
    rows = jnp.arange(logits.shape[0])[:, None]
    keep = jnp.zeros(logits.shape, bool).at[rows, order].set(before < top_p)
    return jnp.where(keep, logits, -jnp.inf)


def next_token(logits: Float[Array, "batch vocab"], key: PRNGKeyArray, sampling: Sampling) -> Int[Array, " batch"]:
    """Each row's next token, as `sampling` says (in float32 whatever the logits' dtype)."""
    logits = logits.astype(jnp.float32)
    if sampling.vocab_size is not None and sampling.vocab_size < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < sampling.vocab_size, logits, -jnp.inf)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_p < 1:
        logits = nucleus(logits, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
