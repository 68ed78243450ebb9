"""The step loop: each step is issued, then its events (log, evaluate, save, stop) are handled by
short methods of `TrainingLoop`; the profiler brackets the steps it traces, and the lagged
non-finite check (`NonFiniteWatch`) reads each step's flag a step late, as the check of each
batch's token ids (`TokenIdWatch`) reads its batch's smallest and largest id."""

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import grain
import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from ferry.config.train import TrainConfig
from ferry.data.placement import BatchPlacement
from ferry.distributed import is_main_process
from ferry.run.checkpoint import Checkpoints
from ferry.run.id_watch import TokenIdWatch
from ferry.run.loggers import RunLoggers
from ferry.run.meter import StepMeter
from ferry.run.nonfinite import NonFiniteWatch
from ferry.run.preemption import SigtermStop
from ferry.run.profiling import StepProfiler
from ferry.train.train_state import TrainState


@dataclasses.dataclass
class RunBatches:
    """The run's batches: the training stream (its position checkpointed) and the held-out one,
    each this process's rows of every global batch, placed on the mesh."""

    train: grain.DatasetIterator
    held_out: grain.DatasetIterator
    placement: BatchPlacement

    def next(self) -> jax.Array:
        return self.placement.place(next(self.train))

    def held_out_batches(self, count: int) -> list[jax.Array]:
        return [self.placement.place(next(self.held_out)) for _ in range(count)]

    def close(self) -> None:
        """Stop the iterators' prefetch threads."""
        self.train.close()
        self.held_out.close()


@dataclasses.dataclass
class StepClock:
    """Seconds per step since the last log, less what saving took in between."""

    last_time: float
    last_step: int
    overhead: float = 0.0

    @classmethod
    def started(cls, step: int) -> "StepClock":
        return cls(time.perf_counter(), step)

    def step_time(self, step: int) -> float:
        return (time.perf_counter() - self.last_time - self.overhead) / (step - self.last_step)

    def restart(self, step: int) -> None:
        self.last_time, self.last_step, self.overhead = time.perf_counter(), step, 0.0

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside is not step time."""
        started = time.perf_counter()
        yield
        self.overhead += time.perf_counter() - started


@dataclasses.dataclass(frozen=True)
class Due:
    """What a step's end must do besides counting it."""

    log: bool
    evaluate: bool
    save: bool
    stop: bool

    @property
    def anything(self) -> bool:
        return self.log or self.evaluate or self.save or self.stop


def evaluate(eval_step: Any, model: eqx.Module, batches: list[jax.Array]) -> float:
    return float(np.mean([float(eval_step(model, batch)) for batch in batches]))


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not is_main_process(),
    )


@dataclasses.dataclass
class TrainingLoop:
    """Steps `start + 1` to `train.steps` from `state`, logging, evaluating on `eval_batches`,
    checkpointing and stopping on SIGTERM, (with `watch` enabled) at a non-finite step, or at a
    batch holding an id outside the model's `vocab_size` (`ids`)."""

    train: TrainConfig
    state: TrainState
    train_step: Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]
    batches: RunBatches
    eval_step: Any
    eval_batches: list[jax.Array]
    checkpoints: Checkpoints
    identity: dict[str, Any]
    loggers: RunLoggers
    profiler: StepProfiler
    meter: StepMeter
    sigterm: SigtermStop
    console: Console
    start: int
    data_states: dict[int, Any]  # the training stream's position before each recent step's batch
    first_batch: jax.Array | None  # taken before the loop (its position is `data_states[start]`)
    vocab_size: int  # the model's: every batch's ids are checked against it
    watch: NonFiniteWatch = dataclasses.field(init=False)
    ids: TokenIdWatch = dataclasses.field(init=False)
    progress: Progress = dataclasses.field(init=False)
    clock: StepClock = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.watch = NonFiniteWatch(self.train.on_nonfinite == "stop")
        self.ids = TokenIdWatch(self.vocab_size)
        self.progress = progress_bar(self.console)

    def log_initial_evaluation(self) -> None:
        """A new run's step 0: the held-out loss of its initial state."""
        if self.eval_batches:
            self.loggers.write(
                {"step": 0, "eval_loss": evaluate(self.eval_step, self.state.forward_model, self.eval_batches)}
            )

    def run(self) -> None:
        with self.progress:
            task = self.progress.add_task("train", total=self.train.steps, completed=self.start, status="")
            self.clock = StepClock.started(self.start)
            for step in range(self.start + 1, self.train.steps + 1):
                if not self.step(step, task):
                    break
            self.watch.settle()
            self.ids.settle()

    def step(self, step: int, task: TaskID) -> bool:
        """Step `step` and its events; False when the run stops after it (or before, when the
        step before it was not finite or its batch held an id outside the vocabulary)."""
        metrics = self.issue(step)
        self.checkpoints.poll()  # a background save that failed stops the run now, naming its step
        due = self.due(step)
        if due.anything:
            self.watch.settle()
            self.ids.settle()
        if self.watch.bad_step is not None or self.ids.bad is not None:
            return False
        if due.log or due.evaluate:
            self.log(step, metrics, due.evaluate, task)
        if due.save or due.stop:
            self.save_untimed(step)
        self.progress.update(task, completed=step)
        if due.stop:
            self.console.print(f"SIGTERM: stopped after step {step}; checkpoint saved in {self.checkpoints.directory}")
        return not due.stop

    def issue(self, step: int) -> dict[str, jax.Array]:
        """Dispatch step `step` (its batch, its data position, the profiler around it)."""
        batch = self.first_batch if self.first_batch is not None else self.batches.next()
        self.first_batch = None
        self.data_states[step] = self.batches.train.get_state()
        self.data_states.pop(step - 3, None)
        self.ids.issued(step, batch)  # before the step, which donates the batch
        self.profiler.before_step(step)
        self.state, metrics = self.train_step(self.state, batch)
        self.profiler.after_step(step, metrics)
        self.watch.issued(step, metrics)
        return metrics

    def due(self, step: int) -> Due:
        tc = self.train
        return Due(
            log=step == self.start + 1 or step % tc.log_every == 0 or step == tc.steps,
            evaluate=bool(self.eval_batches) and (step % tc.eval_every == 0 or step == tc.steps),
            save=self.checkpoints.due(step, last=step == tc.steps),
            stop=self.sigterm.requested(step),
        )

    def log(self, step: int, metrics: dict[str, jax.Array], evaluate_now: bool, task: TaskID) -> None:
        record = {k: float(v) for k, v in metrics.items() if k != "nonfinite"}  # blocks on the step
        record |= self.meter.record(step, self.clock.step_time(step))
        if evaluate_now:
            record |= self.evaluate()
        self.loggers.write(record)
        self.progress.update(task, status=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s")
        self.clock.restart(step)  # evaluating is not step time

    def evaluate(self) -> dict[str, float]:
        loss = evaluate(self.eval_step, self.state.forward_model, self.eval_batches)
        return {"eval_loss": loss, "eval_perplexity": float(np.exp(loss))}

    def save_untimed(self, step: int) -> None:
        """Save outside the step time: the step's own time counts, the copy to host does not."""
        jax.block_until_ready(self.state)
        with self.clock.excluded():
            self.save(step)

    def save(self, step: int) -> None:
        self.checkpoints.save(step, eqx.filter(self.state, eqx.is_array), self.data_states[step], self.identity)

    def finish(self) -> None:
        """Stop the profiler, checkpoint the last good state after a non-finite step (none after a
        batch outside the vocabulary, whose state may be poisoned), close."""
        self.profiler.stop(self.state)
        bad_step = self.watch.bad_step
        if bad_step is not None and self.ids.bad is None:
            # Nothing has been applied since step bad_step - 1 but the count of non-finite steps,
            # which was 0 then (any earlier one would have stopped the run): that state is saved.
            self.state = dataclasses.replace(self.state, nonfinite_steps=jnp.zeros_like(self.state.nonfinite_steps))
            self.save(bad_step - 1)
        self.checkpoints.close()
        self.loggers.close()
