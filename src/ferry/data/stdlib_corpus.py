"""The default corpus: the Python standard library's own source files.

It is real text that exists on every machine that runs ferry, so the default run needs no
download. Files are split into train and held-out sets by a hash of their path, so the split is
the same on every machine with the same Python version.
"""

import dataclasses
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from ferry.data.tokenizer import ByteTokenizer


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # token ids, documents separated by the tokenizer's end-of-document id
    eval: np.ndarray
    num_documents: int


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def _is_held_out(relative_path: str, eval_fraction: float) -> bool:
    return zlib.crc32(relative_path.encode()) / 2**32 < eval_fraction


def load_stdlib_corpus(eval_fraction: float, tokenizer: ByteTokenizer, root: Path | None = None) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no Python source files under {root}: the stdlib corpus is empty")
    train, held_out = [], []
    for path in files:
        ids = tokenizer.encode_document(path.read_bytes())
        (held_out if _is_held_out(str(path.relative_to(root)), eval_fraction) else train).append(ids)
    if not train or not held_out:
        raise ValueError(
            f"eval_fraction {eval_fraction} leaves the train or held-out split of {len(files)} files empty"
        )
    return Corpus(np.concatenate(train), np.concatenate(held_out), len(files))
