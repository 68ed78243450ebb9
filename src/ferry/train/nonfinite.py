"""The lagged non-finite check (`train.on_nonfinite=stop`): each step's non-finite flag is read
one step late, so that reading it never waits for the step just issued and one step is always
in flight; it is read at once before anything leaves the device (a log, an evaluation, a save,
a stop) and when the loop ends."""

import dataclasses

import jax

from ferry.errors import FerryError


class NonFiniteLossError(FerryError, RuntimeError):
    """Training stopped at a step whose loss or gradient was not finite."""


@dataclasses.dataclass
class NonFiniteWatch:
    """The first step found with a non-finite loss or gradient (`bad_step`), from the steps'
    `nonfinite` metrics; `enabled` False (on_nonfinite=skip) reads nothing."""

    enabled: bool
    bad_step: int | None = None
    _unread: tuple[int, jax.Array] | None = None  # a step whose flag is not read yet

    def issued(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """Step `step` was issued: read the step before it, and keep this one for later."""
        if self.enabled:
            self._read()
            self._unread = (step, metrics["nonfinite"])

    def settle(self) -> None:
        """Read the step not yet read, if any (blocks on it)."""
        if self.enabled and self.bad_step is None:
            self._read()

    def _read(self) -> None:
        pending, self._unread = self._unread, None
        if pending is not None and bool(pending[1]):
            self.bad_step = pending[0]


def nonfinite_error(bad_step: int, checkpoint_directory: object) -> NonFiniteLossError:
    """What stops the run at `bad_step`, saying where the last good state is and how to go on."""
    where = f"the state of step {bad_step - 1} is checkpointed in {checkpoint_directory}"
    return NonFiniteLossError(
        f"the loss or gradient is not finite at step {bad_step}; training stopped and {where} "
        f"(nothing of step {bad_step} was applied). Lower train.learning_rate, or set "
        "train.on_nonfinite=skip to skip such steps"
    )
