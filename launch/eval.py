"""Held-out loss, perplexity and bits per byte of a run's checkpoint, on any dataset ferry reads:

    python launch/eval.py RUN_DIR run                           # the run's own held-out split, latest checkpoint
    python launch/eval.py RUN_DIR run stdlib jsonl:corpus/ --step 200 --batches 20
    python launch/eval.py RUN_DIR corpus/notes/ prepared:tokens/ data/test.jsonl

Each DATA names a dataset in the forms the data config accepts: `run` (the run's own data.*
keys), `stdlib`, SOURCE:PATH (SOURCE one of text, jsonl, parquet, arrayrecord, hf_dataset, or
`prepared` for a directory launch/prepare_data.py wrote), or a bare PATH whose source is read
off it (a prepared directory's manifest.json, a saved dataset's state.json, the files' suffix).
The run's tokenizer, data.field, data.format and data.eval_fraction apply; the `--split` (held-out
by default, as data.eval_fraction's hash picks it) is read in order, `--batches` whole batches of
the run's train.global_batch_size x train.seq_len (default: all of them), each scored by the run's
own eval step (`ferry.train.step.make_eval_step`), so `run` gives the loss the run logs as
eval_loss at that step when `--batches` is its train.eval_batches.

One line per dataset is printed, and the same record appended to RUN_DIR/eval.jsonl: step,
dataset, split, batches, tokens (the targets that count: a chat run's replies only), bytes, loss
(nats a token), perplexity, and bits per byte: the loss summed over the counted targets, in bits,
over the bytes of the text they came from (for the byte tokenizer one a token; for a Hugging Face
tokenizer each run of counted tokens decoded, an end-of-document id counting as one byte).

Exit status: 0 evaluated; 2 refused (one line, before any checkpoint is read: no run directory or
checkpoint, a dataset that does not exist or cannot be read, too few tokens for one batch).
"""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ferry.data.config import DataConfig
from ferry.data.corpus import Corpus, load_corpus
from ferry.data.pipeline import PackedWindows
from ferry.data.shards import read_manifest
from ferry.data.sources import DEFAULT_PATTERNS, FILE_SOURCES
from ferry.data.tokenizer import ByteTokenizer, Tokenizer
from ferry.errors import DataError, FerryError
from ferry.run.saved_run import saved_run

SPLITS = {"eval": "held-out", "train": "train"}


class EvalError(DataError):
    """A dataset or an evaluation that cannot run as asked."""


def data_config(spec: str, run_data: DataConfig, format: str | None) -> DataConfig:
    """The data config DATA names, with the run's tokenizer and keys."""
    keys: dict[str, Any] = {"pattern": None, "prepared": None, "separator": None, "document_bytes": None}
    if spec == "run":
        return run_data if format is None else dataclasses.replace(run_data, format=format)
    source, colon, path = spec.partition(":")
    if spec == "stdlib":
        keys |= {"source": "stdlib", "path": None}
    elif colon and source == "prepared":
        keys |= {"source": "jsonl", "prepared": path}
    elif colon and source in (*FILE_SOURCES, "stdlib"):
        keys |= {"source": source, "path": path}
    else:
        keys |= source_of(Path(spec))
    if keys["prepared"] is not None:  # a chat corpus or a text one, as its manifest says
        prepared = Path(keys["prepared"]).expanduser()
        weighted = (prepared / "manifest.json").is_file() and read_manifest(prepared).weighted
        chosen = format or ("chat" if weighted else "text")
    else:
        chosen = format or (run_data.format if keys["source"] == "jsonl" else "text")
    try:
        return dataclasses.replace(run_data, **keys, format=chosen)
    except ValueError as error:
        raise EvalError(f"{spec}: {error}") from error


def source_of(path: Path) -> dict[str, Any]:
    """The source of a bare PATH: a prepared corpus, a saved dataset, or files by their suffix."""
    if not path.exists():
        raise EvalError(
            f"{path} does not exist; name a dataset as run, stdlib, SOURCE:PATH (SOURCE one of "
            f"{', '.join(FILE_SOURCES)}, prepared) or an existing file or directory"
        )
    if (path / "manifest.json").is_file():
        return {"source": "jsonl", "prepared": str(path)}
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return {"source": "hf_dataset", "path": str(path)}
    for source, pattern in DEFAULT_PATTERNS.items():
        if source == "hf_dataset":
            continue
        if (path.is_file() and path.match(pattern)) or (path.is_dir() and next(path.rglob(pattern), None)):
            return {"source": source, "path": str(path)}
    raise EvalError(
        f"{path}: no source read off it (no manifest.json, state.json, nor *.txt, *.jsonl, *.parquet, *.array_record "
        "files); name it as SOURCE:PATH, e.g. text:{path}"
    )


@dataclasses.dataclass(frozen=True)
class Scored:
    loss: float  # nats a counted target
    tokens: int
    bytes: int
    batches: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @property
    def bits_per_byte(self) -> float:
        return self.loss * self.tokens / math.log(2) / self.bytes if self.bytes else math.nan


def counted_targets(windows: PackedWindows, stop: int, end_of_document: int | None, across: bool) -> np.ndarray:
    """Which targets of the stream's tokens [1, stop) count in the loss: a chat corpus's replies,
    and, with loss_across_documents=false, none predicted from an end-of-document id."""
    counted = np.ones(stop - 1, bool)
    if windows.weights is not None:
        counted &= np.asarray(windows.weights[1:stop]) != 0
    if end_of_document is not None and not across:
        counted &= np.asarray(windows.tokens[0 : stop - 1]) != end_of_document
    return counted


def text_bytes(tokenizer: Tokenizer, targets: np.ndarray, counted: np.ndarray) -> int:
    """The bytes of the text the counted targets came from: one a token for the byte tokenizer;
    else each run of counted tokens between end-of-document ids decoded (the id counts one byte,
    as the byte tokenizer's does)."""
    if isinstance(tokenizer, ByteTokenizer):
        return int(counted.sum())
    ends = targets == tokenizer.end_of_document
    total = int(np.sum(counted & ends))
    pieces = counted & ~ends
    edges = np.flatnonzero(np.diff(np.concatenate([[0], pieces.astype(np.int8), [0]])))
    runs = [targets[start:stop].tolist() for start, stop in zip(edges[::2], edges[1::2], strict=True)]
    for begin in range(0, len(runs), 1024):
        texts = tokenizer.tokenizer.decode_batch(runs[begin : begin + 1024], skip_special_tokens=False)  # type: ignore[attr-defined]
        total += sum(len(text.encode()) for text in texts)
    return total


def checked_batches(windows: PackedWindows, batch_size: int, asked: int | None, where: str) -> int:
    whole = windows.num_windows // batch_size
    if whole < 1:
        raise EvalError(
            f"{where} holds {len(windows.tokens):,} tokens: {windows.num_windows} windows of {windows.seq_len}, fewer "
            f"than one batch of {batch_size}; use more data or another --split"
        )
    if asked is not None and asked < 1:
        raise EvalError(f"--batches {asked}: evaluate at least one batch")
    return whole if asked is None else min(asked, whole)


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    config: DataConfig
    corpus: Corpus
    windows: PackedWindows
    batches: int


def open_dataset(
    spec: str, run_config: Any, tokenizer: Tokenizer, split: str, batches: int | None, format: str | None
) -> Dataset:
    """The dataset DATA names, tokenized (into the data cache) and checked, before any checkpoint is read."""
    from ferry.data.token_range import check_span
    from ferry.run.preflight import data_refusals

    model = run_config.model
    with data_refusals():
        config = data_config(spec, run_config.data, format)
        corpus = load_corpus(config, tokenizer, model.vocab_size, None, run_config.model_name)
    windows = corpus.windows(split, run_config.train.seq_len)
    where = f"{spec}'s {SPLITS[split]} split"
    count = checked_batches(windows, run_config.train.global_batch_size, batches, where)
    read = count * run_config.train.global_batch_size * windows.seq_len + 1
    check_span(windows.tokens, 0, read, model.vocab_size, SPLITS[split], run_config.model_name)
    return Dataset(spec, config, corpus, windows, count)


def score(dataset: Dataset, eval_step: Any, model: Any, tokenizer: Tokenizer, run_config: Any) -> Scored:
    """The dataset's loss a counted target over its batches, taken in order."""
    import jax.numpy as jnp

    batch_size, seq_len = run_config.train.global_batch_size, run_config.train.seq_len
    windows, data = dataset.windows, run_config.data
    stop = dataset.batches * batch_size * seq_len + 1
    counted = counted_targets(windows, stop, dataset.corpus.end_of_document, data.loss_across_documents)
    per_batch = counted.reshape(dataset.batches, -1).sum(axis=1)
    nats = 0.0
    for index in range(dataset.batches):
        rows = windows.rows(np.arange(index * batch_size, (index + 1) * batch_size))
        nats += float(eval_step(model, jnp.asarray(rows))) * int(per_batch[index])
    tokens = int(per_batch.sum())
    if tokens == 0:
        raise EvalError(f"{dataset.name}: none of the {stop - 1:,} targets evaluated counts in the loss")
    targets = np.asarray(windows.tokens[1:stop])
    return Scored(nats / tokens, tokens, text_bytes(tokenizer, targets, counted), dataset.batches)


def evaluate(
    run_dir: Path,
    specs: list[str],
    step: int | None = None,
    batches: int | None = None,
    split: str = "eval",
    format: str | None = None,
) -> list[dict[str, Any]]:
    """Score checkpoint `step` (default: the latest) of `run_dir` on each dataset; the records,
    also appended to run_dir/eval.jsonl."""
    from ferry.data.corpus import document_mask_of
    from ferry.offload.engine import SAVE_ALL
    from ferry.train.step import LossSettings, make_eval_step

    if split not in SPLITS:
        raise EvalError(f"--split {split}: use eval (the held-out split) or train")
    if format not in (None, "text", "chat"):
        raise EvalError(f"--format {format}: use text or chat (default: the run's, for a JSONL dataset)")
    run = saved_run(run_dir, step)  # checked before anything is read: the run, its step, its tokenizer
    config, step, tokenizer = run.config, run.step, run.tokenizer
    datasets = [open_dataset(spec, config, tokenizer, split, batches, format) for spec in specs]
    model = run.model()
    records = []
    for dataset in datasets:
        settings = LossSettings.of(
            config.train, SAVE_ALL, document_mask_of(config.data), dataset.config.format == "chat"
        )
        scored = score(dataset, make_eval_step(settings), model, tokenizer, config)
        record = {
            "step": step,
            "dataset": dataset.name,
            "split": SPLITS[split],
            "batches": scored.batches,
            "tokens": scored.tokens,
            "bytes": scored.bytes,
            "loss": scored.loss,
            "perplexity": scored.perplexity,
            "bits_per_byte": scored.bits_per_byte,
        }
        with (run_dir / "eval.jsonl").open("a") as log:
            log.write(json.dumps(record) + "\n")
        records.append(record)
        print(
            f"step {step} {dataset.name} ({SPLITS[split]}, {scored.batches} batches, {scored.tokens:,} tokens): "
            f"loss {scored.loss:.4f}, perplexity {scored.perplexity:.3f}, bits per byte {scored.bits_per_byte:.4f}",
            flush=True,
        )
    return records


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory launch/run.py wrote")
    parser.add_argument("data", nargs="+", help="datasets: run, stdlib, SOURCE:PATH, prepared:DIR or a PATH")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--batches", type=int, default=None, help="batches of each dataset (default: all whole ones)")
    parser.add_argument("--split", default="eval", help="eval (the held-out split, default) or train")
    parser.add_argument("--format", default=None, help="text or chat (default: the run's, for JSONL datasets)")
    args = parser.parse_args(argv)
    try:
        evaluate(args.run_dir, args.data, args.step, args.batches, args.split, args.format)
    except (FerryError, FileNotFoundError) as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main(sys.argv[1:]))
