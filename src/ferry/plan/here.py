"""This machine as a planner target: what `offload=auto` in a run (`ferry.plan.in_run`) plans for.

A run plans for the devices it trains on. On a TPU or GPU the planner knows (`ferry.xla.targets`),
the target is that accelerator's facts (its HBM, host link, peak: the same that `mode=plan
target=<it>` plans with) with the run's own devices to compile for, instead of compile-only ones:
the candidates are compiled as the run compiles its step. On a CPU the target is the CPU: its
memory is the host RAM available (shared by its devices), its peak a measured matmul
(`ferry.xla.peak`), and it has no host memory to copy to (a CPU's pinned host is the same RAM,
and its copies are identities), so the plan's choices are device or remat."""

import dataclasses
from typing import Any, ClassVar

import jax
import psutil

from ferry.xla.hardware import accelerator_name
from ferry.xla.peak import device_peak
from ferry.xla.targets import TARGETS, GpuTarget, Target, TpuTarget

CPU = "cpu"  # the CPU target's name, in its plans


@dataclasses.dataclass(frozen=True)
class CpuTarget(Target):
    """This machine's CPU devices. The copies of an offload are identities on a CPU, so they cost
    nothing (`host_link_bandwidth` infinite) but also free nothing: the plan offers no offload
    (`offers_copies`); virtual CPU devices (`platform.cpu_devices`) share one memory, so a
    collective is a copy within it and is not timed (infinite `interconnect_bandwidth`)."""

    platform: ClassVar[str] = CPU
    # of the RAM available when the run starts: the data pipeline, the host's copy of the batches,
    # checkpoints being written and Python itself live in the same memory
    hbm_headroom: ClassVar[float] = 0.25
    local: tuple[Any, ...] = ()

    def devices(self, num_devices: int) -> list[Any]:
        return list(self.local[:num_devices])

    def topology(self, num_devices: int) -> str:
        return f"{num_devices} CPU devices"


@dataclasses.dataclass(frozen=True)
class LocalTpu(TpuTarget):
    """A TPU the planner knows, its chips this machine's."""

    local: tuple[Any, ...] = ()

    def devices(self, num_devices: int) -> list[Any]:
        return list(self.local[:num_devices])


@dataclasses.dataclass(frozen=True)
class LocalGpu(GpuTarget):
    """An NVIDIA GPU the planner knows, its devices this machine's; compiled as a run compiles
    (with autotuning: there is a device to time kernels on)."""

    local: tuple[Any, ...] = ()

    def devices(self, num_devices: int) -> list[Any]:
        return list(self.local[:num_devices])

    def compile_options(self, xla_flags: dict[str, object]) -> dict[str, object]:
        return dict(xla_flags)


def this_machine(compute_dtype: str) -> Target:
    """The target a run on this machine's devices plans for (see the module); an accelerator the
    planner has no facts of is a ValueError naming it."""
    devices = tuple(jax.devices())
    first = devices[0]
    if first.platform == CPU:
        peak, _ = device_peak(first, compute_dtype)
        assert peak is not None  # a CPU's peak is measured, never unknown
        memory = psutil.virtual_memory().available // len(jax.local_devices())
        return CpuTarget(
            CPU,
            "CPU",
            memory,
            host_link_bandwidth=float("inf"),
            bf16_peak_flops=peak,
            interconnect_bandwidth=float("inf"),
            domain_size=len(devices),
            local=devices,
        )
    name = accelerator_name(first.device_kind)
    if name is None:
        raise ValueError(f"the planner has no facts of device kind {first.device_kind!r}")
    known = TARGETS[name]
    local = LocalTpu if isinstance(known, TpuTarget) else LocalGpu
    fields = {field.name: getattr(known, field.name) for field in dataclasses.fields(known)}
    return local(**fields, local=devices)


def hbm_headroom_of(target_name: str) -> float:
    """The share of memory auto leaves free on the target a plan names: a named accelerator's,
    or the CPU's (`CpuTarget`)."""
    return CpuTarget.hbm_headroom if target_name == CPU else TARGETS[target_name].hbm_headroom


def offers_copies(target: Target) -> bool:
    """Whether copying to pinned host frees the target's device memory (not on a CPU: `CpuTarget`)."""
    return target.platform != CPU
