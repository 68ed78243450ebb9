"""Multi-controller start-up: one process per host joins JAX's distributed runtime before the
backend starts, after which `jax.devices()` lists every host's devices and one jitted step runs
SPMD over all of them."""

import dataclasses
import os
from collections.abc import Mapping

import jax

from ferry.errors import ConfigError


def check_address(address: str) -> None:
    """host:port, the port a number from 1 to 65535 (an IPv6 host in brackets: [::1]:1234)."""
    host, colon, port = address.rpartition(":")
    fix = "give it as host:port, e.g. distributed.coordinator_address=node0:12345"
    if not colon or not host or host in ("[", "[]"):
        raise ConfigError(f"distributed.coordinator_address={address} has no port; {fix}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"distributed.coordinator_address={address}: the port {port!r} is not a number from 1 to 65535; {fix}"
        )
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigError(f"distributed.coordinator_address={address}: an IPv6 host goes in brackets, e.g. [::1]:12345")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """One process per host (multi-controller JAX). Leave everything unset on one host; under
    SLURM `jax.distributed.initialize()` reads the job's environment by itself."""

    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None  # how many processes (one a host) the run has in all
    process_id: int | None = None  # this process's rank, 0 to num_processes - 1 (0 writes the metrics)

    def __post_init__(self) -> None:
        if self.coordinator_address is not None:
            check_address(self.coordinator_address)
        given = [v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise ConfigError(
                "distributed.coordinator_address, distributed.num_processes and distributed.process_id "
                "go together: set all three, or none (single host, or SLURM)"
            )
        if (
            self.process_id is not None
            and self.num_processes is not None
            and not 0 <= self.process_id < self.num_processes
        ):
            raise ConfigError(
                f"distributed.process_id {self.process_id} must lie in [0, num_processes={self.num_processes})"
            )

    @property
    def explicit(self) -> bool:
        return self.coordinator_address is not None


def under_slurm(environ: Mapping[str, str] = os.environ) -> bool:
    """A SLURM job step with several tasks (one per host): JAX reads its coordinator, process
    count and rank from the SLURM environment."""
    return "SLURM_JOB_ID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1


def initialize(config: DistributedConfig, environ: Mapping[str, str] = os.environ) -> str:
    """Join the distributed runtime when the config or the cluster asks for it; say how."""
    if config.explicit:
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
        return f"process {config.process_id} of {config.num_processes}, coordinator {config.coordinator_address}"
    if under_slurm(environ):
        jax.distributed.initialize()
        return f"process {jax.process_index()} of {jax.process_count()} (SLURM)"
    return "single process"


def is_main_process() -> bool:
    """Process 0 writes the run directory, the metrics and the console output."""
    return jax.process_index() == 0
