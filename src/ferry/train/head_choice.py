"""`train.loss_head=auto` for one run's step: the HBM left for the loss head beside the rest of the
step, and the head `ferry.head.auto` chooses within it. `StepRecipe.of` asks here, so a run, a
plan, `mode=compile` and the plan's measurements of the same step choose the same head."""

import jax.numpy as jnp
from jax.sharding import Mesh

from ferry.config.root import FerryConfig
from ferry.head.auto import HeadChoice, HeadFactsCache, HeadShape, Machine, choose_head, machine_of
from ferry.head.loss import AUTO
from ferry.models.base import AbstractModelConfig
from ferry.models.registry import abstract_model
from ferry.offload.policy import Policy
from ferry.offload.schedule import model_schedule
from ferry.sharding import parameters_per_device
from ferry.train.state_layout import StateLayout
from ferry.xla.compile_oom import argument_bytes

GRADIENT_BYTES = 4  # per parameter: the step's float32 gradients


def head_budget(
    config: FerryConfig,
    mesh: Mesh,
    model_config: AbstractModelConfig,
    policy: Policy,
    layout: StateLayout,
    machine: Machine,
) -> int:
    """The HBM per device a loss head may take: the machine's usable memory less the train state
    the step holds (its arguments in HBM), the float32 gradients and the compute-dtype copy of the
    parameters, and the activations the offload policy keeps between the passes (the transfer
    schedule's). An estimate of the step around the head; the compiled step's own check
    (`ferry.train.memory.check_step_fits`) still refuses a step over the device."""
    model = abstract_model(model_config)
    state, _ = argument_bytes(layout.abstract())
    dtype = jnp.dtype(config.train.compute_dtype)
    copies = parameters_per_device(model, mesh) * (GRADIENT_BYTES + dtype.itemsize)
    data_parallel = config.mesh.data_parallel
    schedule = model_schedule(
        model, policy, config.train.rows_per_micro_step(data_parallel), config.train.seq_len, dtype, mesh=mesh
    )
    kept = schedule.save_all_bytes if policy.keep_all else schedule.device_bytes + schedule.pipeline_bytes
    return machine.memory_bytes - state - copies - kept


def step_head_choice(
    config: FerryConfig,
    mesh: Mesh,
    model_config: AbstractModelConfig,
    policy: Policy,
    layout: StateLayout,
    cache: HeadFactsCache | None = None,
) -> HeadChoice | None:
    """auto's head for the step of `config` on `mesh` (None where `train.loss_head` names one)."""
    train = config.train
    if train.loss_head != AUTO:
        return None
    rows = train.rows_per_micro_step(config.mesh.data_parallel)
    shape = HeadShape.of(abstract_model(model_config), rows, train.seq_len, train.compute_dtype, train.z_loss_weight)
    budget = head_budget(config, mesh, model_config, policy, layout, machine_of(mesh))
    return choose_head(train.head, shape, mesh, budget, HeadFactsCache.default() if cache is None else cache)
