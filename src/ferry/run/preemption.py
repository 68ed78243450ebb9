"""SIGTERM (a preemption, a scheduler's time limit) asks the run to checkpoint and exit cleanly.

With one process a signal handler records the request and the loop checks it after each step.
With several, JAX's preemption service (started by `jax.distributed.initialize`) catches the
signal and `reached_preemption_sync_point` makes every process stop at the same step.
"""

import signal
import types
from typing import Any

import jax
from jax.experimental import multihost_utils


class SigtermStop:
    """A context in which SIGTERM requests a stop instead of killing the process."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> "SigtermStop":
        if jax.process_count() == 1:  # with several processes JAX's own handler must stay
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.signalled = True

    def requested(self, step: int) -> bool:
        """Whether to stop after `step`; every process gets the same answer."""
        if jax.process_count() == 1:
            return self.signalled
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the preemption service is off
            return False
