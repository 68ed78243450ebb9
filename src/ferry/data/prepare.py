"""Tokenize a source once into token shards: `launch/prepare_data.py`, and the on-disk cache of a
raw source that training reads.

The source's documents are read in order and cut into units of about `data.shard_bytes` of text;
a pool of processes tokenizes the units, each writing its own shard per split (atomically:
written beside, then renamed) and then recorded in a journal, `.progress/units.jsonl`. An
interrupted preparation resumes from the journal: the source is read again but only the units
not yet written are tokenized. A finished one writes `manifest.json` (see `ferry.data.shards`)
and removes the journal; run again on the same input it finds nothing to do, and a shard lost
since is rewritten. A lock file keeps two processes from preparing one directory at once.
"""

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
import sysconfig
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column

from ferry.data.chat import ChatEncoder, chat_template_of
from ferry.data.config import DataConfig
from ferry.data.shards import (
    MANIFEST,
    SPLITS,
    Manifest,
    PreparedDataError,
    Shard,
    damaged_shards,
    read_manifest,
    token_dtype,
)
from ferry.data.sources import TextSplit, documents, source_files
from ferry.data.tokenizer import HuggingFaceTokenizer, Tokenizer, load_tokenizer

PROGRESS = ".progress"
_TOKENIZE_BATCH = 512  # documents per tokenizer call (Hugging Face tokenizers encode a batch in parallel)


def is_held_out(key: str, eval_fraction: float) -> bool:
    return zlib.crc32(key.encode()) / 2**32 < eval_fraction


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; a container's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def source_identity(config: DataConfig, tokenizer: Tokenizer) -> tuple[dict[str, Any], str]:
    """The data.* keys that decide the tokens, the fingerprint of the files they name (path, size
    and modification time of each), and a hash of both with the tokenizer's identity. Refuses a
    missing path before anything is written."""
    files = source_files(config.source, config.path, config.pattern)
    root = Path(config.path).expanduser().resolve() if config.path else Path(sysconfig.get_paths()["stdlib"])
    fingerprint = hashlib.sha256()
    total = 0
    for path in files:
        stat = path.stat()
        total += stat.st_size
        fingerprint.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    keys = ("source", "pattern", "field", "separator", "document_bytes", "eval_fraction", "shard_bytes")
    identity = {key: getattr(config, key) for key in keys}
    identity |= {"path": str(root), "files": len(files), "bytes": total, "files_sha256": fingerprint.hexdigest()}
    if config.format == "chat":  # absent for text: a text corpus keeps the hash it had before chat corpora
        identity |= {"format": "chat", "chat_template": chat_template_of(config.tokenizer).identity}
    digest = hashlib.sha256(json.dumps({**identity, "tokenizer": tokenizer.identity}, sort_keys=True).encode())
    return identity, digest.hexdigest()


def cache_directory(config: DataConfig, tokenizer: Tokenizer) -> Path:
    """Where a raw source's tokens are cached: keyed by the source, its files and the tokenizer."""
    _, digest = source_identity(config, tokenizer)
    root = config.cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "ferry", "tokens")
    return Path(root).expanduser() / f"{config.source}-{digest[:16]}"


@dataclasses.dataclass(frozen=True)
class UnitTask:
    """One unit of work: documents to tokenize and split, and where their shards go."""

    directory: str
    unit: int
    keys: list[str]
    texts: list[bytes]
    tokenizer: str
    eos_token: str | None
    eval_fraction: float
    dtype: str
    chat: bool = False  # data.format=chat: the texts are conversations, tokenized with their loss weights


@dataclasses.dataclass(frozen=True)
class UnitResult:
    unit: int
    documents: int
    tokens: int
    shards: dict[str, Shard | None]  # per split; None when no document of the unit went there

    def to_json(self) -> dict[str, Any]:
        shards = {split: None if shard is None else shard.to_json() for split, shard in self.shards.items()}
        return {**dataclasses.asdict(self), "shards": shards}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "UnitResult":
        shards = {split: None if s is None else Shard(**s) for split, s in data["shards"].items()}
        return UnitResult(data["unit"], data["documents"], data["tokens"], shards)


@functools.cache
def _worker_tokenizer(spec: str, eos_token: str | None) -> Tokenizer:
    """A tokenizing process loads its tokenizer once."""
    return load_tokenizer(spec, eos_token)


@functools.cache
def _worker_chat_encoder(spec: str, eos_token: str | None) -> ChatEncoder:
    """A tokenizing process loads its chat template once (data.format=chat)."""
    tokenizer = _worker_tokenizer(spec, eos_token)
    if not isinstance(tokenizer, HuggingFaceTokenizer):  # DataConfig refuses data.format=chat with bytes
        raise AssertionError(f"data.format=chat needs a Hugging Face tokenizer, not {spec}")
    return ChatEncoder(tokenizer.tokenizer, tokenizer.end_of_document, chat_template_of(spec))


def shard_file(split: str, unit: int) -> str:
    return f"{split}/{unit:06d}.bin"


def weights_file(split: str, unit: int) -> str:
    return f"{split}/{unit:06d}.weights"


def _encoded(task: UnitTask, texts: list[bytes], keys: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """(ids, loss weights or None) of each document: conversations with their weights, text without."""
    if task.chat:
        return list(_worker_chat_encoder(task.tokenizer, task.eos_token).encode_records(texts, keys))
    return [(ids, None) for ids in _worker_tokenizer(task.tokenizer, task.eos_token).encode_documents(texts)]


def _write_whole(array: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    array.tofile(partial)
    os.replace(partial, path)  # a shard is whole or absent


def tokenize_unit(task: UnitTask) -> UnitResult:
    """Tokenize a unit's documents, split them by key, and write a shard per non-empty split (and,
    for conversations, its loss weights beside it, written first: a shard present has its weights)."""
    ids_of: dict[str, list[tuple[np.ndarray, np.ndarray | None]]] = {split: [] for split in SPLITS}
    for start in range(0, len(task.texts), _TOKENIZE_BATCH):
        keys = task.keys[start : start + _TOKENIZE_BATCH]
        for key, example in zip(keys, _encoded(task, task.texts[start : start + _TOKENIZE_BATCH], keys), strict=True):
            ids_of["eval" if is_held_out(key, task.eval_fraction) else "train"].append(example)
    shards: dict[str, Shard | None] = {}
    tokens = 0
    for split, pieces in ids_of.items():
        if not pieces:
            shards[split] = None
            continue
        joined = np.concatenate([ids for ids, _ in pieces]).astype(task.dtype)
        weights = None
        if task.chat:
            weights = weights_file(split, task.unit)
            _write_whole(np.concatenate([w for _, w in pieces]).astype(np.uint8), Path(task.directory) / weights)
        name = shard_file(split, task.unit)
        _write_whole(joined, Path(task.directory) / name)
        shards[split] = Shard(name, task.unit, len(joined), len(pieces), weights)
        tokens += len(joined)
    return UnitResult(task.unit, len(task.texts), tokens, shards)


def units_of(stream: Iterator[tuple[str, bytes]], shard_bytes: int) -> Iterator[tuple[list[str], list[bytes]]]:
    """The documents cut into units of at least `shard_bytes` of text (the last may be smaller);
    the same cut every time the same source is read."""
    keys: list[str] = []
    texts: list[bytes] = []
    size = 0
    for key, text in stream:
        keys.append(key)
        texts.append(text)
        size += len(text)
        if size >= shard_bytes:
            yield keys, texts
            keys, texts, size = [], [], 0
    if keys:
        yield keys, texts


@dataclasses.dataclass(frozen=True)
class Prepared:
    manifest: Manifest
    units_written: int  # 0: everything was there already
    tokens_written: int
    seconds: float


def prepare_corpus(
    config: DataConfig, directory: Path, tokenizer: Tokenizer, console: Console | None = None
) -> Prepared:
    """Tokenize `config`'s source into `directory` (see the module docstring), with
    `config.workers` processes (default: every core); returns its manifest."""
    identity, digest = source_identity(config, tokenizer)  # refuses a bad path before writing anything
    if directory.exists() and not directory.is_dir():
        raise PreparedDataError(f"data.prepared={directory} is a file; name a directory for the prepared corpus")
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory, console):
        started = time.perf_counter()
        itemsize = token_dtype(tokenizer.vocab_size).itemsize
        done = _units_done(directory, digest, itemsize)
        if isinstance(done, Manifest):
            return Prepared(done, 0, 0, time.perf_counter() - started)
        progress_dir = directory / PROGRESS
        progress_dir.mkdir(exist_ok=True)
        (progress_dir / "state.json").write_text(json.dumps({"source_hash": digest, "source": identity}, indent=1))
        with (progress_dir / "units.jsonl").open("w") as journal:  # rewritten: only whole units stay
            for result in done.values():
                journal.write(json.dumps(result.to_json()) + "\n")
        (directory / MANIFEST).unlink(missing_ok=True)  # a damaged corpus: journalled first, then no longer complete
        skipped: list[str] = []  # the source's files that are not text
        written = _tokenize(config, directory, tokenizer, done, console, started, skipped)
        results = [done[unit] for unit in sorted(done)]
        manifest = dataclasses.replace(_manifest(config, tokenizer, identity, digest, results), skipped=tuple(skipped))
        partial = directory / (MANIFEST + ".partial")
        partial.write_text(json.dumps(manifest.to_json(), indent=1))
        os.replace(partial, directory / MANIFEST)
        shutil.rmtree(progress_dir)
        tokens = sum(done[unit].tokens for unit in written)
        return Prepared(manifest, len(written), tokens, time.perf_counter() - started)


@contextlib.contextmanager
def _locked(directory: Path, console: Console | None) -> Iterator[None]:
    """Hold `directory`'s lock (released when the process ends, however it ends)."""
    with (directory / ".lock").open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            if console is not None:
                console.print(f"waiting for {holder}, which is preparing {directory}", highlight=False)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {os.uname().nodename}")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _units_done(directory: Path, digest: str, itemsize: int) -> Manifest | dict[int, UnitResult]:
    """The complete manifest when there is nothing to do, else the units already written whole.
    A directory holding another corpus, or files of its own, is refused."""
    if (directory / MANIFEST).exists():
        return _units_of_manifest(directory, digest)
    if (directory / PROGRESS / "state.json").exists():
        return _units_of_journal(directory, digest, itemsize)
    leftovers = sorted(p.name for p in directory.iterdir() if p.name not in (".lock", PROGRESS))  # ours, empty
    if leftovers:
        raise PreparedDataError(
            f"{directory} holds files that are not a prepared corpus ({', '.join(leftovers[:3])}); "
            "name an empty or new directory in data.prepared"
        )
    return {}


def _other_corpus(directory: Path, what: str) -> PreparedDataError:
    return PreparedDataError(
        f"{directory} {what} other data.* keys, source files or tokenizer; prepare into a new "
        f"data.prepared directory, or delete {directory} to prepare this one there"
    )


def _units_of_manifest(directory: Path, digest: str) -> Manifest | dict[int, UnitResult]:
    """A finished preparation's manifest, or, when shards were lost or damaged since, its other
    units (the lost ones are tokenized again)."""
    manifest = read_manifest(directory)
    if manifest.source_hash != digest:
        raise _other_corpus(directory, "already holds a corpus prepared from")
    bad_units = {shard.unit for shard, _ in damaged_shards(directory, manifest)}
    if not bad_units:
        return manifest
    results: dict[int, dict[str, Shard | None]] = {}
    counts: dict[int, list[int]] = {}
    for split in SPLITS:
        for shard in manifest.shards[split]:
            results.setdefault(shard.unit, {s: None for s in SPLITS})[split] = shard
            counts.setdefault(shard.unit, [0, 0])
            counts[shard.unit][0] += shard.documents
            counts[shard.unit][1] += shard.tokens
    return {
        unit: UnitResult(unit, counts[unit][0], counts[unit][1], shards)
        for unit, shards in results.items()
        if unit not in bad_units
    }


def _units_of_journal(directory: Path, digest: str, itemsize: int) -> dict[int, UnitResult]:
    """An interrupted preparation's units whose shards were written whole."""
    try:
        state = json.loads((directory / PROGRESS / "state.json").read_text())
    except json.JSONDecodeError:
        state = {}
    if state.get("source_hash") != digest:
        raise _other_corpus(directory, "holds an unfinished preparation of a corpus from")
    done = {}
    journal = directory / PROGRESS / "units.jsonl"
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            result = UnitResult.from_json(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line torn by the interruption: that unit is tokenized again
        if all(_whole(directory, shard, itemsize) for shard in result.shards.values() if shard is not None):
            done[result.unit] = result
    return done


def _whole(directory: Path, shard: Shard, itemsize: int) -> bool:
    path = directory / shard.file
    if shard.weights is not None:
        weights = directory / shard.weights
        if not (weights.is_file() and weights.stat().st_size == shard.tokens):
            return False
    return path.is_file() and path.stat().st_size == shard.tokens * itemsize


def _tokenize(
    config: DataConfig,
    directory: Path,
    tokenizer: Tokenizer,
    done: dict[int, UnitResult],
    console: Console | None,
    started: float,
    skipped: list[str],
) -> list[int]:
    """Tokenize every unit not in `done` (adding it there); returns the units written. The keys of
    the source's files skipped as not text are added to `skipped`."""
    dtype = token_dtype(tokenizer.vocab_size).name
    split = TextSplit.of(config.separator, config.document_bytes)
    chat = config.format == "chat"
    source = documents(config.source, config.path, config.field, config.pattern, split, skipped, chat)
    stream = units_of(source, config.shard_bytes)
    workers = config.workers or available_cores()
    numbered = enumerate(stream)
    first = next(numbered, None)
    second = next(numbered, None)
    tasks = (
        UnitTask(
            str(directory), unit, keys, texts, config.tokenizer, config.eos_token, config.eval_fraction, dtype, chat
        )
        for unit, (keys, texts) in _chain(first, second, numbered)
        if unit not in done
    )
    description = f"{config.source} {config.path}" if config.path else config.source
    with _UnitRecorder(directory, done, console, started, description) as recorder:
        if second is None or workers == 1:  # one unit (or one worker): no processes to start
            for task in tasks:
                recorder.record(tokenize_unit(task))
        else:
            _tokenize_in_processes(tasks, workers, recorder.record)
    return recorder.written


def _tokenize_in_processes(tasks: Iterator[UnitTask], workers: int, record: Any) -> None:
    """`tokenize_unit` of each task in a pool of `workers` processes, each result `record`ed as it
    comes; at most 2 x workers units' text is held in memory at once."""
    context = multiprocessing.get_context("spawn")  # never fork a process that may run JAX threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending: set[concurrent.futures.Future] = set()
        try:
            for task in tasks:
                if len(pending) >= 2 * workers:  # the text held in memory stays bounded
                    finished, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                    for future in finished:
                        record(future.result())
                pending.add(pool.submit(tokenize_unit, task))
            for future in concurrent.futures.as_completed(pending):
                record(future.result())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


class _UnitRecorder:
    """Records each tokenized unit: in `done`, in the journal (`units.jsonl`, flushed at once, so
    an interrupted preparation resumes after it) and on the status line."""

    def __init__(
        self, directory: Path, done: dict[int, UnitResult], console: Console | None, started: float, what: str
    ):
        self.done, self.started, self.new_tokens = done, started, 0
        self.written: list[int] = []
        self.journal = (directory / PROGRESS / "units.jsonl").open("a")
        self.status = Progress(
            SpinnerColumn(),
            # one column that wraps between words on a narrow terminal (separate columns are cut mid-word)
            TextColumn(
                "tokenizing {task.description}: {task.fields[units]} units, {task.fields[documents]:,} documents, "
                "{task.fields[tokens]:,} tokens{task.fields[rate]}",
                markup=False,  # a path is text, not markup
                table_column=Column(no_wrap=False, overflow="fold"),
            ),
            TimeElapsedColumn(),
            console=console,
            disable=console is None,
        )
        self.task = self.status.add_task(what, total=None, units=0, documents=0, tokens=0, rate="")

    def __enter__(self) -> "_UnitRecorder":
        self.status.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        try:
            self.journal.close()
        finally:
            self.status.__exit__(kind, error, trace)

    def record(self, result: UnitResult) -> None:
        self.done[result.unit] = result
        self.written.append(result.unit)
        self.journal.write(json.dumps(result.to_json()) + "\n")
        self.journal.flush()
        self.new_tokens += result.tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        documents = sum(r.documents for r in self.done.values())
        tokens = sum(r.tokens for r in self.done.values())
        rate = f", {self.new_tokens / elapsed:,.0f} tokens/s"
        self.status.update(self.task, units=len(self.done), documents=documents, tokens=tokens, rate=rate)


def _chain(*heads_and_rest: Any) -> Iterator[Any]:
    *heads, rest = heads_and_rest
    yield from (head for head in heads if head is not None)
    yield from rest


def _manifest(
    config: DataConfig, tokenizer: Tokenizer, identity: dict[str, Any], digest: str, results: list[UnitResult]
) -> Manifest:
    """The manifest of a finished preparation; an empty corpus or split is refused."""
    count = sum(result.documents for result in results)
    where = config.path or "the Python standard library"
    if count == 0 or sum(result.tokens for result in results) == count:  # only end-of-document ids
        raise ValueError(f"data.source={config.source} found no text in {where}: the corpus is empty")
    shards = {split: tuple(r.shards[split] for r in results if r.shards[split] is not None) for split in SPLITS}
    for split in SPLITS:
        if not shards[split]:
            hint = (
                "; one text file is one document unless data.separator or data.document_bytes splits it"
                if config.source == "text" and config.separator is None and config.document_bytes is None
                else ""
            )
            raise ValueError(
                f"data.eval_fraction={config.eval_fraction} leaves the "
                f"{'train' if split == 'train' else 'held-out'} split of {count} documents empty; "
                f"use more documents or another eval_fraction{hint}"
            )
    return Manifest(
        tokenizer=config.tokenizer,
        tokenizer_identity=tokenizer.identity,
        vocab_size=tokenizer.vocab_size,
        end_of_document=tokenizer.end_of_document,
        dtype=token_dtype(tokenizer.vocab_size).name,
        source=identity,
        source_hash=digest,
        shards=shards,  # type: ignore[arg-type]
    )
