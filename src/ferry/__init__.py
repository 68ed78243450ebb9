"""ferry: an Equinox LLM trainer with explicit activation offloading to pinned host memory."""

from ferry.cpu_only import keep_jax_to_the_cpu

keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine

from ferry.offload import Policy, offloaded, tag  # noqa: E402

__all__ = ["Policy", "offloaded", "tag"]
