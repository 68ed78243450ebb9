"""A corpus: train and held-out token streams, read from token shards on disk.

`data.prepared=DIR` reads shards written by `launch/prepare_data.py`, checked against the
tokenizer and the model's vocabulary first; nothing is tokenized at start-up. A raw source
(stdlib, text, JSONL, ...) is tokenized once into a cache directory keyed by the source's keys, its
files and the tokenizer, and read from there on every later start. Either way the streams are
memory-mapped, so start-up time and memory do not grow with the corpus. Documents are split by a
hash of their key, so the split is the same on every machine.
"""

import dataclasses
from pathlib import Path

import numpy as np
from rich.console import Console

from ferry.data.config import DataConfig
from ferry.data.pipeline import PackedWindows
from ferry.data.prepare import cache_directory, is_held_out, prepare_corpus
from ferry.data.segments import DocumentMask
from ferry.data.shards import (
    MANIFEST,
    Manifest,
    PreparedDataError,
    ShardedTokens,
    check_dtype_width,
    check_prepared,
    read_manifest,
    token_dtype,
)
from ferry.data.text_check import skipped_line
from ferry.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Corpus", "check_vocab", "document_mask_of", "is_held_out", "load_corpus", "open_prepared", "token_dtype"]


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray | ShardedTokens  # token ids, each document followed by the end-of-document id
    eval: np.ndarray | ShardedTokens
    num_documents: int
    description: str  # for the start-up line, e.g. "1,812 stdlib documents"
    end_of_document: int | None = None  # None: synthetic tokens, which have no documents
    train_weights: ShardedTokens | None = None  # a chat corpus: each token's loss weight (None: every token counts)
    eval_weights: ShardedTokens | None = None

    def windows(self, split: str, seq_len: int) -> PackedWindows:
        """The split's windows of `seq_len` inputs, with their loss weights where the corpus has them."""
        if split == "train":
            return PackedWindows(self.train, seq_len, self.train_weights)
        return PackedWindows(self.eval, seq_len, self.eval_weights)


def document_mask_of(config: DataConfig) -> DocumentMask | None:
    """What the model needs to keep packed documents apart (data.document_mask), or None; from the
    config's tokenizer alone, so a plan builds the mask a run trains with without reading the corpus
    (a prepared corpus's end-of-document token is checked against the same tokenizer when opened)."""
    if not config.document_mask:
        return None
    return DocumentMask(
        load_tokenizer(config.tokenizer, config.eos_token).end_of_document, config.loss_across_documents
    )


def check_vocab(tokenizer: Tokenizer, vocab_size: int, model_name: str) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model {model_name} has vocab_size {vocab_size}; "
            f"use a model with vocab_size >= {tokenizer.vocab_size} (model.vocab_size={tokenizer.vocab_size}) "
            "or a tokenizer with fewer ids"
        )


def open_prepared(
    directory: Path, tokenizer: Tokenizer, tokenizer_spec: str, vocab_size: int, model_name: str = "the model"
) -> Manifest:
    """A prepared directory's manifest, after checking its format, its tokenizer against
    `tokenizer`, its vocabulary against the model's and that every shard is whole."""
    if not directory.is_dir():
        raise PreparedDataError(
            f"data.prepared={directory} is not a directory; write one with python launch/prepare_data.py "
            f"data.prepared={directory} data.source=... data.path=..."
        )
    manifest = read_manifest(directory)
    check_manifest_tokenizer(directory, manifest, tokenizer, tokenizer_spec)
    if manifest.vocab_size > vocab_size:
        raise PreparedDataError(
            f"{directory / 'manifest.json'} holds tokens of a {manifest.vocab_size}-id vocabulary but model "
            f"{model_name} has vocab_size {vocab_size}; use a model with model.vocab_size={manifest.vocab_size} "
            "or more, or prepare the corpus with a smaller tokenizer"
        )
    check_prepared(directory, manifest, tokenizer.identity, tokenizer_spec)
    check_dtype_width(directory / MANIFEST, manifest)
    return manifest


def check_manifest_tokenizer(directory: Path, manifest: Manifest, tokenizer: Tokenizer, tokenizer_spec: str) -> None:
    """The manifest's vocabulary and end-of-document id are those of the tokenizer it names (an
    edited manifest would otherwise pass the model's check with ids the model never sees)."""
    if manifest.tokenizer_identity != tokenizer.identity:
        return  # another tokenizer altogether: `check_prepared` says so
    for what, recorded, actual in (
        ("vocab_size", manifest.vocab_size, tokenizer.vocab_size),
        ("end_of_document", manifest.end_of_document, tokenizer.end_of_document),
    ):
        if recorded != actual:
            raise PreparedDataError(
                f"{directory / 'manifest.json'} records tokenizer {what} {recorded}, but the tokenizer it names "
                f"(data.tokenizer={tokenizer_spec}, {tokenizer.identity}) has {actual}: the manifest was edited or "
                "damaged. Prepare the corpus again with python launch/prepare_data.py into a new directory"
            )


def skipped_note(manifest: Manifest) -> str | None:
    """The line naming the source's files that its preparation skipped as not text, or None."""
    source = manifest.source
    return skipped_line(manifest.skipped, int(source.get("files", 0)), f"data.path={source.get('path')}")


def load_corpus(
    config: DataConfig,
    tokenizer: Tokenizer,
    vocab_size: int,
    console: Console | None = None,
    model_name: str = "the model",
) -> Corpus:
    """The corpus `config` names; synthetic tokens are uniform over `vocab_size`. A raw source is
    tokenized into its cache on first use (a progress line on `console`)."""
    if config.source == "synthetic":
        rng = np.random.default_rng(config.seed)
        eval_tokens = max(2, int(config.synthetic_tokens * config.eval_fraction))
        tokens = rng.integers(0, vocab_size, config.synthetic_tokens + eval_tokens, dtype=np.int64)
        tokens = tokens.astype(token_dtype(vocab_size))
        return Corpus(tokens[: config.synthetic_tokens], tokens[config.synthetic_tokens :], 0, "synthetic tokens")
    if config.prepared is not None:
        directory = Path(config.prepared).expanduser()
        manifest = open_prepared(directory, tokenizer, config.tokenizer, vocab_size, model_name)
        origin = f"prepared in {directory}"
    else:
        check_vocab(tokenizer, vocab_size, model_name)
        directory = cache_directory(config, tokenizer)
        prepared = prepare_corpus(config, directory, tokenizer, console)
        manifest = prepared.manifest
        origin = f"tokenized into {directory}" if prepared.units_written else f"cached in {directory}"
    check_format(config, manifest, directory)
    if console is not None and (note := skipped_note(manifest)) is not None:
        console.print(note, highlight=False)
    documents = manifest.documents("train") + manifest.documents("eval")
    return Corpus(
        ShardedTokens.of(directory, manifest, "train"),
        ShardedTokens.of(directory, manifest, "eval"),
        documents,
        f"{documents:,} {manifest.source.get('source', config.source)} "
        f"{'conversations' if manifest.weighted else 'documents'} {origin}",
        manifest.end_of_document,
        ShardedTokens.weights_of(directory, manifest, "train"),
        ShardedTokens.weights_of(directory, manifest, "eval"),
    )


def check_format(config: DataConfig, manifest: Manifest, directory: Path) -> None:
    """A chat corpus (its shards carry loss weights) is read with data.format=chat, a text one without."""
    if manifest.weighted and config.format != "chat":
        raise PreparedDataError(
            f"{directory} is a chat corpus (its tokens carry loss weights); set data.format=chat to train on it"
        )
    if config.format == "chat" and not manifest.weighted:
        raise PreparedDataError(
            f"data.format=chat but {directory} holds plain text tokens without loss weights; prepare it again with "
            "data.format=chat data.source=jsonl, or drop data.format=chat"
        )
