"""What a run says about its memory: the compiled step's analysis, the pinned host bytes planned
and compiled, the device's measured peak, and the levers that shrink a step that does not fit."""

import jax

from ferry.memory import CompiledMemory
from ferry.schedule import TransferSchedule, format_bytes
from ferry.train.config import FerryConfig


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
    """The compiled step's memory analysis, per device, in one line."""
    if memory is None:
        return "compiled step: no memory analysis on this backend"
    return "compiled step, per device: " + memory.describe()


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


def device_memory_peak() -> int | None:
    """Peak bytes in use on this process's first device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])
