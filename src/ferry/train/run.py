"""A training run from a validated config: every check first, then the run directory (a new one,
or one whose checkpoints it resumes, locked for this run), then the compiled step, whose memory is
checked against the machine before any state is allocated, then the loop. Nothing is written or
allocated before the config, the memory estimate, the data, the offload policy, any checkpoint's
model and the compiled step's memory have all been accepted."""

import contextlib
import dataclasses
import datetime
import itertools
import json
import time
import warnings
from collections.abc import Callable, Iterator
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

from ferry.data.corpus import Corpus, check_vocab, load_corpus, open_prepared
from ferry.data.pipeline import PackedWindows, local_batches, window_batches
from ferry.data.tokenizer import load_tokenizer
from ferry.errors import DataError, FerryError, JsonFileError
from ferry.hf import CheckpointError as HFCheckpointError
from ferry.hf import check_checkpoint, load_pretrained
from ferry.memory import CompiledMemory, check_fits, check_step_fits
from ferry.models.registry import TINY_MODELS, abstract_model, build_model, count_parameters, size_summary
from ferry.offload import Policy
from ferry.schedule import TransferSchedule, format_bytes, model_schedule, schedule_table
from ferry.sharding import batch_sharded, check_divisible, make_mesh, parameters_per_device, tree_shardings
from ferry.train.checkpoint import CheckpointError, Checkpoints, checkpoint_steps, identity_difference, model_identity
from ferry.train.config import FerryConfig
from ferry.train.flops import training_flops
from ferry.train.lock import LOCK_FILE, RunDirectoryError, RunLock, acquire
from ferry.train.loggers import RunLoggers, check_wandb
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.peak import device_peak
from ferry.train.policy_check import check_before_training
from ferry.train.preemption import SigtermStop
from ferry.train.profiling import StepProfiler
from ferry.train.step import LossSettings, TrainState, init_state, make_eval_step, train_step_body


def resolve_run_dir(config: FerryConfig) -> Path:
    """A new directory for what `mode=plan` writes (an existing non-empty one is refused), chosen
    by process 0 and told to every process."""
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
            return path  # two launches in one second: the second's lock on it is refused
    raise AssertionError("unreachable")


def _from_process_zero(decide: Callable[[], Path], limit: int = 4096) -> Path:
    """`decide()` on process 0 and its answer, a path or the refusal it raised (as a
    RunDirectoryError), on every process."""
    if jax.process_count() == 1:
        return decide()
    answer = b""
    if is_main_process():
        try:
            answer = b"path:" + str(decide()).encode()
        except FerryError as error:
            answer = b"error:" + str(error).encode()
    buffer = np.zeros(limit, np.uint8)
    buffer[: len(answer[:limit])] = np.frombuffer(answer[:limit], np.uint8)
    received = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b"\0").decode()
    kind, _, text = received.partition(":")
    if kind == "error":
        raise RunDirectoryError(text)
    return Path(text)


@dataclasses.dataclass
class RunDirectory:
    """Where a run writes, what it continues, and the lock process 0 holds on it (None on the
    other processes). `restart`: an earlier attempt there saved no checkpoint; its logs are
    replaced."""

    path: Path
    resume_step: int | None
    lock: RunLock | None
    restart: bool = False

    def mark_started(self) -> None:
        if self.lock is not None:
            self.lock.started = True

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def run_directory(config: FerryConfig, identity: dict[str, Any]) -> RunDirectory:
    """The run's directory, locked by process 0, and the checkpoint step to resume from (None: a
    new run). A run.dir holding checkpoints resumes from the latest when it holds this model's
    state; one holding only an earlier attempt that saved none starts over; any other non-empty
    directory is refused untouched. Every process reads the checkpoints (Orbax synchronises them;
    none is written before all have started)."""
    held: list[RunLock] = []

    def claim() -> Path:
        path = _claimed_dir(config)
        held.append(acquire(path))
        return path

    path = _from_process_zero(claim)
    directory = RunDirectory(path, None, held[0] if held else None)
    try:
        steps = checkpoint_steps(path / "checkpoints")
        if steps:
            directory.resume_step = _resumable(config, path, steps, identity)
        else:
            directory.restart = any(p.name != LOCK_FILE for p in path.iterdir()) if path.is_dir() else False
    except BaseException:
        directory.release()
        raise
    return directory


def _claimed_dir(config: FerryConfig) -> Path:
    """run.dir, when it is new, empty, or a ferry run's (checked before anything is touched), or a
    new runs/<timestamp>/."""
    if config.run.dir is None:
        return _new_run_dir(config)
    path = Path(config.run.dir)
    if path.exists() and not path.is_dir():
        raise RunDirectoryError(f"run.dir={path} is a file, not a directory; pass a directory for the run")
    if path.is_dir():
        try:
            entries = [p.name for p in path.iterdir()]
        except PermissionError as error:
            raise RunDirectoryError(
                f"run.dir={path} cannot be read (permission denied); pass another run.dir"
            ) from error
        ours = LOCK_FILE in entries or checkpoint_steps(path / "checkpoints")
        if entries and not ours:
            raise RunDirectoryError(
                f"run.dir={path} already holds files but no checkpoint to resume, and no ferry run; ferry does not "
                "overwrite them. "
                "Pass a new run.dir, or omit it for runs/<timestamp>/"
            )
    return path


def _resumable(config: FerryConfig, path: Path, steps: list[int], identity: dict[str, Any]) -> int:
    """The latest step, when this command may continue the run that saved it."""
    if not config.run.resume:
        raise RunDirectoryError(
            f"run.dir={path} holds checkpoints up to step {steps[-1]} and run.resume=false "
            "refuses to continue it; drop run.resume=false to resume, or pass a new run.dir"
        )
    checkpoints = Checkpoints(path / "checkpoints", config.checkpoint)
    try:
        difference = identity_difference(checkpoints.read_identity(steps[-1]), identity)
    finally:
        checkpoints.close()
    if difference is not None:
        raise CheckpointError(
            f"run.dir={path} holds checkpoints of another model or shape: {difference}. "
            "Resume it with its own model config, or pass a new run.dir"
        )
    return steps[-1]


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
    directory: RunDirectory  # locked by process 0 until `release`
    mesh: Mesh
    identity: dict[str, Any]
    layout: "StateLayout"  # the train state's shapes and shardings, traced once

    @property
    def run_dir(self) -> Path:
        return self.directory.path

    @property
    def resume_step(self) -> int | None:
        return self.directory.resume_step

    def release(self) -> None:
        """Give up the run directory's lock (idempotent; `train` does it when it returns)."""
        self.directory.release()


def prepare(config: FerryConfig, console: Console) -> PreparedRun:
    """Every check that can refuse the run, cheapest first; allocates no model, writes nothing."""
    model = abstract_model(config.model)  # traced once, shapes only
    num_parameters = count_parameters(model)
    if config.init.from_hf is not None:  # config.json and the tensors' headers: nothing is read yet
        try:
            check_checkpoint(config.init.from_hf, config.model)
        except (HFCheckpointError, JsonFileError) as error:
            raise HFCheckpointError(f"init.from_hf={config.init.from_hf}: {error}") from error
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
    with data_refusals():
        tokenizer = load_tokenizer(config.data.tokenizer, config.data.eos_token)
        if config.data.prepared is not None:  # its manifest and shards, before anything compiles
            open_prepared(
                Path(config.data.prepared).expanduser(),
                tokenizer,
                config.data.tokenizer,
                config.model.vocab_size,
                config.model_name,
            )
        elif config.data.source != "synthetic":
            check_vocab(tokenizer, config.model.vocab_size, config.model_name)
    check_before_training(config, policy, console)  # train.check_policy: the policy's gradients on this machine
    layout = state_layout(config.model, make_optimizer(config.train), mesh, config.train.seed)
    identity = model_identity(config.model_name, config.model, layout.shapes)
    directory = run_directory(config, identity)  # locked from here: release on any refusal
    if directory.lock is not None and directory.lock.stale_holder is not None:
        console.print(
            f"run.dir={directory.path}: took over the lock of {directory.lock.stale_holder}, "
            "which is no longer running",
            highlight=False,
        )
    try:
        if directory.resume_step is not None and directory.resume_step >= config.train.steps:
            return PreparedRun(config, None, schedule, policy, directory, mesh, identity, layout)  # `train` says so
        with data_refusals():
            corpus = load_corpus(config.data, tokenizer, config.model.vocab_size, console, config.model_name)
            for split, tokens in (("train", corpus.train), ("held-out", corpus.eval)):
                window_batches(
                    PackedWindows(tokens, config.train.seq_len), config.train.global_batch_size, 0, where=split
                )
    except BaseException:
        directory.release()
        raise
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
    return PreparedRun(config, corpus, schedule, policy, directory, mesh, identity, layout)


@contextlib.contextmanager
def data_refusals() -> Iterator[None]:
    """The data stage's `ValueError`s and missing files are refusals of the data the run was
    pointed at (`ferry.data` raises them with the file and the fix in the message)."""
    try:
        yield
    except FerryError:
        raise
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as error:
        raise DataError(str(error)) from error


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


class NonFiniteLossError(FerryError, RuntimeError):
    """Training stopped at a step whose loss or gradient was not finite."""


def compile_step(body: Callable, layout: "StateLayout", batch_spec: jax.ShapeDtypeStruct) -> tuple[Any, Callable]:
    """The train step compiled from the state's shapes alone (so its memory can be checked
    before the state is allocated), and a function running it on a TrainState. The state's
    arrays and the batch are donated: parameters and moments are updated in place."""

    def step(arrays: Any, batch: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        new_state, metrics = body(eqx.combine(arrays, layout.static), batch)
        return eqx.filter(new_state, eqx.is_array), metrics

    with warnings.catch_warnings():  # the batch's buffer cannot be reused for an output; that is fine
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(layout.abstract(), batch_spec).compile()

    def run(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        arrays, metrics = compiled(eqx.filter(state, eqx.is_array), batch)
        return eqx.combine(arrays, layout.static), metrics

    return compiled, run


def step_fit_advice(config: FerryConfig) -> str:
    """The levers that shrink a step's memory, in this run's terms."""
    micro = config.train.micro_batch_size
    per_device = config.train.rows_per_micro_step(config.mesh.data_parallel) // config.mesh.data_parallel
    smaller = max(1, (micro or per_device) // 2)
    return (
        f"Shrink the step: offload=full_remat or an offloading preset (now offload={config.offload.name}), "
        f"train.micro_batch_size={smaller} (gradient accumulation), a shorter train.seq_len (now "
        f"{config.train.seq_len}), or compare presets for your hardware with mode=plan target=<gpu or tpu>"
    )


def describe_memory(memory: CompiledMemory | None) -> str:
    """The compiled step's memory analysis, per device, in one line."""
    if memory is None:
        return "compiled step: no memory analysis on this backend"
    return "compiled step, per device: " + memory.describe()


def host_bytes_line(schedule: TransferSchedule, memory: CompiledMemory | None) -> str:
    """The schedule's pinned host bytes beside the compiled program's, saying what the latter
    means on this backend."""
    planned = f"pinned host per device: planned {format_bytes(schedule.pinned_host_bytes)} (the schedule)"
    if memory is None:
        return planned + "; compiled: no memory analysis on this backend"
    compiled = f"compiled {format_bytes(memory.host_temporaries)} (the compiled step's host temporaries)"
    if jax.devices()[0].platform == "cpu":
        compiled += (
            "; the CPU backend lowers an offload as a copy within its one memory, so this is what its memory "
            "analysis reports, not a measured pinned host pool"
        )
    return f"{planned}, {compiled}"


def device_memory_peak() -> int | None:
    """Peak bytes in use on this process's first device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])


def train(prepared: PreparedRun, config_yaml: str, console: Console) -> Path:
    """Run training as prepared (from its checkpoint when resuming); return the run directory.
    SIGTERM saves a checkpoint and returns; a non-finite loss (with train.on_nonfinite=stop)
    checkpoints the last good state and raises NonFiniteLossError. The run directory's lock is
    released however it ends."""
    try:
        return _train(prepared, config_yaml, console)
    finally:
        prepared.release()


def _train(prepared: PreparedRun, config_yaml: str, console: Console) -> Path:
    config, corpus, schedule, run_dir = prepared.config, prepared.corpus, prepared.schedule, prepared.run_dir
    tc, mesh, start = config.train, prepared.mesh, prepared.resume_step or 0
    if start >= tc.steps:
        console.print(f"run {run_dir} is complete: its latest checkpoint is step {start} of train.steps={tc.steps}")
        return run_dir
    optimizer = make_optimizer(tc)
    documents = corpus.document_mask(config.data)  # data.document_mask: attention stays in each document
    settings = LossSettings(prepared.policy, tc.compute_dtype, tc.z_loss_weight, documents=documents)
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
        body = train_step_body(
            optimizer,
            settings,
            learning_rate_schedule(tc),
            tc.micro_steps(config.mesh.data_parallel),
            layout.sharding,
            tc.on_nonfinite,
        )
        batch_spec = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharded(mesh))
        compiled, train_step = compile_step(body, layout, batch_spec)  # before the state exists
        memory = CompiledMemory.of(compiled)
        if memory is not None:  # refused before anything is allocated or written
            check_step_fits(memory, step_fit_advice(config))
        prepared.directory.mark_started()  # what is written from here marks the directory as this run's
        checkpoints = Checkpoints(run_dir / "checkpoints", config.checkpoint)
        if prepared.resume_step is not None:  # before anything is written: a bad checkpoint loses nothing
            arrays, data_state = checkpoints.restore(prepared.resume_step, layout.abstract())
            state = eqx.combine(arrays, layout.static)
            batches.set_state(data_state)
        else:
            state, _ = initial_state(config, optimizer, mesh, layout)
        console.print(schedule_table(schedule))
        console.print(host_bytes_line(schedule, memory), highlight=False)
        if is_main_process():
            write_start_files(run_dir, config_yaml, schedule, prepared.resume_step)
            if prepared.directory.restart:
                console.print(
                    f"run.dir={run_dir} held an earlier attempt that saved no checkpoint: starting it over "
                    "(its metrics and TensorBoard events are replaced)",
                    highlight=False,
                )
            verb = "resuming from step " + str(start) + " in" if prepared.resume_step is not None else "run directory:"
            console.print(f"{verb} {run_dir}", highlight=False)
        console.print(
            f"model FLOPs per step and device {flops / 1e12:.4g} TFLOP; peak "
            + (f"{peak / 1e12:.4g} TFLOP/s ({peak_source})" if peak else peak_source),
            highlight=False,
        )
        keep_through = -1 if prepared.directory.restart else prepared.resume_step  # -1: drop every record
        loggers = RunLoggers(run_dir, config.log, keep_through, is_main_process(), {"config": config_yaml})
        make_batch = lambda: local_batch(next(batches), local_rows, batch_shape, mesh)  # noqa: E731
        data_states = {start: batches.get_state()}  # the position before the first batch is taken
        first_batch = make_batch()
        console.print(describe_memory(memory), highlight=False)
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
                state, step_metrics = train_step(state, batch)
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
                        "pinned_host_bytes_planned": schedule.pinned_host_bytes,
                    }
                    if memory is not None:
                        record["pinned_host_bytes_compiled"] = memory.host_temporaries
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
    skipped = int(state.nonfinite_steps)
    if tc.on_nonfinite == "skip" and skipped:
        console.print(
            f"train.on_nonfinite=skip: skipped the update of {skipped} of {int(state.step)} steps whose loss or "
            "gradient was not finite",
            highlight=False,
        )
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
