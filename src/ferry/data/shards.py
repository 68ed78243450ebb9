"""A prepared corpus on disk: token shards and the manifest that describes them.

```
DIR/manifest.json          format, tokenizer (identity, vocab size, end-of-document id), token
                           dtype, the source's data.* keys and their hash, documents and tokens per
                           split, and every shard: its file, unit of work, tokens and documents
DIR/train/000042.bin       the tokens of unit 42's training documents, each followed by the
DIR/eval/000042.bin        end-of-document id, as raw little-endian integers of the manifest's dtype
DIR/train/000042.weights   a chat corpus (data.format=chat) only: each token's loss weight, one
                           byte a token (1: the token is part of a reply and counts as a target)
```

Training memory-maps the shards and reads only the windows it batches, so start-up time and
memory do not grow with the corpus. Everything a directory could get wrong (another tokenizer, a
vocabulary larger than the model's, a missing or short shard, a newer format) is refused when it
is opened, naming the file and the fix; so is a manifest's `dtype` that would read other ids than
were written (signed, unknown, too narrow for the vocabulary).
"""

import collections
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Integer

from ferry.errors import FerryError

FORMAT = 1  # the manifest format this ferry writes and reads
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
_OPEN_SHARDS = 256  # memory maps kept open at once (each holds a file descriptor)


class PreparedDataError(FerryError, ValueError):
    """A prepared directory that cannot be used as it is."""


@dataclasses.dataclass(frozen=True)
class Shard:
    file: str  # relative to the prepared directory
    unit: int  # the unit of work that wrote it
    tokens: int
    documents: int
    weights: str | None = None  # a chat corpus: the file of each token's loss weight (uint8)

    def to_json(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        if self.weights is None:  # a text corpus's manifest is written as before chat corpora existed
            del record["weights"]
        return record


@dataclasses.dataclass(frozen=True)
class Manifest:
    tokenizer: str  # data.tokenizer as given when preparing
    tokenizer_identity: str
    vocab_size: int
    end_of_document: int
    dtype: str
    source: dict[str, Any]  # the data.* keys that decide the tokens, and the source files' fingerprint
    source_hash: str
    shards: dict[str, tuple[Shard, ...]]  # per split, in the order of the token stream
    format: int = FORMAT
    skipped: tuple[str, ...] = ()  # the source's files skipped as not text (`ferry.data.text_check`)

    def documents(self, split: str) -> int:
        return sum(shard.documents for shard in self.shards[split])

    def tokens(self, split: str) -> int:
        return sum(shard.tokens for shard in self.shards[split])

    @property
    def weighted(self) -> bool:
        """Whether the shards carry per-token loss weights (a chat corpus)."""
        return any(shard.weights is not None for split in SPLITS for shard in self.shards[split])

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "tokenizer": {
                "spec": self.tokenizer,
                "identity": self.tokenizer_identity,
                "vocab_size": self.vocab_size,
                "end_of_document": self.end_of_document,
            },
            "dtype": self.dtype,
            "documents": {split: self.documents(split) for split in SPLITS},
            "tokens": {split: self.tokens(split) for split in SPLITS},
            "source": self.source,
            "source_hash": self.source_hash,
            "shards": {split: [shard.to_json() for shard in self.shards[split]] for split in SPLITS},
            "skipped": list(self.skipped),
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> "Manifest":
        tokenizer = data["tokenizer"]
        return Manifest(
            tokenizer=tokenizer["spec"],
            tokenizer_identity=tokenizer["identity"],
            vocab_size=int(tokenizer["vocab_size"]),
            end_of_document=int(tokenizer["end_of_document"]),
            dtype=data["dtype"],
            source=data["source"],
            source_hash=data["source_hash"],
            shards={split: tuple(Shard(**shard) for shard in data["shards"][split]) for split in SPLITS},
            format=int(data["format"]),
            skipped=tuple(str(key) for key in data.get("skipped", ())),  # absent before ferry refused binary files
        )


def read_manifest(directory: Path) -> Manifest:
    """The manifest of a prepared directory; refuses a missing, damaged or newer one."""
    path = directory / MANIFEST
    if not path.is_file():
        unfinished = (directory / ".progress").is_dir()
        raise PreparedDataError(
            f"data.prepared={directory} has no {MANIFEST}: "
            + (
                "its preparation has not finished; run python launch/prepare_data.py again with the same "
                "data.* keys to finish it"
                if unfinished
                else "it is not a prepared corpus; write one with python launch/prepare_data.py "
                f"data.prepared={directory} data.source=... data.path=..."
            )
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PreparedDataError(
            f"{path}:{error.lineno} is not JSON ({error.msg}); prepare the corpus again into a new directory"
        ) from error
    if not isinstance(data, dict) or not isinstance(data.get("format"), int):
        raise PreparedDataError(f"{path} has no format number; it was not written by launch/prepare_data.py")
    if data["format"] > FORMAT:
        raise PreparedDataError(
            f"{path} has format {data['format']}, written by a newer ferry (this one reads format {FORMAT}); "
            "upgrade ferry, or prepare the corpus again with this one into a new directory"
        )
    try:
        check_dtype(path, data["dtype"], int(data["tokenizer"]["vocab_size"]))
        return Manifest.from_json(data)
    except PreparedDataError:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise PreparedDataError(
            f"{path} lacks {error} or holds it in another form; prepare the corpus again"
        ) from error


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id below `vocab_size`: what shards are written in."""
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32)


def _dtype_fix(vocab_size: int) -> str:
    return (
        f'set "dtype" to "{token_dtype(vocab_size).name}" if the shards were written by prepare_data (its type for '
        f"a {vocab_size:,}-id vocabulary), or prepare the corpus again into a new directory"
    )


def check_dtype(path: Path, dtype: object, vocab_size: int) -> None:
    """The manifest's `dtype` reads the shards as they were written: an unsigned integer type (a
    signed one reads the ids in the top half of its range as negative ones), little-endian. Anything
    else would train on other ids than were written. (Whether it holds the vocabulary is
    `check_dtype_width`'s, once the vocabulary is known to be the tokenizer's.)"""
    problem: str | None = None
    try:
        parsed = np.dtype(dtype)  # type: ignore[call-overload]  # any JSON value: refused below if not a type
    except (TypeError, ValueError, KeyError):
        problem = "is not a numpy integer type"
    else:
        if parsed.kind == "i":
            problem = "is signed: ids in the top half of its range would be read as negative ones"
        elif parsed.kind != "u":
            problem = "is not an unsigned integer type, the type of token ids"
        elif parsed.byteorder == ">":
            problem = "is big-endian; shards are written little-endian"
    if problem is not None:
        raise PreparedDataError(f'{path}: "dtype": {json.dumps(dtype)} {problem}; {_dtype_fix(vocab_size)}')


def check_dtype_width(path: Path, manifest: Manifest) -> None:
    """The manifest's `dtype` holds every id of its vocabulary (a narrower one would have cut them)."""
    largest = int(np.iinfo(np.dtype(manifest.dtype)).max)
    if largest < manifest.vocab_size - 1:
        raise PreparedDataError(
            f'{path}: "dtype": "{manifest.dtype}" holds ids up to {largest:,}, but the vocabulary has '
            f"{manifest.vocab_size:,} ids; {_dtype_fix(manifest.vocab_size)}"
        )


def damaged_shards(directory: Path, manifest: Manifest) -> list[tuple[Shard, str]]:
    """Each shard that is missing or whose size is not what the manifest says, and what is wrong."""
    itemsize = np.dtype(manifest.dtype).itemsize
    problems = []
    for split in SPLITS:
        for shard in manifest.shards[split]:
            path = directory / shard.file
            if not path.is_file():
                problems.append((shard, f"{path} is missing"))
            elif (size := path.stat().st_size) != (expected := shard.tokens * itemsize):
                how = "cut short" if size < expected else "grown"
                problems.append((shard, f"{path} holds {size:,} bytes, the manifest says {expected:,} ({how})"))
            elif shard.weights is not None and (problem := _weights_problem(directory, shard)) is not None:
                problems.append((shard, problem))
    return problems


def _weights_problem(directory: Path, shard: Shard) -> str | None:
    """What is wrong with a shard's loss-weight file (one byte per token), or None."""
    assert shard.weights is not None
    path = directory / shard.weights
    if not path.is_file():
        return f"{path} is missing"
    if (size := path.stat().st_size) != shard.tokens:
        return f"{path} holds {size:,} bytes, the manifest says {shard.tokens:,} (one loss weight a token)"
    return None


def check_prepared(directory: Path, manifest: Manifest, tokenizer_identity: str, tokenizer_spec: str) -> None:
    """The directory was tokenized by this tokenizer and every shard is whole."""
    if manifest.tokenizer_identity != tokenizer_identity:
        raise PreparedDataError(
            f"{directory / MANIFEST} was tokenized with data.tokenizer={manifest.tokenizer} "
            f"({manifest.tokenizer_identity}), "
            f"but data.tokenizer={tokenizer_spec} is {tokenizer_identity}; pass data.tokenizer={manifest.tokenizer} "
            "(and its data.eos_token), or prepare the corpus again with this tokenizer into a new directory"
        )
    problems = damaged_shards(directory, manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PreparedDataError(
            f"{problems[0][1]}{more}: the shards do not match {directory / MANIFEST}. Run python "
            f"launch/prepare_data.py data.prepared={directory} with the data.* keys it was prepared with to rewrite "
            "those shards"
        )


class ShardedTokens:
    """One split's token stream: its shards joined end to end, each memory-mapped when first read
    (at most a few hundred kept open). Reads contiguous slices; `np.asarray` gives the whole."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: np.dtype):
        self.paths, self.dtype = paths, np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._open: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def of(directory: Path, manifest: Manifest, split: str) -> "ShardedTokens":
        shards = manifest.shards[split]
        return ShardedTokens([directory / s.file for s in shards], [s.tokens for s in shards], np.dtype(manifest.dtype))

    @staticmethod
    def weights_of(directory: Path, manifest: Manifest, split: str) -> "ShardedTokens | None":
        """One split's per-token loss weights (uint8, aligned with its tokens), or None for a text corpus."""
        shards = manifest.shards[split]
        if not manifest.weighted:
            return None
        files = [directory / s.weights for s in shards if s.weights is not None]
        if len(files) != len(shards):
            raise PreparedDataError(
                f"{directory / MANIFEST} gives loss weights to some shards of the {split} split but not all; "
                "prepare the corpus again into a new directory"
            )
        return ShardedTokens(files, [s.tokens for s in shards], np.dtype(np.uint8))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, position: int) -> tuple[Path, int]:
        """The shard holding the stream's token `position`, and the token's offset in it."""
        shard = int(np.searchsorted(self.starts, position, side="right")) - 1
        return self.paths[shard], position - int(self.starts[shard])

    def _shard(self, index: int) -> np.ndarray:
        with self._lock:
            if index in self._open:
                self._open.move_to_end(index)
                return self._open[index]
            tokens = np.memmap(self.paths[index], dtype=self.dtype, mode="r")
            self._open[index] = tokens
            if len(self._open) > _OPEN_SHARDS:
                self._open.popitem(last=False)
            return tokens

    def __getitem__(self, index: slice) -> Integer[np.ndarray, " length"]:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("ShardedTokens reads contiguous slices only")
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[shard + 1]))
            offset = int(self.starts[shard])
            pieces.append(np.asarray(self._shard(shard)[start - offset : end - offset]))
            start, shard = end, shard + 1
        if len(pieces) == 1:
            return pieces[0].copy()  # not a view of the map: the batch outlives it
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)
