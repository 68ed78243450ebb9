"""The run directory: which one a run writes (a new one, or one whose checkpoints it resumes),
chosen by process 0 under its lock and told to every process, and the files a run starts with.
A resume continues its latest step only when that step is its own (`ferry.run.foreign_step`) and
the model, the data and the training settings agree with it, or the difference is allowed on
purpose; what was allowed is said at start-up and recorded in run.json (`ferry.run.run_record`)."""

import dataclasses
import datetime
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ferry.config.root import FerryConfig
from ferry.distributed import is_main_process
from ferry.errors import FerryError
from ferry.offload.schedule import TransferSchedule
from ferry.run.checkpoint import Checkpoints, RunCheckpointError, checkpoint_steps, identity_difference
from ferry.run.data_identity import data_difference
from ferry.run.foreign_step import check_step
from ferry.run.lock import LOCK_FILE, RunDirectoryError, RunLock, acquire
from ferry.run.members import check_members
from ferry.run.run_record import Change, changes, new_run_id, recorded_run_id, write_run_record
from ferry.run.settings_change import settings_changes, unused_allowances


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


def _from_process_zero(decide: Callable[[], Path]) -> Path:
    """`decide()` on process 0 and its answer, a path or the refusal it raised (as a
    RunDirectoryError), on every process."""
    if jax.process_count() == 1:
        return decide()
    return Path(_text_from_process_zero(lambda: str(decide())))


def _text_from_process_zero(decide: Callable[[], str], limit: int = 4096) -> str:
    """`decide()` on process 0 and its answer, or the refusal it raised, on every process."""
    if jax.process_count() == 1:
        return decide()
    answer = b""
    if is_main_process():
        try:
            answer = b"text:" + decide().encode()
        except FerryError as error:
            answer = b"error:" + str(error).encode()
    buffer = np.zeros(limit, np.uint8)
    buffer[: len(answer[:limit])] = np.frombuffer(answer[:limit], np.uint8)
    received = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).rstrip(b"\0").decode()
    kind, _, text = received.partition(":")
    if kind == "error":
        raise RunDirectoryError(text)
    return text


@dataclasses.dataclass
class RunDirectory:
    """Where a run writes, what it continues, and the lock process 0 holds on it (None on the
    other processes). `restart`: an earlier attempt there saved no checkpoint; its logs are
    replaced."""

    path: Path
    resume_step: int | None
    lock: RunLock | None
    restart: bool = False
    data_change: tuple[str, ...] = ()  # run.allow_data_change=true: the data keys that differ from the checkpoint's
    run_id: str = ""  # run.json's, saved in every step's record
    notes: tuple[str, ...] = ()  # said at start-up: an unrecorded or foreign step resumed, settings changed
    changes: tuple[Change, ...] = ()  # what the resume goes on with other than its checkpoint: into run.json

    def mark_started(self) -> None:
        if self.lock is not None:
            self.lock.started = True

    def write_record(self) -> None:
        """run.json: the run's id, and what this resume changed on purpose (process 0, once started)."""
        write_run_record(self.path, self.run_id, self.resume_step, self.changes)

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
        kind, _, directory.run_id = _text_from_process_zero(lambda: _decided_run_id(path)).partition(":")
        steps = checkpoint_steps(path / "checkpoints")
        if steps:
            resume = _resumable(config, path, steps, identity, directory.run_id if kind == "recorded" else None)
            directory.resume_step, directory.data_change = resume.step, resume.data_change
            directory.run_id = resume.run_id or directory.run_id
            directory.notes, directory.changes = resume.notes, resume.changes
        else:
            directory.restart = any(p.name != LOCK_FILE for p in path.iterdir()) if path.is_dir() else False
            directory.notes = tuple(unused_allowances(config, None))
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
        if entries:
            check_members(path, resuming=bool(checkpoint_steps(path / "checkpoints")))  # before anything is written
        ours = LOCK_FILE in entries or checkpoint_steps(path / "checkpoints")
        if entries and not ours:
            raise RunDirectoryError(
                f"run.dir={path} already holds files but no checkpoint to resume, and no ferry run; ferry does not "
                "overwrite them. "
                "Pass a new run.dir, or omit it for runs/<timestamp>/"
            )
    return path


def _decided_run_id(path: Path) -> str:
    """`recorded:<id>` from run.json, or `new:<id>` for a run that has none yet (process 0's)."""
    recorded = recorded_run_id(path)
    return f"recorded:{recorded}" if recorded else f"new:{new_run_id()}"


@dataclasses.dataclass(frozen=True)
class Resume:
    """The step a command continues and what it goes on with that differs from the step's."""

    step: int
    data_change: tuple[str, ...]
    run_id: str | None  # the step's record's, for a run.dir without run.json (saved before it existed)
    notes: tuple[str, ...]
    changes: tuple[Change, ...]


def _resumable(
    config: FerryConfig, path: Path, steps: list[int], identity: dict[str, Any], run_id: str | None
) -> Resume:
    """The latest step, when it is its own and this command may continue the run that saved it:
    refused when it is another step's or run's (`ferry.run.foreign_step`), or the model, the data
    or the training settings differ, unless run.allow_foreign_checkpoint, run.allow_data_change or
    run.allow_change allows it (`run_id`: run.json's, None where the run has none)."""
    if not config.run.resume:
        raise RunDirectoryError(
            f"run.dir={path} holds checkpoints up to step {steps[-1]} and run.resume=false "
            "refuses to continue it; drop run.resume=false to resume, or pass a new run.dir"
        )
    checkpoints = Checkpoints(path / "checkpoints", config.checkpoint)
    try:
        found = checkpoints.read_step(steps[-1])
    finally:
        checkpoints.close()
    record_note, foreign = check_step(found, run_id, config.run.allow_foreign_checkpoint)
    saved = found.identity
    difference = identity_difference(saved, identity)
    if difference is not None:
        raise RunCheckpointError(
            f"run.dir={path} holds checkpoints of another model or shape: {difference}. "
            "Resume it with its own model config, or pass a new run.dir"
        )
    changed = data_difference(saved.get("data"), identity.get("data", {}))
    if changed and not config.run.allow_data_change:
        raise RunCheckpointError(
            f"run.dir={path}: its checkpoint step {steps[-1]} was trained on other data ({'; '.join(changed)}); "
            "resuming would continue its data position over other batches. Resume with the checkpoint's values, "
            "pass a new run.dir, or pass run.allow_data_change=true to continue on this data anyway"
        )
    notes, settings = settings_changes(config, path, steps[-1], saved.get("train"), identity.get("train", {}))
    made = [*settings, *changes(saved.get("data"), identity.get("data", {}), "run.allow_data_change")]
    made += [foreign] if foreign is not None else []
    notes = [record_note, *notes] if record_note is not None else notes
    record_run = found.record.run if found.record is not None else None
    return Resume(steps[-1], tuple(changed), run_id or record_run, tuple(notes), tuple(made))


def write_start_files(run_dir: Path, config_yaml: str, schedule: TransferSchedule, resume_step: int | None) -> None:
    """config.yaml and schedule.json; a resumed run keeps the first config.yaml and writes its own
    beside it."""
    name = "config.yaml" if resume_step is None else f"config.resumed_at_{resume_step}.yaml"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(config_yaml)
        (run_dir / "schedule.json").write_text(json.dumps(schedule.to_json(), indent=2))
    except OSError as error:  # a disk filled since the start-up checks
        raise RunDirectoryError(
            f"run.dir={run_dir}: {error.filename or name} cannot be written ({error.strerror or error}); "
            "free space there or pass another run.dir"
        ) from error
