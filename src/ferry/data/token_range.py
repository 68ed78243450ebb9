"""Token ids checked against the model's vocabulary. An id at or past `model.vocab_size` indexes
past the embedding table and the output head: the first step's loss turns NaN (and the non-finite
stop blames the settings), or, where a gather clamps the index, the model trains on another token.

Checked on the host before anything is written (a sample of the training split, and every token
that evaluation reads), and on the device for every training batch: `batch_id_range` reduces a
batch to its smallest and largest id beside the step, and `ferry.run.id_watch` reads the pair a
step late. A refusal names where the id lies: the shard and the token's offset in it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Integer

from ferry.data.shards import ShardedTokens
from ferry.errors import DataError

SAMPLE_PLACES = 64  # places of the training split read at start-up: each shard's start, up to this many
SAMPLE_TOKENS = 1024  # tokens read at each place
READ_TOKENS = 2**22  # tokens read at a time when a whole span is checked


class TokenIdError(DataError):
    """The data holds a token id outside the model's vocabulary."""


def first_outside(ids: Integer[np.ndarray, " n"], vocab_size: int) -> int | None:
    """The index of the first id of `ids` outside [0, vocab_size), or None."""
    outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    return int(outside[0]) if len(outside) else None


def token_place(tokens: np.ndarray | ShardedTokens, position: int, split: str) -> str:
    """Where the stream's token `position` lies: its shard and offset, or its place in the split."""
    if isinstance(tokens, ShardedTokens):
        path, offset = tokens.locate(position)
        return f"{path} token {offset:,}"
    return f"token {position:,} of the {split} split"


def outside_vocabulary(place: str, token: int, vocab_size: int, model_name: str) -> str:
    """What is wrong with an id outside the vocabulary, and the fix."""
    return (
        f"{place} is id {token:,}, outside model {model_name}'s vocabulary (model.vocab_size={vocab_size:,}): "
        f"the model has no embedding for it. Prepare the corpus with a tokenizer of at most {vocab_size:,} ids "
        "(data.tokenizer), or train a model whose model.vocab_size holds its ids"
    )


def check_span(
    tokens: np.ndarray | ShardedTokens, start: int, stop: int, vocab_size: int, split: str, model_name: str
) -> None:
    """Every id of `tokens[start:stop]` lies in the vocabulary (read a few MiB at a time)."""
    for begin in range(start, min(stop, len(tokens)), READ_TOKENS):
        ids = np.asarray(tokens[begin : min(begin + READ_TOKENS, stop)])
        bad = first_outside(ids, vocab_size)
        if bad is not None:
            place = token_place(tokens, begin + bad, split)
            raise TokenIdError(outside_vocabulary(place, int(ids[bad]), vocab_size, model_name))


def sample_starts(tokens: np.ndarray | ShardedTokens) -> list[int]:
    """Where the start-up sample reads: each shard's start (up to `SAMPLE_PLACES`, spread evenly),
    or that many places spread over an array."""
    starts = tokens.starts[:-1] if isinstance(tokens, ShardedTokens) else np.arange(0, len(tokens), SAMPLE_TOKENS)
    if not len(starts):
        return []
    picked = np.unique(np.linspace(0, len(starts) - 1, min(len(starts), SAMPLE_PLACES)).astype(np.int64))
    return [int(starts[i]) for i in picked]


def check_corpus_ids(
    train: np.ndarray | ShardedTokens,
    held_out: np.ndarray | ShardedTokens,
    held_out_read: int,
    vocab_size: int,
    model_name: str,
) -> None:
    """Before anything is written: a sample of the training split (a few thousand tokens from up to
    `SAMPLE_PLACES` shards), and the first `held_out_read` tokens of the held-out split (all that
    evaluation reads), lie in the vocabulary."""
    for start in sample_starts(train):
        check_span(train, start, start + SAMPLE_TOKENS, vocab_size, "train", model_name)
    check_span(held_out, 0, held_out_read, vocab_size, "held-out", model_name)


@jax.jit
def batch_id_range(batch: Int[Array, "batch seq_plus_one"]) -> Int[Array, "2"]:
    """A batch's smallest and largest token id, on the device (a reduction over the batch)."""
    return jnp.stack([jnp.min(batch), jnp.max(batch)]).astype(jnp.int32)
