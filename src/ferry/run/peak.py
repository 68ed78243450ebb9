"""Peak FLOP/s of the device a run trains on, for MFU: the dense bf16 peaks of the accelerators
ferry knows (`ferry.xla.hardware`), looked up by the device kind JAX reports; a CPU's peak is
measured (a matmul in the run's compute dtype), as no table can know it."""

import time

import jax
import jax.numpy as jnp

from ferry.xla.hardware import BF16_PEAK_FLOPS, accelerator_name


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


def device_peak(device: jax.Device, dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, where it comes from)."""
    known = table_peak(device.device_kind)
    if known is not None:
        return known[0], f"{known[1]} dense bf16 peak"
    if device.platform == "cpu":
        return measured_matmul_peak(dtype), f"measured {dtype} matmul on this CPU"
    return None, f"no peak known for device kind {device.device_kind!r}: MFU is not reported"
