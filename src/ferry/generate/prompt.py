"""A prompt as a run's model reads it: encoded by the run's tokenizer as training encoded a
document (no special tokens added), and checked to fit, with the tokens to generate, in the
context the model was trained on."""

import numpy as np
from jaxtyping import Int

from ferry.data.tokenizer import Tokenizer
from ferry.errors import FerryError


class PromptError(FerryError, ValueError):
    """A prompt, or a number of new tokens, that does not fit the run's context."""


def prompt_ids(tokenizer: Tokenizer, text: str) -> Int[np.ndarray, " prompt"]:
    """The ids of `text` as training saw a document's start; an empty prompt is the
    end-of-document id alone, which precedes every document a packed window starts mid-way."""
    (ids,) = tokenizer.encode_documents([text.encode("utf-8")])
    ids = ids[:-1]  # encode_documents ends every document with the end-of-document id
    if not len(ids):
        return np.asarray([tokenizer.end_of_document], np.int32)
    return ids.astype(np.int32)


def new_token_budget(prompt_length: int, max_new_tokens: int | None, context: int, default: int = 256) -> int:
    """How many tokens to generate after a prompt of `prompt_length` tokens so that the whole fits
    `context` (the run's train.seq_len): `max_new_tokens`, or by default `default` or what fits."""
    if prompt_length >= context:
        raise PromptError(
            f"the prompt is {prompt_length} tokens and the run's context (train.seq_len) is {context}: "
            f"no room for a new token; shorten the prompt below {context} tokens"
        )
    room = context - prompt_length
    if max_new_tokens is None:
        return min(default, room)
    if max_new_tokens < 1:
        raise PromptError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if max_new_tokens > room:
        raise PromptError(
            f"--max-new-tokens {max_new_tokens} after a prompt of {prompt_length} tokens passes the run's context "
            f"(train.seq_len={context}); ask for at most {room}, or shorten the prompt"
        )
    return max_new_tokens
