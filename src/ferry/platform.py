"""XLA flags and environment for the backend a run targets, applied before the backend starts.

XLA reads `XLA_FLAGS` (CPU and GPU), `LIBTPU_INIT_ARGS` (TPU) and `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`
(the GPU's pinned host pool) once, when JAX first touches a device, so they must be set before
that; setting them later would silently do nothing, which is why `apply_platform` refuses.
"""

import dataclasses
import os
from collections.abc import Mapping

_FLAG_VARIABLE = {"cpu": "XLA_FLAGS", "gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}


@dataclasses.dataclass(frozen=True)
class PlatformConfig:
    """`name`: cpu | gpu | tpu. `xla_flags`: flag name -> value; `env`: variable -> value."""

    name: str = "cpu"
    xla_flags: Mapping[str, object] = dataclasses.field(default_factory=dict)
    env: Mapping[str, object] = dataclasses.field(default_factory=dict)
    cpu_devices: int | None = None  # CPU only: split the host into this many virtual devices

    def __post_init__(self) -> None:
        if self.name not in _FLAG_VARIABLE:
            raise ValueError(f"platform.name is {self.name!r}; use one of {', '.join(_FLAG_VARIABLE)}")
        if self.cpu_devices is not None and (self.name != "cpu" or self.cpu_devices < 1):
            raise ValueError(f"platform.cpu_devices={self.cpu_devices} needs platform=cpu and a count of at least 1")

    @property
    def flag_variable(self) -> str:
        return _FLAG_VARIABLE[self.name]

    def flag_string(self) -> str:
        """The flags as XLA parses them: --name=value, booleans lower-case."""
        flags = dict(self.xla_flags)
        if self.cpu_devices is not None:
            flags["xla_force_host_platform_device_count"] = self.cpu_devices
        return " ".join(f"--{name}={_flag_value(value)}" for name, value in sorted(flags.items()))

    def environment(self, current: Mapping[str, str]) -> dict[str, str]:
        """The variables to set: the flags appended to any the user already exported (so an
        explicit XLA_FLAGS still wins on conflicts, being read last), plus `env`."""
        out = {name: str(value) for name, value in self.env.items()}
        flags = self.flag_string()
        if flags:
            existing = current.get(self.flag_variable, "")
            out[self.flag_variable] = f"{flags} {existing}".strip()
        return out


def _flag_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def backend_started() -> bool:
    """Has JAX created a backend in this process (after which XLA ignores new flags)?"""
    from jax._src import xla_bridge  # no public API answers this

    return xla_bridge.backends_are_initialized()


def apply_platform(config: PlatformConfig) -> dict[str, str]:
    """Export the platform's variables into this process; return them (for printing)."""
    if backend_started():
        raise RuntimeError(
            "the JAX backend has already started, so XLA flags can no longer take effect; "
            "apply the platform config before any JAX computation"
        )
    variables = config.environment(os.environ)
    os.environ.update(variables)
    if config.name == "cpu":  # run on the CPU even where an accelerator's plugin is installed
        import jax

        jax.config.update("jax_platforms", "cpu")
    return variables
