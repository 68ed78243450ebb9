"""Peak FLOP/s of the device a run trains on, for MFU: the dense bf16 peaks of the accelerators
ferry knows (`ferry.xla.hardware`), looked up by the device kind JAX reports; a CPU's peak is
measured (a matmul in the run's compute dtype), as no table can know it.

A CPU's measurement swings with what else the machine runs (12.7% to 20.9% MFU between identical
runs when each run measured its own), so it is measured once per machine, dtype and JAX version
and kept under `$XDG_CACHE_HOME/ferry/cpu_peak/` (default `~/.cache`): every later run's MFU is
against the same figure. Delete the file to measure again."""

import datetime
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from ferry.xla.hardware import BF16_PEAK_FLOPS, accelerator_name

# repeats of the one measurement a machine's cache keeps: its best, so a busy moment does not stay
CACHED_REPEATS = 20


def table_peak(device_kind: str) -> tuple[float, str] | None:
    """(peak FLOP/s, accelerator name) of a known device kind, else None."""
    name = accelerator_name(device_kind)
    return None if name is None else (BF16_PEAK_FLOPS[name], name)


def measured_matmul_peak(dtype: str, size: int = 1024, repeats: int = 5) -> float:
    """The best FLOP/s of a [size, size] x [size, size] matmul in `dtype` on the default device."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def machine_key(dtype: str) -> str:
    """What a CPU's matmul peak depends on: the host, its processor, the cores this process may
    use, the dtype and the JAX (and XLA) that runs the matmul; as a short hash."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 0
    parts = (platform.node(), cpu_model(), str(cores), dtype, jax.__version__, platform.machine())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def cpu_model() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def peak_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "ferry" / "cpu_peak"


def cached_cpu_peak(dtype: str, measure: Callable[[str], float] | None = None) -> tuple[float, str]:
    """(this machine's CPU matmul peak in `dtype`, where it comes from): read from the cache, or
    measured now (`measure`, default `CACHED_REPEATS` repeats) and kept there for the next run."""
    path = peak_cache_dir() / f"{machine_key(dtype)}.json"
    try:
        cached = json.loads(path.read_text())
        return float(cached["flops"]), f"{dtype} matmul measured on this CPU on {cached['measured']}, cached in {path}"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not measured yet on this machine (or a damaged file): measure it again
    flops = (measure or (lambda d: measured_matmul_peak(d, repeats=CACHED_REPEATS)))(dtype)
    today = datetime.date.today().isoformat()
    record = {"flops": flops, "measured": today, "dtype": dtype, "cpu": cpu_model(), "host": platform.node()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(record) + "\n")
        partial.replace(path)  # a run reading it beside this one sees all of it or none
    except OSError:
        return flops, f"{dtype} matmul measured on this CPU now (a rough figure: {path} could not be written)"
    return flops, f"{dtype} matmul measured on this CPU on {today}, cached in {path}"


def device_peak(
    device: jax.Device, dtype: str, measure: Callable[[str], float] | None = None
) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, where it comes from); a CPU's from `cached_cpu_peak`."""
    known = table_peak(device.device_kind)
    if known is not None:
        return known[0], f"{known[1]} dense bf16 peak"
    if device.platform == "cpu":
        return cached_cpu_peak(dtype, measure)
    return None, f"no peak known for device kind {device.device_kind!r}: MFU is not reported"
