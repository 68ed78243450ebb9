"""Each checkpoint step's record of itself: which step it is, which run saved it (its id in
run.json) and a digest of its metadata (the model identity, the data position, the arrays'
checksums). It is Orbax's custom metadata of the step, inside the step's own directory
(`_CHECKPOINT_METADATA`).

The arrays' checksums prove the arrays are what was saved, not which step saved them: a step
directory that is another step's (a symlink `12 -> 8`, a copy or a rename) passed them and was
resumed as the step its name says, with the other step's state. Its record names the step it
really is (`ferry.run.foreign_step` checks it before a resume)."""

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RECORD_KEY = "ferry_step"  # the record's key in Orbax's custom metadata of a step
RECORD_FORMAT = 3  # the checkpoint format from which every step holds its record


@dataclasses.dataclass(frozen=True)
class StepRecord:
    step: int
    run: str | None  # the run's id (run.json); None where the saver had none (a test's Checkpoints)
    digest: str  # `metadata_digest` of the step's model identity, data position and checksums

    def to_json(self) -> dict[str, Any]:
        return {RECORD_KEY: dataclasses.asdict(self)}

    @classmethod
    def of(cls, custom: Mapping[str, Any] | None) -> "StepRecord | None":
        """The record in a step's custom metadata, or None (an earlier ferry's step, or one that lost it)."""
        found = (custom or {}).get(RECORD_KEY)
        if not isinstance(found, Mapping) or not isinstance(found.get("step"), int):
            return None
        return cls(found["step"], found.get("run"), str(found.get("digest")))


def metadata_digest(model: Any, data: Any, checksums: Any) -> str:
    """sha256 of the step's JSON items as they read back (a JSON round trip first: tuples become
    lists, keys strings), so the saved and the restored items give the same digest."""
    items = json.loads(json.dumps({"model": model, "data": data, "checksums": checksums}, default=str))
    text = json.dumps(items, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class FoundStep:
    """What a step directory holds about itself, read before it is resumed."""

    step: int  # the step its directory's name says
    path: Path
    identity: dict[str, Any]  # its model item: the model, the data and settings it was trained with
    record: StepRecord | None
    digest: str  # `metadata_digest` of its items as they read now
    fallback: str  # what to do instead: the earlier step to resume from, or a new run.dir

    @property
    def checkpoint_format(self) -> int:
        return int(self.identity.get("checkpoint_format", 1))

    def what_it_is(self) -> str:
        """How this directory came to hold another step: a symlink's target, else a copy or rename."""
        if self.path.is_symlink():
            return f"{self.path} is a symlink to {os.readlink(self.path)}"
        return f"{self.path} is a copy or a rename of step {self.record.step if self.record else '?'}"
