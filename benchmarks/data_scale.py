"""Data at pre-training scale, measured: a ~2 GB text corpus (the standard library's source files,
shuffled and repeated, generated into a temporary directory and deleted afterwards) prepared with
`launch/prepare_data.py`; then training start-up time (launch to the first step's metrics) and
peak RSS with it against the 30 MB stdlib corpus; then the loader's batches/s against what the
train step of llama_tiny asks for.

    python benchmarks/data_scale.py [--gigabytes 2] [--steps 30] [--workdir /tmp]

Every number comes from the real commands a user runs (subprocesses); nothing is committed.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from ferry.data.config import DataConfig
from ferry.data.corpus import load_corpus
from ferry.data.pipeline import PackedWindows, local_batches
from ferry.data.sources import stdlib_documents
from ferry.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
SEPARATOR = "\n\n--- end of document ---\n\n"
FILE_BYTES = 128 * 2**20  # the generated corpus is files of about this size


def generate_corpus(directory: Path, total_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Text files of stdlib sources in shuffled order, repeated until `total_bytes`; returns the
    bytes and documents written."""
    sources = [text for _, text in stdlib_documents()]
    rng = random.Random(seed)
    written = documents = 0
    directory.mkdir(parents=True, exist_ok=True)
    file_index = 0
    while written < total_bytes:
        order = list(range(len(sources)))
        rng.shuffle(order)
        with (directory / f"part-{file_index:03d}.txt").open("wb") as out:
            size = 0
            for index in order:
                out.write(sources[index] + SEPARATOR.encode())
                size += len(sources[index]) + len(SEPARATOR)
                documents += 1
                if size >= FILE_BYTES or written + size >= total_bytes:
                    break
        written += size
        file_index += 1
    return written, documents


def run_measured(command: list[str], env: dict[str, str], log: Path, watch: Path | None = None) -> dict[str, Any]:
    """Wall time, time to the first line of `watch` (the first step's metrics) and peak RSS of
    `command`, read through wait4 (the child's own peak); its output goes to `log`."""
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        first_step = None
        while True:
            if first_step is None and watch is not None and watch.exists() and watch.read_text().strip():
                first_step = time.perf_counter() - start
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.02)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    output = log.read_text()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output}")
    return {"wall_s": wall, "first_step_s": first_step or wall, "peak_rss": usage.ru_maxrss * 1024, "output": output}


def loader_rate(prepared: Path, batch: int, seq_len: int, batches: int) -> float:
    """Batches/s of the training data pipeline on the prepared corpus (one process holding every
    row; a background thread builds them, as in training)."""
    corpus = load_corpus(DataConfig(prepared=str(prepared)), ByteTokenizer(), 256)
    iterator = local_batches(PackedWindows(corpus.train, seq_len), batch, 0, np.arange(batch), prefetch=4)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    rate = batches / (time.perf_counter() - start)
    iterator.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=30, help="train steps of each start-up run")
    parser.add_argument("--workdir", default=None, help="where the corpus is generated (a temporary directory)")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="ferry_data_scale_") as work:
        work_dir = Path(work)
        env = {**os.environ, "COLUMNS": "160", "XDG_CACHE_HOME": str(work_dir / "cache")}
        start = time.perf_counter()
        size, documents = generate_corpus(work_dir / "text", int(args.gigabytes * 2**30))
        console.print(
            f"generated {size / 2**30:.2f} GiB, {documents:,} documents in {time.perf_counter() - start:.0f} s"
        )

        prepared = work_dir / "prepared"
        prepare = [
            sys.executable,
            str(ROOT / "launch" / "prepare_data.py"),
            f"data.prepared={prepared}",
            "data.source=text",
            f"data.path={work_dir / 'text'}",
            f"data.separator='{SEPARATOR.encode('unicode_escape').decode()}'",
        ]
        preparation = run_measured(prepare, env, work_dir / "prepare.log")
        manifest = json.loads((prepared / "manifest.json").read_text())
        tokens = manifest["tokens"]["train"] + manifest["tokens"]["eval"]
        again = run_measured(prepare, env, work_dir / "again.log")

        common = [
            "train.steps=" + str(args.steps),
            "train.log_every=1",
            "train.eval_batches=1",
            "train.eval_every=" + str(args.steps),
            "checkpoint.every=0",
            "log.tensorboard=false",
        ]
        runs = {}
        for name, data in (
            ("stdlib, first start (tokenizes into the cache)", []),
            ("stdlib, cached", []),
            (f"prepared, {size / 2**30:.1f} GiB", [f"data.prepared={prepared}"]),
        ):
            run_dir = work_dir / f"run{len(runs)}"
            launch = [sys.executable, str(ROOT / "launch" / "run.py"), *common, *data, f"run.dir={run_dir}"]
            runs[name] = run_measured(launch, env, work_dir / f"run{len(runs)}.log", watch=run_dir / "metrics.jsonl")
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            runs[name]["step_s"] = statistics.median(r["step_time_s"] for r in records if "step_time_s" in r)

        table = Table(title="training start-up (llama_tiny, batch 8 x 128, CPU)")
        for column in ("corpus", "launch to first step", "peak RSS", "median step"):
            table.add_column(column, justify="right" if column != "corpus" else "left")
        for name, run in runs.items():
            table.add_row(
                name,
                f"{run['first_step_s']:.1f} s",
                f"{run['peak_rss'] / 2**20:,.0f} MiB",
                f"{run['step_s'] * 1e3:.1f} ms",
            )
        console.print(table)
        cached, big = runs["stdlib, cached"], runs[f"prepared, {size / 2**30:.1f} GiB"]
        console.print(
            f"prepared / cached stdlib: start-up {big['first_step_s'] / cached['first_step_s']:.2f}x, "
            f"peak RSS {big['peak_rss'] / cached['peak_rss']:.2f}x",
            highlight=False,
        )
        console.print(
            f"prepare: {size / 2**30:.2f} GiB, {tokens:,} tokens in {preparation['wall_s']:.1f} s "
            f"({tokens / preparation['wall_s']:,.0f} tokens/s, {os.cpu_count()} cores, the command's whole wall time); "
            f"run again: {again['wall_s']:.1f} s, nothing to do",
            highlight=False,
        )
        rate = loader_rate(prepared, 8, 128, 2000)
        demand = 1 / big["step_s"]
        console.print(
            f"loader: {rate:,.0f} batches/s of 8 x 129 tokens against the train step's {demand:,.1f} batches/s "
            f"({rate / demand:,.0f}x)",
            highlight=False,
        )


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    main()
