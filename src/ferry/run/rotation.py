"""Rotation of a run's checkpoints (`checkpoint.keep`, `checkpoint.keep_every`), done by ferry
rather than by Orbax, whose failure to delete an old step surfaced as a failed save of the step
just written (which was whole) and left the old step half-deleted under its step's name.

A step is first renamed out of the steps (`<step>.removing`, one atomic rename), then deleted: a
deletion cut short leaves a directory no resume takes for a checkpoint. A step that is a symlink
loses the link only, never what it points at. What cannot be removed is said in one line; the run
goes on, as every checkpoint it saved is whole."""

import dataclasses
import itertools
import shutil
import sys
from pathlib import Path
from typing import Any

REMOVING = ".removing"  # the suffix of a step being removed: Orbax lists only whole numbers


def steps_to_remove(steps: list[int], keep: int, keep_every: int | None) -> list[int]:
    """Orbax's rule: the latest `keep` steps stay, and so does every multiple of `keep_every`."""
    ordered = sorted(steps)
    kept = set(ordered[-keep:]) | {s for s in ordered if keep_every and s % keep_every == 0}
    return [s for s in ordered if s not in kept]


@dataclasses.dataclass(frozen=True)
class RemovalFailure:
    """A step rotation could not remove, why, and what is left of it."""

    step: int
    cause: str
    leftover: Path | None  # the renamed, partly deleted directory; None: the step is left whole

    def line(self, saved: int, directory: Path) -> str:
        if self.leftover is None:
            left = (
                f"step {self.step} is left whole, still a checkpoint a resume can use; remove "
                f"{directory / str(self.step)} yourself once it can be"
            )
        else:
            left = (
                f"step {self.step} is left partly deleted as {self.leftover}, renamed first so that no resume takes "
                "it for a checkpoint; remove it yourself"
            )
        return (
            f"checkpoint step {saved} was saved in {directory}, but rotation could not remove the older step "
            f"{self.step} ({self.cause}): {left} (chattr -i or chmod u+w where it is protected). The run goes on: "
            "every checkpoint it saved is whole, and this step is not tried again in this run"
        )


def _rmtree(path: Path) -> None:
    """`shutil.rmtree` that removes all it can, then raises its first failure naming the whole
    path (rmtree's own error names a file relative to the directory it was in)."""
    failed: list[OSError] = []

    def record(function: Any, name: Any, error: Any) -> None:
        error = error[1] if isinstance(error, tuple) else error  # onerror's exc_info, onexc's exception
        strerror = getattr(error, "strerror", None) or str(error)
        failed.append(OSError(getattr(error, "errno", None), strerror, str(name)))

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=record)
    else:
        shutil.rmtree(path, onerror=record)
    if failed:
        raise failed[0]


def _cause(error: OSError) -> str:
    where = f": {error.filename}" if error.filename else ""
    return f"{error.strerror or error}{where}"


def remove_step(directory: Path, step: int) -> RemovalFailure | None:
    """Remove checkpoint step `step` from `directory`, or say what stopped it."""
    path = directory / str(step)
    if path.is_symlink():
        try:
            path.unlink()
        except OSError as error:
            return RemovalFailure(step, _cause(error), None)
        return None
    leftover = directory / f"{step}{REMOVING}"
    for attempt in itertools.count(1):  # an earlier removal of a step of this number may have been cut short
        if not leftover.exists() and not leftover.is_symlink():
            break
        leftover = directory / f"{step}{REMOVING}.{attempt}"
    try:
        path.rename(leftover)
    except OSError as error:
        return RemovalFailure(step, _cause(error), None)
    try:
        _rmtree(leftover)
    except OSError as error:
        return RemovalFailure(step, _cause(error), leftover)
    return None
