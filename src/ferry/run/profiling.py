"""A `jax.profiler` trace of a few chosen steps into <run dir>/profile, viewable in XProf
(TensorBoard's profile plugin) or Perfetto: on GPU it shows the host copies of the offload
schedule overlapping compute."""

from pathlib import Path
from typing import Any

import jax

from ferry.config.root import ProfileConfig


class StepProfiler:
    """Starts the trace before `start_step` and stops it once `steps` steps have finished."""

    def __init__(self, config: ProfileConfig, directory: Path):
        self.start = config.start_step
        self.last = None if config.start_step is None else config.start_step + config.steps - 1
        self.directory = directory
        self.active = False

    def before_step(self, step: int) -> None:
        if step == self.start:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after_step(self, step: int, outputs: Any) -> None:
        if self.active and step == self.last:
            self.stop(outputs)

    def stop(self, outputs: Any = None) -> None:
        """End the trace once `outputs` are computed (a run that stops early stops it too)."""
        if self.active:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.active = False
