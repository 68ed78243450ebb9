"""SIGTERM (a preemption, a scheduler's time limit) asks the run to checkpoint and exit cleanly.

With one process a signal handler records the request and the loop checks it after each step.
With several, JAX's preemption service (started by `jax.distributed.initialize`) catches the
signal and `reached_preemption_sync_point` makes every process stop at the same step. Before the
loop listens (start-up, data, compile), `stop_on_sigterm` turns the signal into `Terminated`,
raised where the program is, so the launcher unwinds (its run directory released) and says so.
"""

import signal
import sys
import types
from typing import Any

import jax
from jax.experimental import multihost_utils


class Terminated(BaseException):
    """SIGTERM arrived while no step loop listened for it. A BaseException, as KeyboardInterrupt
    is: no `except Exception` on the way swallows the stop."""


class _Request:
    """Whether `stop_on_sigterm`'s handler ran: JAX catches whatever a backend plugin's start-up
    raises (it logs it and goes on), `Terminated` too, so the request is also kept here."""

    made = False


def _raise_terminated(signum: int, frame: types.FrameType | None) -> None:
    _Request.made = True
    raise Terminated


def _quiet_about_terminated(unraisable: Any) -> None:
    """A `Terminated` raised inside a garbage-collector callback or a `__del__` cannot unwind: Python
    prints it as "Exception ignored" with a traceback. The request is kept (`_Request`) and
    `check_terminated` raises it again where it can unwind, so that print is noise."""
    if not isinstance(unraisable.exc_value, Terminated):
        sys.__unraisablehook__(unraisable)


def stop_on_sigterm() -> None:
    """From now until a `SigtermStop` takes the signal over (and again once it gives it back),
    SIGTERM raises `Terminated` in the main thread."""
    if sys.unraisablehook is not _quiet_about_terminated:
        sys.unraisablehook = _quiet_about_terminated
    signal.signal(signal.SIGTERM, _raise_terminated)


def check_terminated() -> None:
    """Raise `Terminated` where a SIGTERM came since `stop_on_sigterm` and its exception was
    swallowed on the way."""
    if _Request.made:
        raise Terminated


class SigtermStop:
    """A context in which SIGTERM requests a stop instead of killing the process."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> "SigtermStop":
        check_terminated()  # a stop asked for before the loop listened: the run does not start
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

    def stop_before_start(self) -> None:
        """A SIGTERM that came while the run compiled or built its state stops it before its first
        step, nothing written (`Terminated`). One process only: several stop together at a step."""
        if self.signalled:
            raise Terminated

    def requested(self, step: int) -> bool:
        """Whether to stop after `step`; every process gets the same answer."""
        if jax.process_count() == 1:
            return self.signalled
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the preemption service is off
            return False
