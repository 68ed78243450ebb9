"""Multi-controller start-up: one process per host joins JAX's distributed runtime before the
backend starts, after which `jax.devices()` lists every host's devices and one jitted step runs
SPMD over all of them."""

import os
from collections.abc import Mapping

import jax

from ferry.train.config import DistributedConfig


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
