"""Will a run fit on this machine? Twice answered before anything is allocated: the training
state from shapes alone, in seconds (`check_fits`), then the whole compiled step from XLA's memory
analysis, activations included (`check_step_fits`)."""

import dataclasses
from typing import Any

import jax
import psutil

from ferry.config.train import HOST, StatePlacement
from ferry.errors import FerryError


class InsufficientMemoryError(FerryError, RuntimeError):
    """The run needs more memory than the devices (or, on CPU, the host) have."""


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the training state on the device and in pinned host memory: float32
    grads and a bf16 compute copy on the device; the float32 master weights (`offload.params`)
    and AdamW's two moments (`offload.optimizer`, float32 or `train.adam_moments_dtype`) where the
    offload config puts them."""

    device: int
    host: int

    @classmethod
    def of(cls, placement: StatePlacement) -> "StateBytes":
        """The bytes of a state placed as `placement` (`offload.optimizer`, `offload.params`) says."""
        both_moments = 2 * placement.moment_bytes
        master = 4 if placement.params == HOST else 0
        moments = both_moments if placement.optimizer == HOST else 0
        return cls(device=4 + 2 + (4 - master) + (both_moments - moments), host=master + moments)

    def describe(self) -> str:
        where = f"{self.device} B per parameter on the device"
        return where + (f", {self.host} B in host memory" if self.host else "")


def available_bytes() -> tuple[int, str, bool]:
    """Memory the training state can use, where it is, and whether that is the host's RAM
    (the CPU backend: device and host placements share it)."""
    devices = jax.local_devices()
    stats = devices[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] * len(devices), f"{len(devices)} x {devices[0].device_kind} HBM", False
    return psutil.virtual_memory().available, "host RAM available to the CPU backend", True


def check_fits(
    model_name: str, parameters_per_device: int, size: str, suggestion: str, per_parameter: StateBytes
) -> None:
    """Refuse a model whose training state alone exceeds this host's device memory (or its
    host-placed part the host's RAM); `size` describes the model, `parameters_per_device` is what
    one device holds of it under the mesh, `per_parameter` where its bytes live."""
    devices = len(jax.local_devices())
    on_device = parameters_per_device * per_parameter.device * devices
    on_host = parameters_per_device * per_parameter.host * devices
    have, where, shared = available_bytes()
    needed = on_device + on_host if shared else on_device
    state = (
        f"its fp32 parameters, gradients, AdamW state and bf16 compute copy ({per_parameter.describe()}, "
        "before activations)"
    )
    if needed > have:
        raise InsufficientMemoryError(
            f"model {model_name} has {size}: {state} need {needed / 2**30:,.1f} GiB on this host's {devices} "
            f"device(s) with this mesh, but this machine has {have / 2**30:,.1f} GiB ({where}). {suggestion}"
        )
    host_ram = psutil.virtual_memory().available
    if not shared and on_host > host_ram:
        raise InsufficientMemoryError(
            f"model {model_name} has {size}: {state} need {on_host / 2**30:,.1f} GiB of host memory for this "
            f"host's {devices} device(s), but it has {host_ram / 2**30:,.1f} GiB available. Keep part of the "
            f"state on the device (offload.params=device or offload.optimizer=device). {suggestion}"
        )


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """What one device holds while running a compiled program, from XLA's memory analysis."""

    arguments: int
    outputs: int
    aliased: int  # outputs written into donated arguments' buffers
    temporaries: int
    code: int
    host_temporaries: int  # pinned host memory (offloaded activations)

    @classmethod
    def of(cls, compiled: Any) -> "CompiledMemory | None":
        """The analysis of a `jax.stages.Compiled`, or None where the backend has none."""
        analysis = compiled.memory_analysis()
        if analysis is None:
            return None
        read = lambda name: int(getattr(analysis, name, 0) or 0)
        return cls(
            arguments=read("argument_size_in_bytes"),
            outputs=read("output_size_in_bytes"),
            aliased=read("alias_size_in_bytes"),
            temporaries=read("temp_size_in_bytes"),
            code=read("generated_code_size_in_bytes"),
            host_temporaries=read("host_temp_size_in_bytes"),
        )

    @property
    def device_bytes(self) -> int:
        """Peak device memory of one step: arguments + temporaries + outputs - aliases + code."""
        return self.arguments + self.temporaries + self.outputs - self.aliased + self.code

    def describe(self) -> str:
        parts = {
            "arguments": self.arguments,
            "outputs": self.outputs,
            "aliased": self.aliased,
            "temporaries": self.temporaries,
            "code": self.code,
            "host temporaries": self.host_temporaries,
        }
        return ", ".join(f"{name} {_gib(value)}" for name, value in parts.items())


def step_capacity() -> tuple[int | None, int, str]:
    """(bytes one device may use, or None where its memory is the host's; host bytes available;
    where that is). A device's free bytes come from its `memory_stats()`."""
    device = jax.local_devices()[0]
    stats = device.memory_stats()
    host = psutil.virtual_memory().available
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, host, f"{device.device_kind} memory_stats()"
    return None, host, "host RAM available (the CPU backend's devices live in it)"


def check_step_fits(memory: CompiledMemory, advice: str) -> None:
    """Refuse a compiled step that cannot run here, before its state is allocated: on GPU and
    TPU each device's figure against its free memory and the host temporaries of all local
    devices against the host's RAM; on CPU, where every device lives in host RAM, all of it
    against the RAM available."""
    devices = len(jax.local_devices())
    per_device, host, where = step_capacity()
    breakdown = (
        f"arguments {_gib(memory.arguments)} + temporaries {_gib(memory.temporaries)} + outputs "
        f"{_gib(memory.outputs)} - aliased {_gib(memory.aliased)}"
    )
    if per_device is not None and memory.device_bytes > per_device:
        raise InsufficientMemoryError(
            f"the compiled train step needs {_gib(memory.device_bytes)} per device ({breakdown}) but a device has "
            f"{_gib(per_device)} free ({where}). {advice}"
        )
    on_host = devices * (memory.host_temporaries + (memory.device_bytes if per_device is None else 0))
    if on_host > host:
        what = "host temporaries" if per_device is not None else f"{breakdown} + host temporaries"
        raise InsufficientMemoryError(
            f"the compiled train step needs {_gib(on_host)} of host memory ({devices} device(s) x {what} "
            f"{_gib(memory.host_temporaries)}) but this host has {_gib(host)} available ({where}). {advice}"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
