"""`<run dir>/run.json`: the run's identity and what changed on purpose when it was resumed.

A run is named by a random id, made when it first starts and saved into every checkpoint step's
record (`ferry.run.step_record`), so a step copied in from another run directory is told apart
from the run's own. A resume that goes on with settings other than its checkpoint's (allowed by
`run.allow_change`, `run.allow_data_change` or `run.allow_foreign_checkpoint`, or a longer
`train.steps`) appends each change with the step it was made at, so a later reader of the run
sees what the losses after that step were trained with."""

import dataclasses
import datetime
import json
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ferry.errors import read_json
from ferry.run.lock import RunDirectoryError

RUN_RECORD = "run.json"


@dataclasses.dataclass(frozen=True)
class Change:
    """One key a resume goes on with at another value than its checkpoint's, and what allowed it."""

    key: str
    then: Any
    now: Any
    allowed_by: str

    def line(self) -> str:
        return f"{self.key}: {self.then} -> {self.now}"

    def to_json(self, step: int) -> dict[str, Any]:
        return {"step": step, "key": self.key, "then": self.then, "now": self.now, "allowed_by": self.allowed_by}


def changes(saved: Mapping[str, Any] | None, current: Mapping[str, Any], allowed_by: str) -> list[Change]:
    """Each key of `current` (then each only `saved` holds) whose value differs; none when the
    checkpoint recorded nothing (an earlier ferry's)."""
    if saved is None:
        return []
    keys = list(current) + [key for key in saved if key not in current]
    differing = [key for key in keys if saved.get(key) != current.get(key)]
    return [Change(key, saved.get(key), current.get(key), allowed_by) for key in differing]


def new_run_id() -> str:
    return uuid.uuid4().hex


def recorded_run_id(run_dir: Path) -> str | None:
    """The id run.json holds, or None where there is none (a new run, or one saved before run.json)."""
    path = run_dir / RUN_RECORD
    if not path.is_file():
        return None
    record = read_json(path, "the run's record")
    run_id = record.get("run_id") if isinstance(record, dict) else None
    if not isinstance(run_id, str) or not run_id:
        raise RunDirectoryError(f"{path} holds no run_id; restore the file, or move it aside to name the run anew")
    return run_id


def write_run_record(run_dir: Path, run_id: str, resume_step: int | None, made: Iterable[Change]) -> None:
    """run.json with the run's id and, for a resume, `made` appended at `resume_step` (a change
    recorded there already, a requeued command's, is not repeated). Written whole, then renamed."""
    path = run_dir / RUN_RECORD
    record = read_json(path, "the run's record") if path.is_file() else {}
    before = json.dumps(record, sort_keys=True)
    record.setdefault("run_id", run_id)
    record.setdefault("since", {"step": resume_step or 0, "time": _now()})  # a run older than run.json: its resume
    entries = record.setdefault("changes", [])
    for change in made:
        entry = change.to_json(resume_step or 0)
        if not any(all(e.get(k) == v for k, v in entry.items()) for e in entries):
            entries.append({**entry, "time": _now()})
    if json.dumps(record, sort_keys=True) == before:
        return
    temporary = path.with_suffix(".tmp")
    try:
        temporary.write_text(json.dumps(record, indent=2, default=str) + "\n")
        temporary.replace(path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise RunDirectoryError(
            f"run.dir={run_dir}: {path} cannot be written ({error.strerror or error}); free space there or pass "
            "another run.dir"
        ) from error


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
