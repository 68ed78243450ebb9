"""What a run's batches are made of, saved with every checkpoint: a resume whose data-affecting
keys differ would continue the checkpoint's data position over other batches (silently), so it is
refused naming the keys unless `run.allow_data_change=true`."""

import hashlib
from pathlib import Path
from typing import Any

from ferry.config.root import FerryConfig
from ferry.data.shards import MANIFEST
from ferry.data.tokenizer import Tokenizer

# the data.* keys that decide a raw source's documents (a prepared corpus is named by its manifest)
SOURCE_KEYS = ("source", "path", "pattern", "field", "separator", "document_bytes", "eval_fraction")


def data_identity(config: FerryConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """The keys that decide which batch comes at which data position, as `key: value`."""
    data, train = config.data, config.train
    identity: dict[str, Any] = {
        "train.global_batch_size": train.global_batch_size,
        "train.seq_len": train.seq_len,
        "data.seed": data.seed,
        "data.tokenizer": tokenizer.identity,  # its contents: the same file moved is the same tokenizer
    }
    if data.prepared is not None:
        manifest = Path(data.prepared).expanduser() / MANIFEST
        identity["data.prepared"] = f"{MANIFEST} sha256:{hashlib.sha256(manifest.read_bytes()).hexdigest()}"
    elif data.source == "synthetic":
        identity["data.source"] = "synthetic"
        identity["data.synthetic_tokens"] = data.synthetic_tokens
        identity["data.eval_fraction"] = data.eval_fraction
    else:
        for key in SOURCE_KEYS:
            value = getattr(data, key)
            if key == "path" and value is not None:
                value = str(Path(value).expanduser().absolute())
            identity[f"data.{key}"] = value
    if data.format != "text":  # absent for text, so a checkpoint saved before data.format resumes unchanged
        identity["data.format"] = data.format
    return identity


def data_difference(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """`key: saved -> current` for each data-affecting key that differs; none for a checkpoint
    of an earlier ferry, which did not record them."""
    if saved is None:
        return []
    keys = list(current) + [k for k in saved if k not in current]
    return [f"{key}: {saved.get(key)} -> {current.get(key)}" for key in keys if saved.get(key) != current.get(key)]
