"""ferry: an Equinox LLM trainer with explicit activation offloading to pinned host memory.

Importing ferry defines things and does nothing else: keeping JAX to the CPU on a machine without
an accelerator (`ferry.cpu_only.keep_jax_to_the_cpu`) and registering configs with Hydra happen
where a run starts (the launchers, the benchmarks, the tests' conftest)."""

from ferry.offload import Policy, offloaded, tag

__all__ = ["Policy", "offloaded", "tag"]
