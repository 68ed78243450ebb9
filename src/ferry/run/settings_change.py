"""The training settings a run was trained with, saved with every checkpoint: a resume whose
optimizer, schedule or loss settings (`ferry.config.train.UPDATE_SETTINGS`) differ from its
checkpoint's would go on with another update than the one the losses so far came from, unsaid. It
is refused naming them, `key: then -> now`, unless `run.allow_change` names each; then the change
is said at start-up and recorded in run.json with its step. `train.steps` is compared too but
never refused (lengthening a run is what a resume with more steps is for): its stretched decay
is said and recorded."""

import dataclasses
from pathlib import Path
from typing import Any

from ferry.config.root import FerryConfig
from ferry.config.train import UPDATE_SETTINGS
from ferry.run.checkpoint import RunCheckpointError
from ferry.run.run_record import RUN_RECORD, Change, changes

LENGTH = "train.steps"
ALLOW = "run.allow_change"


class SettingsChangeError(RunCheckpointError):
    """A resume with optimizer, schedule or loss settings other than its checkpoint's, not allowed."""


def settings_identity(config: FerryConfig) -> dict[str, Any]:
    """The settings of the update and the loss, and the run's length, as `key: value`."""
    return {key: getattr(config.train, key.removeprefix("train.")) for key in (*UPDATE_SETTINGS, LENGTH)}


def settings_changes(
    config: FerryConfig, path: Path, step: int, saved: dict[str, Any] | None, current: dict[str, Any]
) -> tuple[list[str], list[Change]]:
    """The lines to say and the changes to record when resuming `step`; a change of a setting
    `run.allow_change` does not name refused."""
    if saved is None:
        note = f"checkpoint step {step} did not record its training settings (an earlier ferry's): not compared"
        return [note], []
    found = changes(saved, current, ALLOW)
    update = [change for change in found if change.key != LENGTH]
    refused = [change for change in update if change.key not in config.run.allow_change]
    if refused:
        keys = ",".join(change.key for change in update)  # all of them: the value to pass as it stands
        raise SettingsChangeError(
            f"run.dir={path}: its checkpoint step {step} was trained with other settings "
            f"({'; '.join(change.line() for change in refused)}); resuming would change its optimizer or loss from "
            f"step {step + 1} on. Resume with the checkpoint's values, pass a new run.dir, or name the change on "
            f"purpose: {ALLOW}=[{keys}] (recorded in {path / RUN_RECORD})"
        )
    notes = []
    if update:
        shown = "; ".join(change.line() for change in update)
        notes.append(f"{ALLOW}: resuming step {step} with changed settings ({shown}); recorded in {path / RUN_RECORD}")
    notes += unused_allowances(config, {change.key for change in update}, step)
    length = [change for change in found if change.key == LENGTH] if step < config.train.steps else []
    for change in length:
        notes.append(
            f"{change.line()}: the learning rate's cosine decay now ends at step {change.now}, from step {step} on; "
            f"recorded in {path / RUN_RECORD}"
        )
    return notes, update + [dataclasses.replace(change, allowed_by="always (a run's length)") for change in length]


def unused_allowances(config: FerryConfig, changed: set[str] | None, step: int | None = None) -> list[str]:
    """Notes for run.allow_change keys with nothing to allow, and for run.allow_foreign_checkpoint
    in a new run (`changed` None): set, they would otherwise do nothing unsaid."""
    if changed is None:
        named = [f"{ALLOW}={list(config.run.allow_change)}"] if config.run.allow_change else []
        named += ["run.allow_foreign_checkpoint=true"] if config.run.allow_foreign_checkpoint else []
        return [f"{' and '.join(named)}: a new run resumes nothing, so there is nothing to allow"] if named else []
    unused = [key for key in config.run.allow_change if key not in changed]
    if not unused:
        return []
    return [f"{ALLOW} names {', '.join(unused)}, trained with the same value up to step {step}: nothing to allow"]
