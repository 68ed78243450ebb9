"""What the one-kernel benchmarks on a chip (`attention_tpu.py`, `moe_tpu.py`) share: the median
time of a jitted call, the largest gradient difference from a reference, the machine a report was
measured on, and writing the report."""

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp


def median_ms(fn: Callable[..., tuple[jax.Array, ...]], args: tuple[jax.Array, ...], repeats: int) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls, after one warm-up (the compile)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def largest_difference(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> float:
    """The largest |a - b| over the gradients, relative to the largest |b|."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30)))
    return worst


def machine(interpret: bool, repeats: int) -> dict:
    """Where and how a report was measured: backend, device, jax, interpret mode, repeats, date."""
    return {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "interpret": interpret,
        "repeats": repeats,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def write_report(report: dict, out: Path | None) -> None:
    """The report as JSON at `out` (none: nowhere), saying where."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
