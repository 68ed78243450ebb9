"""A training run from a validated config: every check first, then the run directory (a new one,
or one whose checkpoints it resumes), then the loop. Nothing is written or allocated before the
config, the memory estimate, the data, the offload policy and any checkpoint's model have all
been accepted."""

import contextlib
import dataclasses
import datetime
import itertools
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ferry.data.corpus import Corpus, check_vocab, load_corpus
from ferry.data.pipeline import PackedWindows, local_batches, window_batches
from ferry.data.tokenizer import load_tokenizer
from ferry.hf import check_checkpoint, load_pretrained
from ferry.memory import check_fits
from ferry.models.registry import TINY_MODELS, abstract_model, build_model, count_parameters, size_summary
from ferry.offload import Policy
from ferry.schedule import TransferSchedule, format_bytes, model_schedule, schedule_table
from ferry.sharding import batch_sharded, check_divisible, make_mesh, parameters_per_device, tree_shardings
from ferry.train.checkpoint import CheckpointError, Checkpoints, checkpoint_steps, identity_difference, model_identity
from ferry.train.config import FerryConfig
from ferry.train.flops import training_flops
from ferry.train.loggers import RunLoggers, check_wandb
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.peak import device_peak
from ferry.train.policy_check import check_before_training
from ferry.train.preemption import SigtermStop
from ferry.train.profiling import StepProfiler
from ferry.train.step import LossSettings, TrainState, init_state, make_eval_step, make_train_step


class RunDirectoryError(FileExistsError):
    """The chosen run directory already holds a run that this command may not continue."""


def resolve_run_dir(config: FerryConfig) -> Path:
    """A new run's directory (an existing non-empty one is refused), chosen by process 0 (it alone
    writes there, and the others would otherwise see the files it has just written) and told to
    every process, so all save into one directory and a refusal stops them all."""
    return _from_process_zero(lambda: _new_run_dir(config))


def _new_run_dir(config: FerryConfig) -> Path:
    if config.run.dir is not None:
        path = Path(config.run.dir)
        if path.exists() and any(path.iterdir()):
            raise RunDirectoryError(
                f"run.dir={path} already holds files but no checkpoint to resume; ferry does not overwrite a run. "
                "Pass a new run.dir, or omit it for runs/<timestamp>/"
            )
        return path
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    for suffix in itertools.count():
        path = Path(config.run.root) / (stamp if suffix == 0 else f"{stamp}_{suffix}")
        if not path.exists():
            return path
    raise AssertionError("unreachable")


def _from_process_zero(decide: Callable[[], Path], limit: int = 4096) -> Path:
    """`decide()` on process 0 and its answer, a path or the RunDirectoryError it raised, on every
    process."""
    if jax.process_count() == 1:
        return decide()
    answer = b""
    if is_main_process():
        try:
            answer = b"path:" + str(decide()).encode()
        except RunDirectoryError as error:
            answer = b"error:" + str(error).encode()
    buffer = np.zeros(limit, np.uint8)
    buffer[: len(answer[:limit])] = np.frombuffer(answer[:limit], np.uint8)
    received = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b"\0").decode()
    kind, _, text = received.partition(":")
    if kind == "error":
        raise RunDirectoryError(text)
    return Path(text)


def run_directory(config: FerryConfig, identity: dict[str, Any]) -> tuple[Path, int | None]:
    """The run's directory and the checkpoint step to resume from (None: a new run). A run.dir
    holding checkpoints resumes from the latest when it holds this model's state. Every process
    reads the checkpoints (Orbax synchronises them; none is written before all have started)."""
    steps = [] if config.run.dir is None else checkpoint_steps(Path(config.run.dir) / "checkpoints")
    if not steps:
        return resolve_run_dir(config), None
    if not config.run.resume:
        raise RunDirectoryError(
            f"run.dir={config.run.dir} holds checkpoints up to step {steps[-1]} and run.resume=false "
            "refuses to continue it; drop run.resume=false to resume, or pass a new run.dir"
        )
    checkpoints = Checkpoints(Path(config.run.dir) / "checkpoints", config.checkpoint)
    try:
        difference = identity_difference(checkpoints.read_identity(steps[-1]), identity)
    finally:
        checkpoints.close()
    if difference is not None:
        raise CheckpointError(
            f"run.dir={config.run.dir} holds checkpoints of another model or shape: {difference}. "
            "Resume it with its own model config, or pass a new run.dir"
        )
    return Path(config.run.dir), steps[-1]


def check_mesh_shape(config: FerryConfig) -> None:
    """The mesh's axes divide the model's dimensions and the batch (no devices needed)."""
    axes = config.mesh.shape
    for what, size, axis in config.model.mesh_dims():
        check_divisible(what, size, axis, axes[axis], f"choose a mesh.{axis} that divides {size}")
    config.train.check_batch(config.mesh.data_parallel, config.mesh.describe())


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A run whose config, memory estimate, mesh, data, offload policy and run directory have all
    been accepted; `resume_step` is the checkpoint it continues from (None: a new run)."""

    config: FerryConfig
    corpus: Corpus | None  # None for a run that is already complete
    schedule: TransferSchedule
    policy: Policy
    run_dir: Path
    mesh: Mesh
    resume_step: int | None
    identity: dict[str, Any]
    layout: "StateLayout"  # the train state's shapes and shardings, traced once


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
    check_wandb(config.log)
    check_before_training(config, policy, console)  # train.check_policy: the policy's gradients on this machine
    tokenizer = load_tokenizer(config.data.tokenizer, config.data.eos_token)
    if config.data.source != "synthetic":
        check_vocab(tokenizer, config.model.vocab_size, config.model_name)
    layout = state_layout(config.model, make_optimizer(config.train), mesh, config.train.seed)
    identity = model_identity(config.model_name, config.model, layout.shapes)
    run_dir, resume_step = run_directory(config, identity)
    if resume_step is not None and resume_step >= config.train.steps:  # `train` says so; no data needed
        return PreparedRun(config, None, schedule, policy, run_dir, mesh, resume_step, identity, layout)
    corpus = load_corpus(config.data, tokenizer, config.model.vocab_size, console, config.model_name)
    for split, tokens in (("train", corpus.train), ("held-out", corpus.eval)):
        window_batches(PackedWindows(tokens, config.train.seq_len), config.train.global_batch_size, 0, where=split)
    console.print(
        f"model {config.model_name}: {num_parameters:,} parameters; "
        f"corpus: {corpus.description}, {len(corpus.train):,} train / {len(corpus.eval):,} held-out tokens",
        highlight=False,
    )
    console.print(
        f"mesh {config.mesh.describe()} over {jax.device_count()} {jax.devices()[0].platform} devices "
        f"in {jax.process_count()} process(es); micro steps per step: {config.train.micro_steps(data_parallel)}",
        highlight=False,
    )
    return PreparedRun(config, corpus, schedule, policy, run_dir, mesh, resume_step, identity, layout)


def write_start_files(run_dir: Path, config_yaml: str, schedule: TransferSchedule, resume_step: int | None) -> None:
    """config.yaml and schedule.json; a resumed run keeps the first config.yaml and writes its own
    beside it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    name = "config.yaml" if resume_step is None else f"config.resumed_at_{resume_step}.yaml"
    (run_dir / name).write_text(config_yaml)
    (run_dir / "schedule.json").write_text(json.dumps(schedule.to_json(), indent=2))


def evaluate(eval_step: Any, model: eqx.Module, batches: list[jax.Array]) -> float:
    return float(np.mean([float(eval_step(model, batch)) for batch in batches]))


def device_batch(rows: Callable[[slice], np.ndarray], shape: tuple[int, int], mesh: Mesh) -> jax.Array:
    """The global batch of `shape`, rows split over the batch axes; `rows(slice)` builds a block
    of rows, and each process builds only the blocks its own devices hold."""
    return jax.make_array_from_callback(shape, batch_sharded(mesh), lambda index: rows(index[0])[:, index[1]])


def process_rows(mesh: Mesh, shape: tuple[int, int]) -> np.ndarray:
    """The rows of a global batch that this process's devices hold, sorted."""
    indices = batch_sharded(mesh).addressable_devices_indices_map(shape).values()
    return np.unique(np.concatenate([np.arange(shape[0])[index[0]] for index in indices]))


def local_batch(local: np.ndarray, local_rows: np.ndarray, shape: tuple[int, int], mesh: Mesh) -> jax.Array:
    """The global batch from this process's rows `local` (of global rows `local_rows`)."""
    return device_batch(lambda rows: local[np.searchsorted(local_rows, np.arange(shape[0])[rows])], shape, mesh)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a train state is built and laid out on a mesh, known from shapes alone."""

    make: Callable[[], TrainState]  # builds the whole state
    shapes: Any  # its arrays as ShapeDtypeStructs (None elsewhere)
    static: Any  # everything else
    sharding: Any  # a NamedSharding per array, by the parameter rules

    def abstract(self) -> Any:
        """The arrays as ShapeDtypeStructs in their shardings: what a checkpoint restores into."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), self.shapes, self.sharding
        )


def state_layout(model_config: Any, optimizer: Any, mesh: Mesh, seed: int = 0) -> StateLayout:
    def make() -> TrainState:
        return init_state(build_model(model_config, jax.random.key(seed)), optimizer)

    shapes, static = eqx.partition(eqx.filter_eval_shape(make), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return StateLayout(make, shapes, static, tree_shardings(shapes, mesh))


def initial_state(
    config: FerryConfig, optimizer: Any, mesh: Mesh, layout: StateLayout | None = None
) -> tuple[TrainState, Any]:
    """The train state built on the devices in its sharding (no host copy of the whole model),
    and that sharding; the random init is the same on every mesh. With `init.from_hf` the
    parameters are read from the checkpoint straight into their sharding."""
    layout = layout or state_layout(config.model, optimizer, mesh, config.train.seed)
    if config.init.from_hf is None:
        arrays = jax.jit(lambda: eqx.partition(layout.make(), eqx.is_array)[0], out_shardings=layout.sharding)()
    else:
        params, static = eqx.partition(load_pretrained(config.init.from_hf, config.model, mesh), eqx.is_array)
        wrap = lambda p: eqx.partition(init_state(eqx.combine(p, static), optimizer), eqx.is_array)[0]
        arrays = jax.jit(wrap, out_shardings=layout.sharding, donate_argnums=0)(params)
    return eqx.combine(arrays, layout.static), layout.sharding


class NonFiniteLossError(RuntimeError):
    """Training stopped at a step whose loss or gradient was not finite."""


def describe_memory(compiled: Any) -> str:
    """The compiled step's memory analysis, per device, in one line."""
    analysis = compiled.compiled.memory_analysis()
    if analysis is None:
        return "compiled step: no memory analysis on this backend"
    fields = {
        "arguments": "argument_size_in_bytes",
        "outputs": "output_size_in_bytes",
        "aliased": "alias_size_in_bytes",
        "temporaries": "temp_size_in_bytes",
        "code": "generated_code_size_in_bytes",
        "host temporaries": "host_temp_size_in_bytes",
    }
    parts = [f"{name} {format_bytes(getattr(analysis, key))}" for name, key in fields.items() if hasattr(analysis, key)]
    return "compiled step, per device: " + ", ".join(parts)


def device_memory_peak() -> int | None:
    """Peak bytes in use on this process's first device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])


def train(prepared: PreparedRun, config_yaml: str, console: Console) -> Path:
    """Run training as prepared (from its checkpoint when resuming); return the run directory.
    SIGTERM saves a checkpoint and returns; a non-finite loss (with train.on_nonfinite=stop)
    checkpoints the last good state and raises NonFiniteLossError."""
    config, corpus, schedule, run_dir = prepared.config, prepared.corpus, prepared.schedule, prepared.run_dir
    tc, mesh, start = config.train, prepared.mesh, prepared.resume_step or 0
    if start >= tc.steps:
        console.print(f"run {run_dir} is complete: its latest checkpoint is step {start} of train.steps={tc.steps}")
        return run_dir
    optimizer = make_optimizer(tc)
    settings = LossSettings(prepared.policy, tc.compute_dtype, tc.z_loss_weight)
    eval_step = make_eval_step(settings)
    batch_shape = (tc.global_batch_size, tc.seq_len + 1)
    tokens_per_step = tc.global_batch_size * tc.seq_len
    local_rows = process_rows(mesh, batch_shape)
    windows = PackedWindows(corpus.train, tc.seq_len)
    batches = local_batches(windows, tc.global_batch_size, config.data.seed, local_rows, config.data.prefetch)
    held_out = local_batches(
        PackedWindows(corpus.eval, tc.seq_len), tc.global_batch_size, 0, local_rows, 1, shuffle=False
    )
    flops = training_flops(config.model, tc.global_batch_size, tc.seq_len).per_device(jax.device_count())
    peak, peak_source = device_peak(jax.devices()[0], tc.compute_dtype)

    # closing the iterators stops their prefetch threads, also when the run fails
    with jax.set_mesh(mesh), SigtermStop() as sigterm, contextlib.closing(batches), contextlib.closing(held_out):
        layout = prepared.layout
        checkpoints = Checkpoints(run_dir / "checkpoints", config.checkpoint)
        if prepared.resume_step is not None:  # before anything is written: a bad checkpoint loses nothing
            arrays, data_state = checkpoints.restore(prepared.resume_step, layout.abstract())
            state = eqx.combine(arrays, layout.static)
            batches.set_state(data_state)
        else:
            state, _ = initial_state(config, optimizer, mesh, layout)
        console.print(schedule_table(schedule))
        if is_main_process():
            write_start_files(run_dir, config_yaml, schedule, prepared.resume_step)
            verb = "resuming from step " + str(start) + " in" if prepared.resume_step is not None else "run directory:"
            console.print(f"{verb} {run_dir}", highlight=False)
        console.print(
            f"model FLOPs per step and device {flops / 1e12:.4g} TFLOP; peak "
            + (f"{peak / 1e12:.4g} TFLOP/s ({peak_source})" if peak else peak_source),
            highlight=False,
        )
        loggers = RunLoggers(run_dir, config.log, prepared.resume_step, is_main_process(), {"config": config_yaml})
        make_batch = lambda: local_batch(next(batches), local_rows, batch_shape, mesh)  # noqa: E731
        train_step = make_train_step(
            optimizer,
            settings,
            learning_rate_schedule(tc),
            tc.micro_steps(config.mesh.data_parallel),
            layout.sharding,
            tc.on_nonfinite,
        )
        data_states = {start: batches.get_state()}  # the position before the first batch is taken
        first_batch = make_batch()
        with warnings.catch_warnings():  # the batch's buffer cannot be reused for an output; that is fine
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            compiled = train_step.lower(state, first_batch).compile()
        console.print(describe_memory(compiled), highlight=False)
        eval_batches = [local_batch(next(held_out), local_rows, batch_shape, mesh) for _ in range(tc.eval_batches)]
        if eval_batches and prepared.resume_step is None:
            loggers.write({"step": 0, "eval_loss": evaluate(eval_step, state.model, eval_batches)})

        profiler = StepProfiler(config.profile, run_dir / "profile")
        progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=console,
            disable=not is_main_process(),
        )

        def save(step: int) -> None:
            checkpoints.save(step, eqx.filter(state, eqx.is_array), data_states[step], prepared.identity)

        unchecked: tuple[int, dict[str, jax.Array]] | None = None  # a step whose finiteness is not read yet

        def first_nonfinite(pending: tuple[int, dict[str, jax.Array]] | None) -> int | None:
            return pending[0] if pending is not None and bool(pending[1]["nonfinite"]) else None

        bad_step = None
        with progress:
            task = progress.add_task("train", total=tc.steps, completed=start, status="")
            last_time, last_step, overhead = time.perf_counter(), start, 0.0  # overhead: saving, between logs
            for step in range(start + 1, tc.steps + 1):
                batch = first_batch if step == start + 1 else make_batch()
                data_states[step] = batches.get_state()
                data_states.pop(step - 3, None)
                profiler.before_step(step)
                state, step_metrics = compiled(state, batch)
                profiler.after_step(step, step_metrics)
                if tc.on_nonfinite == "stop":  # read a step late, so one step is always in flight
                    bad_step = first_nonfinite(unchecked)
                    unchecked = (step, step_metrics)
                log_now = step == start + 1 or step % tc.log_every == 0 or step == tc.steps
                eval_now = bool(eval_batches) and (step % tc.eval_every == 0 or step == tc.steps)
                save_now = checkpoints.due(step) or step == tc.steps
                stop_now = sigterm.requested(step)
                if bad_step is None and tc.on_nonfinite == "stop" and (log_now or eval_now or save_now or stop_now):
                    bad_step, unchecked = first_nonfinite(unchecked), None
                if bad_step is not None:
                    break
                if log_now or eval_now:
                    record = {k: float(v) for k, v in step_metrics.items() if k != "nonfinite"}  # blocks on the step
                    step_time = (time.perf_counter() - last_time - overhead) / (step - last_step)
                    record |= {
                        "step": step,
                        "step_time_s": step_time,
                        "tokens_per_s": tokens_per_step / step_time,
                        "tflops_per_s_per_device": flops / step_time / 1e12,
                        "pinned_host_bytes": schedule.pinned_host_bytes,
                    }
                    if peak:
                        record["mfu"] = flops / step_time / peak
                    memory_peak = device_memory_peak()
                    if memory_peak is not None:
                        record["device_memory_peak_bytes"] = memory_peak
                    if eval_now:
                        record["eval_loss"] = evaluate(eval_step, state.model, eval_batches)
                        record["eval_perplexity"] = float(np.exp(record["eval_loss"]))
                    loggers.write(record)
                    progress.update(task, status=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s")
                    last_time, last_step, overhead = time.perf_counter(), step, 0.0  # evaluating is not step time
                if save_now or stop_now:
                    jax.block_until_ready(state)  # the step's own time counts; the copy to host does not
                    saving = time.perf_counter()
                    save(step)
                    overhead += time.perf_counter() - saving
                progress.update(task, completed=step)
                if stop_now:
                    console.print(f"SIGTERM: stopped after step {step}; checkpoint saved in {checkpoints.directory}")
                    break
            if bad_step is None and unchecked is not None:
                bad_step = first_nonfinite(unchecked)
        profiler.stop(state)
        if bad_step is not None:
            # Nothing has been applied since step bad_step - 1 but the count of non-finite steps,
            # which was 0 then (any earlier one would have stopped the run): that state is saved.
            state = dataclasses.replace(state, nonfinite_steps=jnp.zeros_like(state.nonfinite_steps))
            save(bad_step - 1)
        checkpoints.close()
        loggers.close()
    if bad_step is not None:
        where = f"the state of step {bad_step - 1} is checkpointed in {checkpoints.directory}"
        raise NonFiniteLossError(
            f"the loss or gradient is not finite at step {bad_step}; training stopped and {where} "
            f"(nothing of step {bad_step} was applied). Lower train.learning_rate, or set "
            "train.on_nonfinite=skip to skip such steps"
        )
    return run_dir


def is_main_process() -> bool:
    """Process 0 writes the run directory, the metrics and the console output."""
    return jax.process_index() == 0
