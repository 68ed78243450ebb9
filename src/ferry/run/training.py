"""A training run as prepared (`ferry.run.preflight`): the step compiled from the train state's
layout, its memory checked against the machine before any state is allocated or anything
written; then the state (new, or the checkpoint's it resumes), the start-up report, and the
step loop (`ferry.run.loop`)."""

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import jax
import optax
from rich.console import Console

from ferry.config.train import TrainConfig
from ferry.data.corpus import Corpus
from ferry.data.pipeline import PackedWindows, local_batches
from ferry.data.placement import BatchPlacement
from ferry.data.token_range import TokenIdError
from ferry.distributed import is_main_process
from ferry.offload.schedule import schedule_table
from ferry.run.checkpoint import Checkpoints
from ferry.run.directory import write_start_files
from ferry.run.id_watch import BadBatch, bad_batch_error, batch_index
from ferry.run.loggers import RunLoggers
from ferry.run.loop import RunBatches, TrainingLoop
from ferry.run.memory_report import describe_memory, host_bytes_line, step_fit_advice
from ferry.run.meter import StepMeter
from ferry.run.nonfinite import likely_causes, nonfinite_error
from ferry.run.out_of_memory import over_hbm_refusal
from ferry.run.preemption import SigtermStop
from ferry.run.preflight import PreparedRun
from ferry.run.profiling import StepProfiler
from ferry.run.startup import detail, end_startup, verbose_hint
from ferry.run.summary import run_summary
from ferry.train.compiled_step import CompiledStep
from ferry.train.memory import CompiledMemory, check_step_fits
from ferry.train.state_layout import initial_state
from ferry.train.step import make_eval_step
from ferry.train.train_state import TrainState
from ferry.xla.compile_oom import StepOverHbm
from ferry.xla.scheduler_costs import ProfileCache, scheduler_target


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
    config, run_dir = prepared.config, prepared.run_dir
    if prepared.complete:
        console.print(
            f"run {run_dir} is complete: its latest checkpoint is step {prepared.resume_step} of "
            f"train.steps={config.train.steps}"
        )
        return run_dir
    optimizer, settings = prepared.recipe.optimizer, prepared.recipe.settings
    batches = open_batches(prepared)
    tc = config.train
    if (note := held_out_note(tc, PackedWindows(training_corpus(prepared).eval, tc.seq_len).num_windows)) is not None:
        console.print(f"note: {note}", highlight=False)
    meter = StepMeter.of(config, prepared.schedule)
    # closing the iterators stops their prefetch threads, also when the run fails
    with jax.set_mesh(prepared.mesh), SigtermStop() as sigterm, contextlib.closing(batches):
        step, memory = compile_checked(prepared)  # no state yet
        meter = dataclasses.replace(meter, memory=memory)
        state, resumed = starting_state(prepared, optimizer, batches, console)  # a refusal leaves nothing
        sigterm.stop_before_start()
        prepared.directory.mark_started()  # what is written from here marks the directory as this run's
        checkpoints = resumed or open_checkpoints(prepared, console)
        announce_start(prepared, meter, config_yaml, console)
        loop = TrainingLoop(
            config.train,
            state,
            step.run,
            batches,
            make_eval_step(settings),
            batches.held_out_batches(config.train.eval_batches),
            checkpoints,
            prepared.identity,
            open_loggers(prepared, config_yaml),
            StepProfiler(config.profile, run_dir / "profile"),
            meter,
            sigterm,
            console,
            start=prepared.resume_step or 0,
            data_states={prepared.resume_step or 0: batches.train.get_state()},  # before the first batch
            first_batch=batches.next(),
            vocab_size=config.model.vocab_size,
        )
        detail(console, describe_memory(memory))
        if prepared.resume_step is None:
            loop.log_initial_evaluation()
        if is_main_process():
            end_startup(console, run_dir)  # what the terminal left out goes into startup.txt
        loop.run()
        loop.finish()
    if loop.ids.bad is not None:
        raise batch_refusal(prepared, loop.ids.bad, loop.data_states, checkpoints.directory)
    report_skipped(loop.state, config.train.on_nonfinite, console)
    if loop.watch.bad_step is not None:
        raise nonfinite_error(loop.watch.bad_step, checkpoints.directory, likely_causes(config))
    trace = None if config.profile.start_step is None else run_dir / "profile"
    summary = run_summary(run_dir, int(loop.state.step), config.train.steps, prepared.resume_step or 0, trace)
    console.print(summary, highlight=False, markup=False)
    return run_dir


def batch_refusal(prepared: PreparedRun, bad: BadBatch, data_states: dict[int, Any], checkpoints: Path) -> TokenIdError:
    """The refusal of the training batch with an id outside the vocabulary, naming where it lies."""
    config, tc = prepared.config, prepared.config.train
    return bad_batch_error(
        bad,
        batch_index(data_states.get(bad.step)),
        PackedWindows(training_corpus(prepared).train, tc.seq_len),
        tc.global_batch_size,
        config.data.seed,
        config.model.vocab_size,
        config.model_name,
        checkpoints,
    )


def held_out_note(train: TrainConfig, held_out_windows: int) -> str | None:
    """What an evaluation of `train.eval_batches` batches reads when the held-out split's
    `held_out_windows` make fewer: it cycles, reading the same windows again, so it says so."""
    available = held_out_windows // train.global_batch_size
    if train.eval_batches <= available:
        return None
    return (
        f"train.eval_batches={train.eval_batches} but the held-out split holds {available} whole batch(es) of "
        f"{train.global_batch_size} x {train.seq_len} tokens, so each evaluation reads some windows more than once; "
        f"set train.eval_batches={max(available, 1)} or a larger data.eval_fraction"
    )


def training_corpus(prepared: PreparedRun) -> Corpus:
    """The corpus of a run that trains (only a run already complete has none, and returns early)."""
    if prepared.corpus is None:
        raise AssertionError("a complete run has no corpus to train on")
    return prepared.corpus


def open_batches(prepared: PreparedRun) -> RunBatches:
    """This process's rows of the training stream (shuffled, prefetched) and of the held-out one."""
    config, tc, corpus = prepared.config, prepared.config.train, training_corpus(prepared)
    placement = BatchPlacement.on(prepared.mesh, config.batch_shape)
    rows = placement.local_rows
    train = local_batches(
        corpus.windows("train", tc.seq_len), tc.global_batch_size, config.data.seed, rows, config.data.prefetch
    )
    held_out = local_batches(corpus.windows("eval", tc.seq_len), tc.global_batch_size, 0, rows, 1, shuffle=False)
    return RunBatches(train, held_out, placement)


def compile_checked(prepared: PreparedRun) -> tuple[CompiledStep, CompiledMemory | None]:
    """The train step, compiled from the state's layout alone; refused, before any state is
    allocated or anything written, when its memory does not fit the device: by XLA at compile
    time (libtpu), or by its memory analysis against the device's free memory."""
    config = prepared.config
    scheduler = scheduler_target(config.platform, jax.devices()[0].device_kind)
    try:
        step = prepared.recipe.compile(scheduler, ProfileCache.of(config.platform))
    except StepOverHbm as over:  # libtpu refused it at compile time
        raise over_hbm_refusal(over, config) from over
    memory = CompiledMemory.of(step.compiled)
    if memory is not None:
        check_step_fits(memory, step_fit_advice(config))
    return step, memory


def open_checkpoints(prepared: PreparedRun, console: Console) -> Checkpoints:
    """The run's checkpoints, each save recording the run's id; their warnings on `console`."""
    return Checkpoints(
        prepared.run_dir / "checkpoints",
        prepared.config.checkpoint,
        run_id=prepared.directory.run_id,
        say=lambda line: console.print(f"warning: {line}", highlight=False, markup=False),
    )


def starting_state(
    prepared: PreparedRun, optimizer: optax.GradientTransformation, batches: RunBatches, console: Console
) -> tuple[TrainState, Checkpoints | None]:
    """The checkpoint's state and data position when resuming (read before anything is written:
    a bad checkpoint loses nothing) and the checkpoints read, else a new state and None: a new
    run's `checkpoints/` is made by the caller once the state is built, so a refused
    `init.from_hf` (a weight that is not finite) leaves no directory behind."""
    config = prepared.config
    if prepared.resume_step is None:
        return initial_state(config, optimizer, prepared.mesh, prepared.layout)[0], None
    checkpoints = open_checkpoints(prepared, console)
    arrays, data_state = checkpoints.restore(prepared.resume_step, prepared.layout.abstract())
    batches.train.set_state(data_state)
    return prepared.layout.assemble(arrays), checkpoints


def announce_start(prepared: PreparedRun, meter: StepMeter, config_yaml: str, console: Console) -> None:
    """The transfer schedule and host bytes; on process 0, the start files and where the run
    writes; the FLOPs and the peak."""
    run_dir = prepared.run_dir
    detail(console, schedule_table(prepared.schedule))
    detail(console, host_bytes_line(prepared.schedule, meter.memory))
    if is_main_process():
        write_start_files(run_dir, config_yaml, prepared.schedule, prepared.resume_step)
        prepared.directory.write_record()  # run.json: the run's id, what this resume changed on purpose
        if prepared.directory.restart:
            console.print(
                f"run.dir={run_dir} held an earlier attempt that saved no checkpoint: starting it over "
                "(its metrics and TensorBoard events are replaced)",
                highlight=False,
            )
        resuming = prepared.resume_step is not None
        verb = f"resuming from step {prepared.resume_step} in" if resuming else "run directory:"
        console.print(f"{verb} {run_dir}{verbose_hint(console)}", highlight=False)
    detail(console, meter.describe())


def open_loggers(prepared: PreparedRun, config_yaml: str) -> RunLoggers:
    """metrics.jsonl and the configured loggers, on process 0; a resumed run's records after its
    checkpoint (all of them, for a restarted directory) dropped."""
    keep_through = -1 if prepared.directory.restart else prepared.resume_step  # -1: drop every record
    config = prepared.config
    return RunLoggers(prepared.run_dir, config.log, keep_through, is_main_process(), {"config": config_yaml})


def report_skipped(state: TrainState, on_nonfinite: str, console: Console) -> None:
    skipped = int(state.nonfinite_steps)
    if on_nonfinite == "skip" and skipped:
        console.print(
            f"train.on_nonfinite=skip: skipped the update of {skipped} of {int(state.step)} steps whose loss or "
            "gradient was not finite",
            highlight=False,
        )
