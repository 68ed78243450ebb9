"""A training run from a validated config: every check first, then the run directory, then the
loop. Nothing is written or allocated before the config, the memory estimate, the data and the
offload policy have all been accepted."""

import dataclasses
import datetime
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ferry.data.batches import PackedBatches
from ferry.data.stdlib_corpus import Corpus, load_stdlib_corpus
from ferry.data.tokenizer import ByteTokenizer
from ferry.hf import check_checkpoint, load_pretrained
from ferry.memory import check_fits
from ferry.metrics import MetricsWriter
from ferry.models.registry import TINY_MODELS, abstract_model, build_model, count_parameters, size_summary
from ferry.offload import Policy
from ferry.schedule import TransferSchedule, model_schedule, schedule_table
from ferry.sharding import batch_sharded, check_divisible, make_mesh, parameters_per_device, tree_shardings
from ferry.train.config import FerryConfig
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.step import LossSettings, TrainState, init_state, make_eval_step, make_train_step


class RunDirectoryError(FileExistsError):
    """The chosen run directory already holds a run."""


def resolve_run_dir(config: FerryConfig) -> Path:
    """The new run's directory; only process 0 checks it (it alone writes there, and the others
    would otherwise see the files it has just written)."""
    if not is_main_process():
        return Path(config.run.dir or config.run.root)
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


def check_mesh_shape(config: FerryConfig) -> None:
    """The mesh's axes divide the model's dimensions and the batch (no devices needed)."""
    axes = config.mesh.shape
    for what, size, axis in config.model.mesh_dims():
        check_divisible(what, size, axis, axes[axis], f"choose a mesh.{axis} that divides {size}")
    config.train.check_batch(config.mesh.data_parallel, config.mesh.describe())


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A run whose config, memory estimate, mesh, data and offload policy have all been accepted."""

    config: FerryConfig
    corpus: Corpus
    schedule: TransferSchedule
    policy: Policy
    run_dir: Path
    mesh: Mesh


def prepare(config: FerryConfig, console: Console) -> PreparedRun:
    """Every check that can refuse the run, cheapest first; allocates no model, writes nothing."""
    model = abstract_model(config.model)  # traced once, shapes only
    num_parameters = count_parameters(model)
    if config.init.from_hf is not None:  # config.json and the tensors' headers: nothing is read yet
        check_checkpoint(config.init.from_hf, config.model)
    check_mesh_shape(config)
    mesh = make_mesh(config.mesh)  # the devices
    tiny = TINY_MODELS[type(config.model)]
    check_fits(
        config.model_name,
        parameters_per_device(model, mesh),  # also refuses any parameter dimension its axes do not divide
        size_summary(config.model, num_parameters),
        f"Use model={tiny} on this machine, or shard it (mesh.fsdp) over devices whose memory holds it.",
    )
    policy = config.offload.policy(model.tagged_names())
    dtype = jnp.dtype(config.train.compute_dtype)
    data_parallel = config.mesh.data_parallel
    schedule = model_schedule(
        model,
        policy,
        config.train.rows_per_micro_step(data_parallel) // data_parallel,
        config.train.seq_len,
        dtype,
        config.offload.name,
        micro_steps=config.train.micro_steps(data_parallel),
        mesh=mesh,
    )
    corpus = _check_data(config, ByteTokenizer())
    console.print(
        f"model {config.model_name}: {num_parameters:,} parameters; "
        f"corpus: {corpus.num_documents} stdlib files, "
        f"{len(corpus.train):,} train / {len(corpus.eval):,} held-out tokens"
    )
    console.print(
        f"mesh {config.mesh.describe()} over {jax.device_count()} {jax.devices()[0].platform} devices "
        f"in {jax.process_count()} process(es); micro steps per step: {config.train.micro_steps(data_parallel)}",
        highlight=False,
    )
    return PreparedRun(config, corpus, schedule, policy, resolve_run_dir(config), mesh)


def write_start_files(run_dir: Path, config_yaml: str, schedule: TransferSchedule) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    (run_dir / "schedule.json").write_text(json.dumps(schedule.to_json(), indent=2))


def evaluate(eval_step: Any, model: eqx.Module, batches: list[jax.Array]) -> float:
    return float(np.mean([float(eval_step(model, batch)) for batch in batches]))


def device_batch(rows: Callable[[slice], np.ndarray], shape: tuple[int, int], mesh: Mesh) -> jax.Array:
    """The global batch of `shape`, rows split over the batch axes; `rows(slice)` builds a block
    of rows, and each process builds only the blocks its own devices hold."""
    return jax.make_array_from_callback(shape, batch_sharded(mesh), lambda index: rows(index[0])[:, index[1]])


def window_rows(source: PackedBatches, windows: np.ndarray) -> Callable[[slice], np.ndarray]:
    return lambda rows: source.window_batch(windows[rows])


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a train state is built and laid out on a mesh, known from shapes alone."""

    make: Callable[[], TrainState]  # builds the whole state
    shapes: Any  # its arrays as ShapeDtypeStructs (None elsewhere)
    static: Any  # everything else
    sharding: Any  # a NamedSharding per array, by the parameter rules


def state_layout(model_config: Any, optimizer: Any, mesh: Mesh, seed: int = 0) -> StateLayout:
    def make() -> TrainState:
        return init_state(build_model(model_config, jax.random.key(seed)), optimizer)

    shapes, static = eqx.partition(eqx.filter_eval_shape(make), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return StateLayout(make, shapes, static, tree_shardings(shapes, mesh))


def initial_state(config: FerryConfig, optimizer: Any, mesh: Mesh) -> tuple[TrainState, Any]:
    """The train state built on the devices in its sharding (no host copy of the whole model),
    and that sharding; the random init is the same on every mesh. With `init.from_hf` the
    parameters are read from the checkpoint straight into their sharding."""
    layout = state_layout(config.model, optimizer, mesh, config.train.seed)
    if config.init.from_hf is None:
        arrays = jax.jit(lambda: eqx.partition(layout.make(), eqx.is_array)[0], out_shardings=layout.sharding)()
    else:
        params, static = eqx.partition(load_pretrained(config.init.from_hf, config.model, mesh), eqx.is_array)
        wrap = lambda p: eqx.partition(init_state(eqx.combine(p, static), optimizer), eqx.is_array)[0]
        arrays = jax.jit(wrap, out_shardings=layout.sharding, donate_argnums=0)(params)
    return eqx.combine(arrays, layout.static), layout.sharding


def train(prepared: PreparedRun, config_yaml: str, console: Console) -> Path:
    """Run training as prepared; return the run directory."""
    config, corpus, schedule, run_dir = prepared.config, prepared.corpus, prepared.schedule, prepared.run_dir
    console.print(schedule_table(schedule))
    if is_main_process():
        write_start_files(run_dir, config_yaml, schedule)
        console.print(f"run directory: {run_dir}")

    tc = config.train
    mesh = prepared.mesh
    optimizer = make_optimizer(tc)
    settings = LossSettings(prepared.policy, tc.compute_dtype, tc.z_loss_weight)
    eval_step = make_eval_step(settings)
    train_source = PackedBatches(corpus.train, tc.global_batch_size, tc.seq_len, config.data.seed)
    train_windows = train_source.window_ids()
    held_out = PackedBatches(corpus.eval, tc.global_batch_size, tc.seq_len, config.data.seed, shuffle=False)
    tokens_per_step = tc.global_batch_size * tc.seq_len
    batch_shape = (tc.global_batch_size, tc.seq_len + 1)

    metrics = MetricsWriter(run_dir / "metrics.jsonl") if is_main_process() else None
    with jax.set_mesh(mesh):
        state, state_sharding = initial_state(config, optimizer, mesh)
        micro_steps = tc.micro_steps(config.mesh.data_parallel)
        train_step = make_train_step(optimizer, settings, learning_rate_schedule(tc), micro_steps, state_sharding)
        eval_batches = [
            device_batch(window_rows(held_out, w), batch_shape, mesh)
            for w in itertools.islice(held_out.window_ids(), tc.eval_batches)
        ]
        if eval_batches:
            write_metrics(metrics, {"step": 0, "eval_loss": evaluate(eval_step, state.model, eval_batches)})
        progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=console,
            disable=not is_main_process(),
        )
        with progress:
            task = progress.add_task("train", total=tc.steps, status="compiling")
            last_time, last_step = time.perf_counter(), 0
            for step in range(1, tc.steps + 1):
                batch = device_batch(window_rows(train_source, next(train_windows)), batch_shape, mesh)
                state, step_metrics = train_step(state, batch)
                if step == 1 or step % tc.log_every == 0 or step == tc.steps:
                    record = {k: float(v) for k, v in step_metrics.items()}  # blocks on the step
                    now = time.perf_counter()
                    step_time = (now - last_time) / (step - last_step)
                    last_step = step
                    record |= {"step": step, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time}
                    if step == 1:
                        record["includes_compile"] = True
                    if eval_batches and (step % tc.eval_every == 0 or step == tc.steps):
                        record["eval_loss"] = evaluate(eval_step, state.model, eval_batches)
                        record["eval_perplexity"] = float(np.exp(record["eval_loss"]))
                    write_metrics(metrics, record)
                    status = f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s"
                    progress.update(task, status=status)
                    last_time = time.perf_counter()  # evaluation and logging are not step time
                progress.advance(task)
    if metrics is not None:
        metrics.close()
    return run_dir


def is_main_process() -> bool:
    """Process 0 writes the run directory, the metrics and (later) checkpoints."""
    return jax.process_index() == 0


def write_metrics(writer: MetricsWriter | None, record: dict[str, Any]) -> None:
    if writer is not None:
        writer.write(record)
