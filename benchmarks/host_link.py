"""The host link measured inside one compiled program, as ferry's offloads use it: device->host,
host->device and both at once, in GB/s.

A copy timed on its own (`jax.device_put` of one array to `pinned_host`) is not what a train
step sees: its output is a fresh pinned buffer each call, and on a TPU v5e that runs at under
1 GB/s where the same bytes inside a train step move at about 15 GB/s. So the probe is one
program of three scans over `chunks` arrays, the copies' host buffers being the program's own
temporaries, as an offloaded step's are:

1. each chunk to host (device->host only);
2. each host chunk back while each device chunk goes to host again (both at once);
3. the second host copies back (host->device only).

Two readings: the probe's wall time beside two shorter programs (phase 1 + 3 alone, phase 3
from a host argument alone), and, where a profiler trace is readable (TPU), each copy's start
and done from the trace (`ferry.xla.profile_trace`). The trace is the finer one; both are reported.
"""

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from ferry.offload.engine import to_memory


@dataclasses.dataclass(frozen=True)
class LinkBandwidth:
    to_host_gbps: float
    to_device_gbps: float
    both_gbps: float  # bytes both ways together per second while both directions run
    chunk_bytes: int
    chunks: int
    method: str  # "trace" or "wall clock"

    def describe(self) -> str:
        return (
            f"device->host {self.to_host_gbps:.1f} GB/s, host->device {self.to_device_gbps:.1f} GB/s, both at once "
            f"{self.both_gbps:.1f} GB/s together ({self.chunks} copies of {self.chunk_bytes / 2**20:.0f} MiB each way, "
            f"{self.method})"
        )


def _chunks(chunks: int, chunk_bytes: int) -> jax.Array:
    cols = 4096
    rows = max(1, chunk_bytes // (2 * cols))
    return jnp.ones((chunks, rows, cols), jnp.bfloat16)


def _to_host(x: jax.Array) -> jax.Array:
    return to_memory(x, "pinned_host")


def _to_device(x: jax.Array) -> jax.Array:
    return to_memory(x, "device")


def round_trip(x: jax.Array, both: bool = True) -> jax.Array:
    """Phases 1, 2 (when `both`) and 3 of the probe; a scalar, so nothing leaves the device."""

    def offload(carry: jax.Array, chunk: jax.Array) -> tuple[jax.Array, jax.Array]:
        return carry, _to_host(chunk + carry.astype(chunk.dtype))

    def swap(carry: jax.Array, pair: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        stored, fresh = pair
        back = _to_device(stored)
        return carry + back[0, 0].astype(jnp.float32), _to_host(fresh * 2)

    def reload(carry: jax.Array, stored: jax.Array) -> tuple[jax.Array, None]:
        return carry + _to_device(stored)[-1, -1].astype(jnp.float32), None

    zero = jnp.zeros((), jnp.float32)
    _, stored = jax.lax.scan(offload, zero, x)
    total = zero
    if both:
        total, stored = jax.lax.scan(swap, zero, (stored, x))
    total, _ = jax.lax.scan(reload, total, stored)
    return total


def reload_only(stored: jax.Array) -> jax.Array:
    """Phase 3 alone, from a host argument."""

    def reload(carry: jax.Array, chunk: jax.Array) -> tuple[jax.Array, None]:
        return carry + _to_device(chunk)[-1, -1].astype(jnp.float32), None

    return jax.lax.scan(reload, jnp.zeros((), jnp.float32), stored)[0]


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_wall_clock(chunks: int = 8, chunk_bytes: int = 256 * 2**20, repeats: int = 5) -> LinkBandwidth:
    """The link from three programs' wall times: reload alone (h), round trip (d + h), the whole
    probe (d + both + h). Compute in the probe is a few elementwise passes, small beside the copies."""
    x = _chunks(chunks, chunk_bytes)
    moved = x.nbytes
    host = jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
    h = _median_seconds(jax.jit(reload_only), host, repeats=repeats)
    d_h = _median_seconds(jax.jit(lambda v: round_trip(v, both=False)), x, repeats=repeats)
    d_b_h = _median_seconds(jax.jit(round_trip), x, repeats=repeats)
    d, b = max(d_h - h, 1e-9), max(d_b_h - d_h, 1e-9)
    return LinkBandwidth(
        moved / d / 1e9, moved / h / 1e9, 2 * moved / b / 1e9, x.nbytes // chunks, chunks, "wall clock"
    )


def measure_traced(chunks: int = 8, chunk_bytes: int = 256 * 2**20, directory: Path | None = None) -> LinkBandwidth:
    """The link from a profiler trace of the probe: per direction, the bytes its copies moved over
    the time any of them was in flight, in each phase."""
    x = _chunks(chunks, chunk_bytes)
    copies = sorted(_traced_copies(round_trip, x, directory), key=lambda c: c.start_ns)
    if len(copies) < 4 * chunks:
        raise RuntimeError(f"the trace shows {len(copies)} host copies of the probe, expected {4 * chunks}")
    first, swap, last = copies[:chunks], copies[chunks : 3 * chunks], copies[3 * chunks : 4 * chunks]
    return LinkBandwidth(
        _rate(first),
        _rate(last),
        _rate(swap),
        x.nbytes // chunks,
        chunks,
        "trace",
    )


@dataclasses.dataclass(frozen=True)
class Concurrency:
    """The link when `ways` copies of `total_bytes / ways` each are in flight at once, per direction."""

    ways: int
    to_host_gbps: float
    to_device_gbps: float
    copies: int  # host copies the trace shows, both directions

    def describe(self) -> str:
        return (
            f"{self.ways:3d} at once: device->host {self.to_host_gbps:5.1f} GB/s, "
            f"host->device {self.to_device_gbps:5.1f} GB/s ({self.copies} copies)"
        )


def split_round_trip(x: jax.Array) -> jax.Array:
    """Every slice of `x` to host at once, then (after a barrier) every one back at once; a scalar."""
    stored = [_to_host(x[i] * 2) for i in range(x.shape[0])]
    stored = jax.lax.optimization_barrier(stored)
    return sum(_to_device(s)[-1, -1].astype(jnp.float32) for s in stored)


def measure_concurrency(
    ways: tuple[int, ...] = (1, 2, 4, 8, 16), total_bytes: int = 2**30, directory: Path | None = None
) -> list[Concurrency]:
    """Does the link move more when several copies are in flight? The same bytes split `ways`
    ways, each split's copies issued together in one program, rates read from a trace: one copy
    may not fill the link that several fill (an offloaded layer's tensors can be split so)."""
    results = []
    for n in ways:
        copies = _traced_copies(split_round_trip, _chunks(n, total_bytes // n), directory)
        stores = [c for c in copies if c.direction == "to host"]
        reloads = [c for c in copies if c.direction == "to device"]
        results.append(Concurrency(n, _rate(stores), _rate(reloads), len(copies)))
    return results


def _traced_copies(probe, x: jax.Array, directory: Path | None = None) -> list:
    """The host copies of one run of `probe(x)` (compiled and run once before), from a profiler
    trace written under `directory` (a fresh temporary one by default)."""
    from ferry.xla.profile_trace import newest_xplane, step_profiles

    compiled = jax.jit(probe)
    jax.block_until_ready(compiled(x))
    folder = Path(tempfile.mkdtemp(prefix="ferry-link-", dir=directory))
    with jax.profiler.trace(str(folder)):
        jax.block_until_ready(compiled(x))
    return [c for p in step_profiles(newest_xplane(folder)) for c in p.copies]


def _rate(copies) -> float:
    """Bytes over the time any of `copies` was in flight, in GB/s."""
    from ferry.xla.profile_trace import busy_ns

    busy = busy_ns((c.start_ns, c.end_ns) for c in copies)
    return sum(c.bytes for c in copies) / busy if busy else float("nan")  # bytes per ns = GB/s


if __name__ == "__main__":  # python benchmarks/host_link.py: the probe, then the link by concurrency
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    print(measure_traced().describe(), flush=True)
    print(measure_wall_clock().describe(), flush=True)
    for row in measure_concurrency():
        print(row.describe(), flush=True)
