"""Timing a run's real train step on this machine's devices: what `offload=auto` measures its
candidates with (`ferry.plan.auto_measure`), and what a benchmark can call.

`StepTimer` runs a step a few times untimed, then times each of a few more, waiting for each to
finish; its clock is injectable (`Clock`), so a test decides what a step "takes".
`measure_train_step` compiles the step a run of a config trains with (its `StepRecipe`, compiled
as `ferry.train.compiled_step` compiles it) over the devices, drops a candidate that does not fit
them (out of memory at compile time or while running, or a compiled program over the device's
memory limit) saying why, and times it on a fresh random state and zero batches of the run's
shape: no run's data or state is touched. Run in its own process (`measure_in_subprocess`, the
command `python -m ferry.plan.measure REQUEST RESULT`), each candidate's memory peak is its own.
"""

import dataclasses
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh

from ferry.config.root import FerryConfig
from ferry.cpu_only import device_accelerator, pci_vendors
from ferry.errors import FerryError

T = TypeVar("T")
# a candidate's compile and its steps, in its own process: far above a case's start on a v5e at the
# benchmark's shape (docs/results/tpu-v5e.md, "What one case costs")
MEASURE_TIMEOUT_S = 1800.0
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"


class MeasureError(FerryError, RuntimeError):
    """Measuring cannot run on this machine as asked (no accelerator, a mesh of other devices)."""


@runtime_checkable
class Clock(Protocol):
    """Seconds from some fixed start: `time.perf_counter`, or a test's fake."""

    def __call__(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Each timed step's seconds, in order."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        """What a candidate is ranked by: one slow step (a host hiccup) does not move it."""
        return statistics.median(self.seconds)


@dataclasses.dataclass(frozen=True)
class StepTimer:
    """`warmup_steps` untimed steps (the first runs the program's one-time work), then `steps`
    timed ones, each from its dispatch until its outputs are ready."""

    warmup_steps: int = 1
    steps: int = 3
    clock: Clock = time.perf_counter

    def time(self, run: Callable[[T], Any], make_input: Callable[[], T]) -> StepTiming:
        """Time `run(make_input())`; the input is made before the clock starts."""
        for _ in range(self.warmup_steps):
            jax.block_until_ready(run(make_input()))
        seconds = []
        for _ in range(self.steps):
            given = make_input()
            start = self.clock()
            jax.block_until_ready(run(given))
            seconds.append(self.clock() - start)
        return StepTiming(tuple(seconds))


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One config's train step on this machine: timed where it fits, else why not (`reason`).
    Bytes are per device; None where the backend does not say (a CPU has no memory limit)."""

    fits: bool
    reason: str
    step_seconds: float | None = None  # the median timed step
    step_times: tuple[float, ...] = ()
    device_bytes: int | None = None  # the compiled step's arguments + outputs - aliases + temporaries + code
    host_bytes: int | None = None  # its pinned host temporaries
    peak_bytes: int | None = None  # the device's peak while it ran (`memory_stats`)
    capacity_bytes: int | None = None  # the device's limit (`memory_stats()["bytes_limit"]`)
    device_kind: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"step_times": list(self.step_times)}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> "Measurement":
        return cls(**{**record, "step_times": tuple(record.get("step_times", ()))})


def out_of_memory(error: BaseException) -> bool:
    return OUT_OF_MEMORY in str(error)


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:limit]


def measure_train_step(
    config: FerryConfig,
    timer: StepTimer,
    mesh: Mesh | None = None,
    capacity_bytes: int | None = None,
) -> Measurement:
    """Compile `config`'s train step over `mesh` (default: the run's mesh over this machine's
    devices) and time it with `timer` on a fresh random state (never a checkpoint's) and zero
    batches of the run's shape, each made anew (the step donates its batch). A step that runs out of memory,
    at compile time or while it runs, or whose compiled program exceeds the device's limit
    (`capacity_bytes`, default the `bytes_limit` of the mesh's first device), is not timed: `fits` is False and
    `reason` says why."""
    from ferry.offload.schedule import format_bytes
    from ferry.sharding import make_mesh
    from ferry.train.memory import CompiledMemory

    config = dataclasses.replace(config, init=dataclasses.replace(config.init, from_hf=None))  # a random init
    mesh = make_mesh(config.mesh) if mesh is None else mesh
    device = mesh.devices.flat[0]
    capacity = (device.memory_stats() or {}).get("bytes_limit") if capacity_bytes is None else capacity_bytes
    facts = {"capacity_bytes": None if capacity is None else int(capacity), "device_kind": device.device_kind}
    try:
        step = _compiled(config, mesh)
    except jax.errors.JaxRuntimeError as error:
        if not out_of_memory(error):
            raise
        return Measurement(False, f"out of memory at compile time: {_first_line(error)}", **facts)
    with jax.set_mesh(mesh):
        memory = CompiledMemory.of(step.compiled)
        needs = None if memory is None else memory.device_bytes
        facts |= {"device_bytes": needs, "host_bytes": None if memory is None else memory.host_temporaries}
        if needs is not None and capacity is not None and needs > capacity:
            over = f"its compiled step needs {format_bytes(needs)} of the device's {format_bytes(capacity)}"
            return Measurement(False, over, **facts)
        try:
            timing = _timed(step, config, mesh, timer)
        except jax.errors.JaxRuntimeError as error:
            if not out_of_memory(error):
                raise
            return Measurement(False, f"out of memory while running: {_first_line(error)}", **facts)
        peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    return Measurement(
        True,
        f"median of {len(timing.seconds)} timed steps after {timer.warmup_steps} warm-up",
        timing.median,
        timing.seconds,
        peak_bytes=None if peak is None else int(peak),
        **facts,
    )


class _Compiled(NamedTuple):
    """A run's train step compiled for measuring, with what running it needs."""

    compiled: Any
    run: Callable
    layout: Any  # ferry.train.state_layout.StateLayout
    placement: Any  # ferry.data.placement.BatchPlacement
    optimizer: Any


def _compiled(config: FerryConfig, mesh: Mesh) -> _Compiled:
    """The step a run of `config` trains with (its `StepRecipe`: its loss head, settings and
    document mask too), compiled as the run compiles it (its scheduler costs included)."""
    from ferry.data.placement import BatchPlacement
    from ferry.train.recipe import StepRecipe
    from ferry.xla.scheduler_costs import ProfileCache, scheduler_target

    recipe = StepRecipe.of(config, mesh)
    scheduler = scheduler_target(config.platform, mesh.devices.flat[0].device_kind)
    step = recipe.compile(scheduler, ProfileCache.of(config.platform))
    placement = BatchPlacement.on(mesh, recipe.batch_shape)
    return _Compiled(step.compiled, step.run, recipe.layout, placement, recipe.optimizer)


def _timed(step: _Compiled, config: FerryConfig, mesh: Mesh, timer: StepTimer) -> StepTiming:
    """`timer`'s timing of the step on a fresh random state and zero batches, each made anew (the
    step donates its batch)."""
    from ferry.train.state_layout import initial_state

    zeros = np.zeros((len(step.placement.local_rows), config.batch_shape[1]), np.int32)
    state = [initial_state(config, step.optimizer, mesh, step.layout)[0]]

    def run(batch: jax.Array) -> Any:
        state[0], metrics = step.run(state[0], batch)
        return state[0], metrics

    return timer.time(run, lambda: step.placement.place(zeros))


def measure_in_subprocess(
    node: Mapping[str, Any], timer: StepTimer, timeout_s: float = MEASURE_TIMEOUT_S
) -> Measurement:
    """`measure_train_step` of the run config `node` (a resolved config as `load_config` takes it;
    its `platform` is applied before JAX starts there) in a fresh Python process: its own backend,
    on the accelerator this planning process keeps its hands off, and its own memory peak. A
    config the process refuses (its platform or mesh not on this machine) is a `MeasureError`."""
    with tempfile.TemporaryDirectory(prefix="ferry-measure-") as directory:
        request, result = Path(directory) / "request.json", Path(directory) / "result.json"
        timing = {"warmup_steps": timer.warmup_steps, "steps": timer.steps}
        request.write_text(json.dumps({"config": node, **timing}))
        command = [sys.executable, "-m", "ferry.plan.measure", str(request), str(result)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=child_environment())
        except subprocess.TimeoutExpired:
            return Measurement(False, f"did not finish within {timeout_s:.0f} s")
        if not result.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            return Measurement(False, f"its process failed (exit {done.returncode}): " + " | ".join(tail)[-600:])
        record = json.loads(result.read_text())
    if "refused" in record:
        raise MeasureError(record["refused"])
    return Measurement.from_json(record)


def child_environment() -> dict[str, str]:
    """This process's environment, less what keeps a child off the accelerator: the planning
    process has loaded libtpu for its compile-only TPU devices, and libtpu's lockfile would refuse
    a second process (which, unlike this one, opens the chip)."""
    return {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def main(argv: list[str]) -> int:
    """`python -m ferry.plan.measure REQUEST RESULT`: measure the request's config, write the
    result (or, for a refused config, `{"refused": why}`) as JSON."""
    from ferry.config.root import load_config
    from ferry.platform import apply_platform, check_platform

    request_path, result_path = Path(argv[0]), Path(argv[1])
    request = json.loads(request_path.read_text())
    try:
        config = load_config(request["config"])
        apply_platform(config.run_platform)
        check_platform(config.run_platform)
        timer = StepTimer(request["warmup_steps"], request["steps"])
        record = measure_train_step(config, timer).to_json()
    except FerryError as error:
        record = {"refused": " ".join(str(error).split())}
    result_path.write_text(json.dumps(record))
    return 0


def accelerator_present(
    environ: Mapping[str, str] | None = None,
    devices: Callable[[str], list[str]] = glob.glob,
    vendors: Callable[[], list[str]] = pci_vendors,
) -> str | None:
    """The accelerator this machine has, judged without starting JAX (a planning process keeps
    to the CPU): `ferry.cpu_only.device_accelerator`'s, or None where `JAX_PLATFORMS` names only
    the CPU."""
    environ = os.environ if environ is None else environ
    if environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return None
    return device_accelerator(devices, vendors)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
