"""ferry's cost model, handed to XLA's latency-hiding scheduler.

Without a profile, XLA:GPU's scheduler times every asynchronous op at one fixed latency (5,000
units) and every cuBLAS GEMM at 1,000, so it issues a copy about five matmuls before its result is
needed, however long the copy takes. On an FSDP mesh that puts each layer's reload next to its
last reduce-scatter, with less compute under it than the reload takes (Llama 3.1 8B layers on 8
H200: docs/results/deviceless.md, "XLA:GPU's fixed latencies on an FSDP mesh").

XLA also accepts a profile of measured costs (its profile-guided latency estimator, fed by
`xla_gpu_pgle_profile_file_or_directory_path`). ferry writes one from the compiled program instead
of a measurement, in the same terms as the plan's estimate: a kernel takes its matrix FLOPs at the
target's dense peak or its bytes at the HBM bandwidth, whichever is longer; a host copy its bytes
over the host link; a collective its ring bytes over the links its groups span
(`Collective.algorithmic_bytes`); a loop its body times its trip count (the trips that do work,
where the model marked a loop sized for the worst case: `ferry.xla.expected_work`). XLA reads the
profile when it sets up the scheduler, after the passes that make the module it prices: the profile
file is leased, and when XLA opens it the module is priced from XLA's dump of its last pass and
written before the open returns (`ferry.xla.profile_handoff`), so one compile schedules with it.
Where that cannot be done (no leases; a compile that autotunes) or the module scheduled is not the
one priced, the step is compiled as far as the scheduler (XLA's dump of the module it would
receive; the compile stops there), priced, and compiled again with the profile. The profile must
name every instruction of the module scheduled: a profile that misses one is an error, not a
silently worse schedule.

A priced profile is kept on disk (`ProfileCache`), keyed by everything the module it prices depends
on: the same program compiled again (a re-plan, a restarted run) skips the pricing.
"""

import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import os
import re
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax

from ferry.errors import FerryError
from ferry.xla.hardware import accelerator_name
from ferry.xla.hlo_collectives import collective_of, num_partitions
from ferry.xla.hlo_host_copies import HOST_MEMORY_SPACE
from ferry.xla.hlo_parse import same_module, shape_bytes, tuple_elements
from ferry.xla.hlo_schedule import ScheduledInstruction, scheduled_instructions
from ferry.xla.profile_handoff import leases_supported, written_when_opened
from ferry.xla.targets import TARGETS, GpuTarget

KERNEL_LAUNCH_US = 2.0  # a kernel's fixed cost on top of its FLOPs or bytes
COLLECTIVE_LATENCY_US = 10.0  # a collective's fixed cost on top of its bytes (NCCL's setup and hops)
_PRE_SCHEDULE = "*before_latency-hiding-scheduler.txt"  # XLA's dump of the module the scheduler gets
_CHECKED = "*before_pgle-accuracy-checker.txt"  # the same module, dumped before XLA checks a profile against it
_LAST_PASS_BEFORE_SCHEDULING = "gpu-copy-async-wrapper"  # XLA's pre-scheduling pipeline ends with it (jaxlib 0.12)
_PASS_DUMP = re.compile(r"\.(\d{4,})\.[^.]+\.after_")  # module_0001.jit_step.0157.<pipeline>.after_<pass>...
_COST_LINE = re.compile(r'^costs \{ name: "([^"]+)" cost_us: ([-+.0-9e]+) \}$', re.MULTILINE)
_LATENCY_LINE = re.compile(
    r'^latencies \{ source: "([^"]+)" target: "([^"]+)" latency_us: ([-+.0-9e]+) \}$', re.MULTILINE
)
# what a profile is computed by, besides the module: its key changes when any of them does
_COST_MODEL_SOURCES = (
    "scheduler_costs.py",
    "targets.py",
    "hlo_parse.py",
    "hlo_flops.py",
    "hlo_collectives.py",
    "hlo_schedule.py",
    "hlo_host_copies.py",
)
_COMPILERS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")


class SchedulerCostsError(FerryError, RuntimeError):
    """The cost profile made from a program does not cover the program compiled with it."""


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """What the scheduler is told: each instruction's time and each asynchronous op's latency
    (start to done), in microseconds, by instruction name."""

    costs: Mapping[str, float]
    latencies: Mapping[tuple[str, str], float]

    def to_text(self) -> str:
        """XLA's `ProfiledInstructionsProto` in text format."""
        lines = [f'costs {{ name: "{name}" cost_us: {us:.3f} }}' for name, us in self.costs.items()]
        lines += [
            f'latencies {{ source: "{start}" target: "{done}" latency_us: {us:.3f} }}'
            for (start, done), us in self.latencies.items()
        ]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "CostProfile":
        """The profile `to_text` wrote."""
        costs = {name: float(us) for name, us in _COST_LINE.findall(text)}
        latencies = {(start, done): float(us) for start, done, us in _LATENCY_LINE.findall(text)}
        return cls(costs, latencies)

    def unpriced(self, hlo_text: str) -> list[str]:
        """The instructions of a module (before scheduling) this profile gives no time, and the
        asynchronous ops it gives no latency."""
        instructions = [i for computation in scheduled_instructions(hlo_text).values() for i in computation]
        missing = [i.name for i in instructions if not i.is_nop and i.name not in self.costs]
        return missing + [i.start for i in instructions if _is_done(i) and (i.start, i.name) not in self.latencies]


def cost_profile(hlo_text: str, target: GpuTarget) -> CostProfile:
    """Price every instruction the scheduler orders in `hlo_text` (a module as the scheduler
    receives it) on `target` (module docstring)."""
    computations = scheduled_instructions(hlo_text)
    by_name = {i.name: i for instructions in computations.values() for i in instructions}
    partitions = num_partitions(hlo_text)
    totals: dict[str, float] = {}

    def computation_us(name: str) -> float:
        if name not in totals:
            totals[name] = 0.0  # a computation reached again while summing it (none should be)
            totals[name] = sum(instruction_us(i) for i in computations.get(name, []))
        return totals[name]

    def instruction_us(instruction: ScheduledInstruction) -> float:
        if instruction.is_nop or _is_start(instruction) or _is_done(instruction):
            return 0.0  # issuing or awaiting an asynchronous op; its latency is priced on its own
        if instruction.op == "while":
            return instruction.trip_count * instruction.share * sum(computation_us(c) for c in instruction.callees)
        if instruction.op == "conditional":
            return max((computation_us(c) for c in instruction.callees), default=0.0)
        if instruction.op == "call":
            return sum(computation_us(c) for c in instruction.callees)
        return kernel_us(instruction, target)

    costs = {i.name: instruction_us(i) for instructions in computations.values() for i in instructions if not i.is_nop}
    latencies = {
        (i.start, i.name): async_us(by_name[i.start], target, partitions)
        for instructions in computations.values()
        for i in instructions
        if _is_done(i) and i.start in by_name
    }
    return CostProfile(costs, latencies)


def kernel_us(instruction: ScheduledInstruction, target: GpuTarget) -> float:
    """A kernel's time: its matrix FLOPs at the dense peak or the bytes it moves at the HBM
    bandwidth, the longer, plus a launch. A dynamic-update-slice writes its update in place
    (reads and writes the update's bytes), a dynamic-slice reads and writes its result's."""
    result = shape_bytes(instruction.shape)
    operands = [shape_bytes(shape) for shape in instruction.operand_shapes]
    root = instruction.wrapped_op or instruction.op
    if root == "dynamic-update-slice":
        moved = 2 * (sum(operands) - max(operands, default=0))
    elif root == "dynamic-slice":
        moved = 2 * result
    else:
        moved = result + sum(operands)
    seconds = max(instruction.flops / target.bf16_peak_flops, moved / target.hbm_bandwidth)
    return seconds * 1e6 + KERNEL_LAUNCH_US


def async_us(start: ScheduledInstruction, target: GpuTarget, partitions: int) -> float:
    """An asynchronous op's latency: a host copy's bytes over the host link, a collective's ring
    bytes over its links, anything else (a device copy, a kernel on another stream) its kernel
    time."""
    *operands, result = _start_shapes(start)
    if HOST_MEMORY_SPACE in result:  # to host: the device operands cross (a slice's update, its indices)
        return sum(shape_bytes(s) for s in operands if HOST_MEMORY_SPACE not in s) / target.host_link_bandwidth * 1e6
    if any(HOST_MEMORY_SPACE in s for s in operands):  # to device: the result crosses
        return shape_bytes(result) / target.host_link_bandwidth * 1e6
    collective = collective_of(start.wrapped, partitions)
    if collective is not None:
        seconds = collective.algorithmic_bytes / max(target.collective_bandwidth(collective.groups), 1.0)
        return seconds * 1e6 + COLLECTIVE_LATENCY_US
    return kernel_us(dataclasses.replace(start, shape=result, operand_shapes=tuple(operands)), target)


def _start_shapes(start: ScheduledInstruction) -> list[str]:
    """An async op's operand shapes, then its result's: an async-start's shape is `((operands),
    result, context)`, a copy-start's `(result, operand, context)`."""
    elements = tuple_elements(start.shape)
    if start.op == "copy-start":
        return [elements[1], elements[0]]
    operands = tuple_elements(elements[0]) if elements[0].startswith("(") else elements[:1]
    return [*operands, elements[1] if len(elements) > 1 else ""]


def _is_start(instruction: ScheduledInstruction) -> bool:
    return instruction.op.endswith("-start")


def _is_done(instruction: ScheduledInstruction) -> bool:
    return instruction.op.endswith("-done") and bool(instruction.start)


@runtime_checkable
class CostSettings(Protocol):
    """The `platform` keys that choose the scheduler's costs (`ferry.platform.PlatformConfig` has
    them); a protocol, so that this floor does not import the config above it."""

    @property
    def scheduler_costs(self) -> str: ...

    @property
    def scheduler_costs_cached(self) -> bool: ...


def scheduler_target(platform: CostSettings, device_kind: str) -> GpuTarget | None:
    """The device facts ferry's cost profile prices a run's step with, where
    `platform.scheduler_costs=ferry` (None otherwise): refused for a GPU ferry has no facts of."""
    if platform.scheduler_costs != "ferry":
        return None
    target = TARGETS.get(accelerator_name(device_kind) or "")
    if not isinstance(target, GpuTarget):
        known = ", ".join(t.description for t in TARGETS.values() if isinstance(t, GpuTarget))
        raise SchedulerCostsError(
            f"platform.scheduler_costs=ferry prices the step with the device's peak and bandwidths, and ferry has "
            f"none for {device_kind!r} (it knows {known}): set platform.scheduler_costs=xla, or add the device "
            "to ferry/xla/targets.py"
        )
    return target


class PricedCompile(NamedTuple):
    """A program compiled with ferry's cost profile, and whether the profile came from the cache."""

    compiled: Any  # jax.stages.Compiled
    profile: CostProfile
    cached: bool


@dataclasses.dataclass(frozen=True)
class ProfileCache:
    """Cost profiles priced before, one gzipped file per program. A program's key hashes all the
    module XLA's scheduler receives depends on (the lowered program, the compile options and
    `XLA_FLAGS`, the target's facts, the compiler's versions) and the cost model's source: a
    program compiled again takes its profile from here, unpriced and in one compile. Should a key
    still miss a difference, the module that compile schedules has instructions the profile lacks:
    the entry is dropped and the program priced afresh."""

    directory: Path

    @classmethod
    def of(cls, platform: CostSettings) -> "ProfileCache | None":
        """Where `platform` keeps its profiles: `$XDG_CACHE_HOME/ferry/scheduler_costs` (default
        `~/.cache`), or None where `platform.scheduler_costs_cached` is off."""
        if not platform.scheduler_costs_cached:
            return None
        root = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
        return cls(root / "ferry" / "scheduler_costs")

    def key(self, lowered: Any, options: Mapping[str, object], target: GpuTarget) -> str:
        digest = hashlib.sha256(lowered.as_text().encode())
        described = repr((sorted((k, str(v)) for k, v in options.items()), os.environ.get("XLA_FLAGS"), target))
        digest.update(described.encode() + _cost_model_fingerprint())
        return digest.hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.pbtxt.gz"

    def load(self, key: str) -> CostProfile | None:
        try:
            return CostProfile.from_text(gzip.decompress(self._path(key).read_bytes()).decode())
        except (OSError, EOFError, UnicodeDecodeError):  # absent, or cut short: priced afresh
            return None

    def store(self, key: str, profile: CostProfile) -> None:
        """Written whole or not at all (a temporary file renamed), so threads and processes
        pricing at once never read half a profile."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".tmp", delete=False) as file:
            file.write(gzip.compress(profile.to_text().encode(), compresslevel=1))
        os.replace(file.name, self._path(key))

    def drop(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


@functools.cache
def _cost_model_fingerprint() -> bytes:
    """The cost model's source and the compiler's versions: read once a process."""
    sources = b"".join((Path(__file__).parent / name).read_bytes() for name in _COST_MODEL_SOURCES)
    versions = {name: _installed(name) for name in _COMPILERS}
    return hashlib.sha256(sources + repr(versions).encode()).digest()


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def compile_with_costs(
    lowered: Any, options: Mapping[str, object], target: GpuTarget, cache: ProfileCache | None = None
) -> PricedCompile:
    """Compile `lowered` for `target` with ferry's cost profile, priced from the module XLA's
    scheduler receives: in one compile that hands XLA the profile as it reads it
    (`_compile_priced_on_read`), else in two (once to read the module, then with its profile); in
    one with the profile `cache` has. The compile's module must be the one that was priced
    (`SchedulerCostsError` otherwise)."""
    key = None if cache is None else cache.key(lowered, options, target)
    cached = None if cache is None or key is None else cache.load(key)
    with tempfile.TemporaryDirectory(prefix="ferry-costs-") as scratch:
        if cached is not None:
            compiled, missing = _compile_priced(lowered, options, cached, Path(scratch) / "cached")
            if not missing:
                return PricedCompile(compiled, cached, True)
            assert cache is not None and key is not None  # a profile came from the cache
            cache.drop(key)
        handed = _compile_priced_on_read(lowered, options, target, Path(scratch) / "one")
        if handed is not None and handed.profile is not None:
            compiled, profile = handed.compiled, handed.profile
            missing = profile.unpriced(handed.scheduled)
        else:  # the module is read first, then compiled with its profile
            first = Path(scratch) / "first"
            module = handed.scheduled if handed is not None else _module_before_scheduling(lowered, options, first)
            profile = cost_profile(module, target)
            compiled, missing = _compile_priced(lowered, options, profile, Path(scratch) / "second")
    if missing:
        raise SchedulerCostsError(
            f"ferry's cost profile misses {len(missing)} instructions of the program compiled with it "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): the module priced is not the one "
            "scheduled; set platform.scheduler_costs=xla to schedule with XLA's own estimates"
        )
    if cache is not None and key is not None:
        cache.store(key, profile)
    return PricedCompile(compiled, profile, False)


class _HandedCompile(NamedTuple):
    compiled: Any
    profile: CostProfile | None  # None: XLA scheduled another module than the one priced
    scheduled: str  # the module XLA's scheduler received


def _compile_priced_on_read(
    lowered: Any, options: Mapping[str, object], target: GpuTarget, directory: Path
) -> _HandedCompile | None:
    """One compile whose scheduler reads the profile priced from its own module: the profile is
    made when XLA opens its file (`ferry.xla.profile_handoff`), by when XLA has dumped its last
    pass before scheduling. Should the module it then schedules not be that one (a pass after it
    changed the module), the compile has no profile and is done again with the right one.

    None where it cannot be done: on a filesystem without leases, or in a compile that autotunes
    (XLA compiles each kernel candidate with the step's options, and one would open the profile
    first; the planner's compiles do not autotune)."""
    if _autotunes(options):
        return None
    directory.mkdir(parents=True)
    if not leases_supported(directory):
        return None
    dump, priced = directory / "dump", []

    def price() -> str:
        module = _newest_pass_dump(dump)
        if module is None:  # XLA read the profile before any dump: scheduled without one
            return ""
        priced.append((module, cost_profile(module, target)))
        return priced[-1][1].to_text()

    path = directory / "costs.pbtxt"
    passes = f"{_LAST_PASS_BEFORE_SCHEDULING}|latency-hiding-scheduler"
    handed = {"xla_gpu_pgle_profile_file_or_directory_path": str(path)}
    with _WITHOUT_PGLE_LOGS, written_when_opened(path, price) as handoff:  # an empty profile's misses logged
        compiled = lowered.compile(dict(options) | _dump_options(dump, passes) | handed)
    if handoff.error is not None:
        raise handoff.error
    scheduled = _pre_schedule_module(dump)
    if handoff.delivered and priced and same_module(priced[0][0], scheduled):
        return _HandedCompile(compiled, priced[0][1], scheduled)
    return _HandedCompile(compiled, None, scheduled)


def _autotunes(options: Mapping[str, object]) -> bool:
    """Whether XLA autotunes this compile: it then compiles each kernel candidate with the step's
    options, the profile's path among them (XLA's default level is 1; the planner sets 0)."""
    return options.get("xla_gpu_autotune_level", 1) != 0


def _newest_pass_dump(directory: Path) -> str | None:
    """The module of XLA's latest dump between passes (they are numbered in the order run)."""
    dumps = [(int(match[1]), path) for path in directory.glob("*.txt") if (match := _PASS_DUMP.search(path.name))]
    return max(dumps)[1].read_text() if dumps else None


def _compile_priced(
    lowered: Any, options: Mapping[str, object], profile: CostProfile, directory: Path
) -> tuple[Any, list[str]]:
    """`lowered` compiled with `profile`, and the instructions of the module its scheduler
    received that the profile does not price."""
    directory.mkdir(parents=True)
    path = directory / "costs.pbtxt"
    path.write_text(profile.to_text())
    priced = {"xla_gpu_pgle_profile_file_or_directory_path": str(path)}
    compiled = lowered.compile(dict(options) | _dump_options(directory / "dump") | priced)
    return compiled, profile.unpriced(_pre_schedule_module(directory / "dump"))


def _module_before_scheduling(lowered: Any, options: Mapping[str, object], directory: Path) -> str:
    """The module XLA's scheduler would receive, without compiling the rest of the program.

    XLA checks a cost profile against the module just before scheduling (its PGLE accuracy
    checker). Given an empty profile and told to fail on a miss, the compile stops there, before
    scheduling, buffer assignment and code generation (about half of a compile), with the module
    dumped. Should a compile go through anyway, its dump before the scheduler is the same module.

    On a GPU that autotunes (any compile but the planner's, which sets `xla_gpu_autotune_level`
    to 0), XLA compiles every kernel candidate with the step's options, and the empty profile
    fails them all ("No candidates could be compiled", seen on an H200): there the step is
    compiled whole, dumped, and the autotuning it did is cached for the compile with the costs."""
    directory.mkdir(parents=True, exist_ok=True)
    if _autotunes(options):
        lowered.compile(dict(options) | _dump_options(directory))
        return _pre_schedule_module(directory)
    empty = directory / "empty.pbtxt"
    empty.write_text("")
    stop = _dump_options(directory, "pgle-accuracy-checker|latency-hiding-scheduler") | {
        "xla_gpu_pgle_profile_file_or_directory_path": str(empty),
        "xla_gpu_pgle_accuracy_checker": "PGLE_STRICTNESS_LEVEL_ERROR",
    }
    try:
        with _WITHOUT_PGLE_LOGS:  # XLA logs each instruction the empty profile lacks
            lowered.compile(dict(options) | stop)
    except jax.errors.JaxRuntimeError as error:
        if "missing instructions" not in str(error):
            raise
    return _pre_schedule_module(directory, _CHECKED, _PRE_SCHEDULE)


class _StderrWithout:
    """While entered (by any number of threads at once), the process's standard error (file
    descriptor 2, where XLA logs) goes to a file; when the last thread leaves, its lines are written
    back to standard error, less those logged from the named source files."""

    def __init__(self, *sources: str):
        self.sources = tuple(s.encode() for s in sources)
        self.lock = threading.Lock()
        self.users = 0
        self.saved_fd = -1
        self.capture: Any = None

    def __enter__(self) -> None:
        with self.lock:
            if self.users == 0:
                sys.stderr.flush()
                self.capture = tempfile.TemporaryFile()
                self.saved_fd = os.dup(2)
                os.dup2(self.capture.fileno(), 2)
            self.users += 1

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.users -= 1
            if self.users:
                return
            os.dup2(self.saved_fd, 2)
            os.close(self.saved_fd)
            self.capture.seek(0)
            for line in self.capture:
                if not any(source in line for source in self.sources):
                    os.write(2, line)
            self.capture.close()


_WITHOUT_PGLE_LOGS = _StderrWithout("profile_guided_latency_estimator.cc", "pgle_accuracy_checker.cc")


def _dump_options(directory: Path, passes: str = "latency-hiding-scheduler") -> dict[str, object]:
    return {
        "xla_dump_to": str(directory),
        "xla_dump_hlo_pass_re": passes,
        "xla_dump_hlo_as_text": True,
    }


def _pre_schedule_module(directory: Path, *patterns: str) -> str:
    """The module XLA dumped before scheduling, by the first of `patterns` it wrote."""
    dumps = next((found for pattern in patterns or (_PRE_SCHEDULE,) if (found := sorted(directory.glob(pattern)))), [])
    if len(dumps) != 1:
        raise SchedulerCostsError(
            f"expected one module before latency-hiding scheduling in XLA's dump, found {len(dumps)}: "
            "the scheduler did not run (is xla_gpu_enable_latency_hiding_scheduler off?)"
        )
    return dumps[0].read_text()
