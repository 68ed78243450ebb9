"""A training run from a validated config: every check first, then the run directory, then the
loop. Nothing is written or allocated before the config, the memory estimate, the data and the
offload policy have all been accepted."""

import dataclasses
import datetime
import itertools
import json
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ferry.data.batches import PackedBatches
from ferry.data.stdlib_corpus import Corpus, load_stdlib_corpus
from ferry.data.tokenizer import ByteTokenizer
from ferry.memory import check_fits
from ferry.metrics import MetricsWriter
from ferry.models.registry import TINY_MODELS, abstract_model, build_model, count_parameters, size_summary
from ferry.offload import Policy
from ferry.schedule import TransferSchedule, model_schedule, schedule_table
from ferry.sharding import batch_sharded, make_mesh, replicated
from ferry.train.config import FerryConfig
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.step import LossSettings, init_state, make_eval_step, make_train_step


class RunDirectoryError(FileExistsError):
    """The chosen run directory already holds a run."""


def resolve_run_dir(config: FerryConfig) -> Path:
    if config.run.dir is not None:
        path = Path(config.run.dir)
        if path.exists() and any(path.iterdir()):
            raise RunDirectoryError(
                f"run.dir={path} already holds files; ferry does not overwrite a run. "
                "Pass a new run.dir, or omit it for runs/<timestamp>/"
            )
        return path
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    for suffix in itertools.count():
        path = Path(config.run.root) / (stamp if suffix == 0 else f"{stamp}_{suffix}")
        if not path.exists():
            return path
    raise AssertionError("unreachable")


def _check_data(config: FerryConfig, tokenizer: ByteTokenizer) -> Corpus:
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model {config.model_name} has "
            f"vocab_size {config.model.vocab_size}; use a model with vocab_size >= {tokenizer.vocab_size}"
        )
    return load_stdlib_corpus(config.data.eval_fraction, tokenizer)


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A run whose config, memory estimate, data and offload policy have all been accepted."""

    config: FerryConfig
    corpus: Corpus
    schedule: TransferSchedule
    policy: Policy
    run_dir: Path


def prepare(config: FerryConfig, console: Console) -> PreparedRun:
    """Every check that can refuse the run, cheapest first; allocates no model, writes nothing."""
    model = abstract_model(config.model)  # traced once, shapes only
    num_parameters = count_parameters(model)
    tiny = TINY_MODELS[type(config.model)]
    check_fits(
        config.model_name,
        num_parameters,
        size_summary(config.model, num_parameters),
        f"Use model={tiny} on this machine, or run on devices whose memory holds it.",
    )
    policy = config.offload.policy(model.tagged_names())
    dtype = jnp.dtype(config.train.compute_dtype)
    schedule = model_schedule(
        model,
        policy,
        config.train.rows_per_micro_step,
        config.train.seq_len,
        dtype,
        config.offload.name,
        micro_steps=config.train.micro_steps,
    )
    corpus = _check_data(config, ByteTokenizer())
    console.print(
        f"model {config.model_name}: {num_parameters:,} parameters; "
        f"corpus: {corpus.num_documents} stdlib files, "
        f"{len(corpus.train):,} train / {len(corpus.eval):,} held-out tokens"
    )
    return PreparedRun(config, corpus, schedule, policy, resolve_run_dir(config))


def write_start_files(run_dir: Path, config_yaml: str, schedule: TransferSchedule) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    (run_dir / "schedule.json").write_text(json.dumps(schedule.to_json(), indent=2))


def evaluate(eval_step: Any, model: eqx.Module, batches: list[jax.Array]) -> float:
    return float(np.mean([float(eval_step(model, batch)) for batch in batches]))


def train(prepared: PreparedRun, config_yaml: str, console: Console) -> Path:
    """Run training as prepared; return the run directory."""
    config, corpus, schedule, run_dir = prepared.config, prepared.corpus, prepared.schedule, prepared.run_dir
    console.print(schedule_table(schedule))
    write_start_files(run_dir, config_yaml, schedule)
    console.print(f"run directory: {run_dir}")

    tc = config.train
    mesh = make_mesh(1)
    optimizer = make_optimizer(tc)
    settings = LossSettings(prepared.policy, tc.compute_dtype, tc.z_loss_weight)
    train_step = make_train_step(optimizer, settings, learning_rate_schedule(tc), tc.micro_steps)
    eval_step = make_eval_step(settings)
    train_batches = iter(PackedBatches(corpus.train, tc.global_batch_size, tc.seq_len, config.data.seed))
    held_out = PackedBatches(corpus.eval, tc.global_batch_size, tc.seq_len, config.data.seed, shuffle=False)
    tokens_per_step = tc.global_batch_size * tc.seq_len

    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    with jax.set_mesh(mesh):
        state = jax.device_put(
            init_state(build_model(config.model, jax.random.key(tc.seed)), optimizer), replicated(mesh)
        )
        eval_batches = [
            jax.device_put(b, batch_sharded(mesh)) for b in itertools.islice(iter(held_out), tc.eval_batches)
        ]
        metrics.write({"step": 0, "eval_loss": evaluate(eval_step, state.model, eval_batches)})
        progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=console,
        )
        with progress:
            task = progress.add_task("train", total=tc.steps, status="compiling")
            last_time, last_step = time.perf_counter(), 0
            for step in range(1, tc.steps + 1):
                batch = jax.device_put(next(train_batches), batch_sharded(mesh))
                state, step_metrics = train_step(state, batch)
                if step == 1 or step % tc.log_every == 0 or step == tc.steps:
                    record = {k: float(v) for k, v in step_metrics.items()}  # blocks on the step
                    now = time.perf_counter()
                    step_time = (now - last_time) / (step - last_step)
                    last_step = step
                    record |= {"step": step, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time}
                    if step == 1:
                        record["includes_compile"] = True
                    if step % tc.eval_every == 0 or step == tc.steps:
                        record["eval_loss"] = evaluate(eval_step, state.model, eval_batches)
                        record["eval_perplexity"] = float(np.exp(record["eval_loss"]))
                    metrics.write(record)
                    status = f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s"
                    progress.update(task, status=status)
                    last_time = time.perf_counter()  # evaluation and logging are not step time
                progress.advance(task)
    metrics.close()
    return run_dir
