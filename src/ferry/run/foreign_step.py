"""A resume's check of its step's record (`ferry.run.step_record`): a step directory that is not
that step's (a symlink, a copy or a rename of another step) or not this run's is refused naming
both steps, unless `run.allow_foreign_checkpoint=true`; one whose metadata changed since it was
saved is refused; one saved before records existed (checkpoint format 2 and earlier) resumes with
a note."""

from ferry.run.checkpoint import RunCheckpointError
from ferry.run.run_record import Change
from ferry.run.step_record import RECORD_FORMAT, FoundStep

ALLOW = "run.allow_foreign_checkpoint"


class ForeignCheckpointError(RunCheckpointError):
    """The latest checkpoint step is not the step its directory's name says, or another run's."""


def check_step(found: FoundStep, run_id: str | None, allow_foreign: bool) -> tuple[str | None, Change | None]:
    """Refuse a step that is not its name's or not this run's (unless `allow_foreign`), or whose
    metadata changed since it was saved. The note to print, if any, and the change to record
    where a foreign step is resumed anyway."""
    step, record, where = found.step, found.record, found.path.parent
    if record is None:
        if found.checkpoint_format < RECORD_FORMAT:
            return (
                f"checkpoint step {step} was saved before ferry recorded each step's identity (checkpoint format "
                f"{found.checkpoint_format}); resuming it without checking that it is step {step}'s own",
                None,
            )
        why = f"checkpoint step {step} in {where} has lost the record every step of this ferry holds"
        lost = f"{why} ({found.path / '_CHECKPOINT_METADATA'}), so it cannot be told from a copy"
        return _foreign(found, lost, "", "no record", allow_foreign)
    if record.digest != found.digest:
        raise ForeignCheckpointError(
            f"checkpoint step {step} in {where}: its metadata (model, data position or checksums) changed since "
            f"it was saved, so it is not the step its record describes; {found.fallback}"
        )
    if record.step != step:
        why = f"checkpoint step {step} holds step {record.step}'s checkpoint ({found.what_it_is()})"
        risk = f"; resuming would continue step {record.step}'s state as step {step}"
        return _foreign(found, why, risk, f"step {record.step}'s checkpoint", allow_foreign)
    if run_id is not None and record.run is not None and record.run != run_id:
        why = f"checkpoint step {step} in {where} was saved by another run (run id {record.run}, not this run's "
        then = f"run {record.run}'s checkpoint"
        return _foreign(found, f"{why}{run_id}: a step copied in from another run directory)", "", then, allow_foreign)
    return None, None


def _foreign(found: FoundStep, why: str, risk: str, then: str, allow_foreign: bool) -> tuple[str, Change]:
    """Accepted with a note and a change to record where allowed, else refused naming the way back."""
    if allow_foreign:
        change = Change(f"checkpoints/{found.step}", then, f"resumed as step {found.step}", ALLOW)
        return f"{ALLOW}=true: {why}; resuming it as step {found.step} anyway", change
    fallback = found.fallback[0].upper() + found.fallback[1:]
    raise ForeignCheckpointError(
        f"{why}{risk}. {fallback}, or pass {ALLOW}=true to resume it as step {found.step} anyway"
    )
