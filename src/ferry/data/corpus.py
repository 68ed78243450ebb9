"""A corpus: every document of a source tokenized, split into train and held-out token streams.

Documents are split by a hash of their key, so the split is the same on every machine. The
whole corpus is tokenized once at start-up and held in host memory (a byte per token for the
byte tokenizer, four for larger vocabularies); every check happens here, before the model is
built.
"""

import dataclasses
import itertools
import zlib

import numpy as np

from ferry.data.config import DataConfig
from ferry.data.sources import documents
from ferry.data.tokenizer import Tokenizer

_TOKENIZE_BATCH = 512  # documents per tokenizer call (Hugging Face tokenizers encode a batch in parallel)


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # token ids, each document followed by the tokenizer's end-of-document id
    eval: np.ndarray
    num_documents: int
    description: str  # for the start-up line, e.g. "1,812 stdlib documents"


def is_held_out(key: str, eval_fraction: float) -> bool:
    return zlib.crc32(key.encode()) / 2**32 < eval_fraction


def check_vocab(tokenizer: Tokenizer, vocab_size: int, model_name: str) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model {model_name} has vocab_size {vocab_size}; "
            f"use a model with vocab_size >= {tokenizer.vocab_size} (model.vocab_size={tokenizer.vocab_size}) "
            "or a tokenizer with fewer ids"
        )


def load_corpus(config: DataConfig, tokenizer: Tokenizer, vocab_size: int) -> Corpus:
    """The corpus `config` names, tokenized; synthetic tokens are uniform over `vocab_size`."""
    if config.source == "synthetic":
        rng = np.random.default_rng(config.seed)
        eval_tokens = max(2, int(config.synthetic_tokens * config.eval_fraction))
        tokens = rng.integers(0, vocab_size, config.synthetic_tokens + eval_tokens, dtype=np.int64)
        tokens = tokens.astype(token_dtype(vocab_size))
        return Corpus(tokens[: config.synthetic_tokens], tokens[config.synthetic_tokens :], 0, "synthetic tokens")
    dtype = token_dtype(tokenizer.vocab_size)
    train: list[np.ndarray] = []
    held_out: list[np.ndarray] = []
    count = 0
    stream = documents(config.source, config.path, config.field, config.pattern)
    while chunk := list(itertools.islice(stream, _TOKENIZE_BATCH)):
        count += len(chunk)
        for (key, _), ids in zip(chunk, tokenizer.encode_documents([text for _, text in chunk]), strict=True):
            (held_out if is_held_out(key, config.eval_fraction) else train).append(ids.astype(dtype))
    where = config.path or "the Python standard library"
    if count == 0 or sum(len(ids) for ids in train + held_out) == count:  # only end-of-document ids
        raise ValueError(f"data.source={config.source} found no text in {where}: the corpus is empty")
    if not train or not held_out:
        raise ValueError(
            f"data.eval_fraction={config.eval_fraction} leaves the "
            f"{'train' if not train else 'held-out'} split of {count} documents empty; "
            "use more documents or another eval_fraction"
        )
    description = f"{count:,} {config.source} documents"
    return Corpus(np.concatenate(train), np.concatenate(held_out), count, description)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32)
