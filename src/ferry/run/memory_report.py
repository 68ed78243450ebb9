"""What a run says about its memory: the compiled step's analysis, the pinned host bytes planned
and compiled, the device's measured peak, and the levers that shrink a step that does not fit."""

import dataclasses
import resource

import jax

from ferry.config.root import FerryConfig
from ferry.offload.schedule import TransferSchedule, format_bytes
from ferry.train.memory import CompiledMemory


def step_fit_advice(config: FerryConfig) -> str:
    """The levers that shrink a step's memory, in this run's terms."""
    micro = config.train.micro_batch_size
    per_device = config.train.rows_per_device(config.mesh.data_parallel)
    smaller = max(1, (micro or per_device) // 2)
    return (
        f"Shrink the step: offload=full_remat or an offloading preset (now offload={config.offload.name}), "
        f"train.micro_batch_size={smaller} (gradient accumulation), a shorter train.seq_len (now "
        f"{config.train.seq_len}), or compare presets for your hardware with mode=plan target=<gpu or tpu>"
    )


def describe_memory(memory: CompiledMemory | None) -> str:
    """The compiled step's analysis, per device, in one line, with the peak it predicts and how
    the run measures its peak on this backend."""
    if memory is None:
        return "compiled step: no memory analysis on this backend"
    platform = jax.devices()[0].platform
    if platform in RUNTIMES_WITHOUT_TEMPORARIES:
        how = (
            "metrics.jsonl's device_memory_peak_bytes adds these temporaries to memory_stats()'s peak, which on "
            f"{platform.upper()} counts no program's temporaries"
        )
    elif jax.local_devices()[0].memory_stats():
        how = "metrics.jsonl's device_memory_peak_bytes is memory_stats()'s peak"
    else:
        how = f"the {platform.upper()} runtime reports no peak of its own"
    return f"compiled step, per device: {memory.describe()}; step peak {_gib(memory.device_bytes)} ({how})"


# Runtimes whose `memory_stats()["peak_bytes_in_use"]` leaves out a running program's temporaries
# (measured on a TPU v5e, jax 0.10.2: the state alone in every case, whatever the compiled step's
# temporaries; docs/results/tpu-v5e.md, "The memory figures").
RUNTIMES_WITHOUT_TEMPORARIES = frozenset({"tpu"})


@dataclasses.dataclass(frozen=True)
class MemoryPeak:
    """A run's device memory peak: what the runtime reports, and the true figure."""

    runtime_bytes: int  # memory_stats()["peak_bytes_in_use"]
    peak_bytes: int  # the runtime's peak, plus the step's compiled temporaries where it omits them
    host_rss_peak_bytes: int  # this process's peak resident memory, its pinned host buffers included

    def record(self) -> dict[str, int]:
        return {
            "device_memory_peak_bytes": self.peak_bytes,
            "device_memory_runtime_peak_bytes": self.runtime_bytes,
            "host_rss_peak_bytes": self.host_rss_peak_bytes,
        }


def host_bytes_line(schedule: TransferSchedule, memory: CompiledMemory | None) -> str:
    """The schedule's pinned host bytes beside the compiled program's, saying what the latter
    means on this backend."""
    planned = f"pinned host per device: planned {format_bytes(schedule.pinned_host_bytes)} (the schedule)"
    if memory is None:
        return planned + "; compiled: no memory analysis on this backend"
    compiled = f"compiled {format_bytes(memory.host_temporaries)} (the compiled step's host temporaries)"
    if jax.devices()[0].platform == "cpu":
        compiled += (
            "; the CPU backend lowers an offload as a copy within its one memory, so this is what its memory "
            "analysis reports, not a measured pinned host pool"
        )
    return f"{planned}, {compiled}"


def device_memory_peak(memory: CompiledMemory | None) -> MemoryPeak | None:
    """The peak of this process's first device, where the backend reports one: the runtime's
    `peak_bytes_in_use`, plus the compiled step's temporaries on a runtime that leaves them out."""
    device = jax.local_devices()[0]
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    runtime = int(stats["peak_bytes_in_use"])
    omitted = memory.temporaries if memory is not None and device.platform in RUNTIMES_WITHOUT_TEMPORARIES else 0
    return MemoryPeak(runtime, runtime + omitted, host_rss_peak())


def host_rss_peak() -> int:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"
