"""ferry: an Equinox LLM trainer with explicit activation offloading to pinned host memory."""

from ferry.offload import Policy, offloaded, tag

__all__ = ["Policy", "offloaded", "tag"]
