"""Compile ferry's real train step for a GPU or TPU cluster on a machine without one, and read what
the compiler decided: bytes per device in HBM and in pinned host memory, FLOPs, and whether the
host copies it scheduled are hidden behind compute.

The step is the one training runs (its `StepRecipe`), lowered with `ShapeDtypeStruct` inputs in
their real shardings over a mesh of compile-only devices; nothing is allocated.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from ferry.config.root import FerryConfig
from ferry.models.registry import abstract_model
from ferry.offload.engine import LAYER_INPUT, Policy
from ferry.offload.schedule import TransferSchedule, model_schedule
from ferry.plan import verify  # verify.verify_program, looked up when called (tests wrap it)
from ferry.plan.estimate import collective_traffic
from ferry.plan.memory_plan import MemoryPlan, PlanError
from ferry.plan.replay import LayerGroupTrace, backward_reads
from ferry.plan.transfers import TransferSummary, time_transfers
from ferry.sharding import MESH_AXES, MeshConfig, attention_platform
from ferry.train.compiled_step import CompiledStep
from ferry.train.recipe import StepRecipe
from ferry.train.state_layout import StateLayout
from ferry.train.state_memory import state_writes
from ferry.train.step_flops import training_flops
from ferry.xla.compile_oom import StepOverHbm
from ferry.xla.hlo_flops import matmul_count, matmul_flops, xla_rematerialised
from ferry.xla.scheduler_costs import ProfileCache
from ferry.xla.targets import GpuTarget, Target


def compile_only_mesh(target: Target, mesh_config: MeshConfig) -> Mesh:
    """A mesh of `mesh_config`'s shape over compile-only devices of `target` (needs the CUDA
    plugin or libtpu: `pip install -e ".[plan]"`)."""
    devices = np.array(target.devices(mesh_config.num_devices)).reshape(tuple(mesh_config.shape.values()))
    return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def for_target(model_config: Any, target: Target) -> Any:
    """The model as it runs on `target` where its config leaves a choice to the backend (this
    process's backend is the CPU): the experts' grouped matmul is JAX's Pallas megablox kernels
    on a TPU, tiles on a GPU, whose XLA backend expands `ragged_dot` and its transposes into
    every expert on every row."""
    return model_config.for_platform(target.platform)


@dataclasses.dataclass(frozen=True)
class CompiledTrainStep:
    """The train step of a config compiled for one mesh (compile-only devices, or a real GPU's):
    what the planner reads, and what a GPU check runs."""

    step: CompiledStep  # compiled by `ferry.train.compiled_step`, as a run compiles it
    model_config: Any  # the model as compiled (`for_target`)
    mesh: Mesh
    options: dict[str, object]  # the per-compile XLA options

    @property
    def compiled(self) -> Any:
        """The `jax.stages.Compiled`: (state arrays, tokens) -> (state arrays, metrics), both donated."""
        return self.step.compiled

    @property
    def layout(self) -> StateLayout:
        return self.step.layout

    @property
    def priced(self) -> bool:
        """XLA's scheduler timed the ops with ferry's cost model."""
        return self.step.priced

    @property
    def seconds(self) -> float:
        """Lowering and compiling on this machine."""
        return self.step.seconds

    @property
    def profile_cached(self) -> bool:
        """The cost model's profile came from its cache (one compile)."""
        return self.step.profile_cached

    def run(self, arrays: Any, tokens: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        """One step on a real mesh: the state's arrays (donated) and a batch (donated) in, the
        next state's arrays and the metrics out."""
        state, metrics = self.compiled(arrays, tokens)
        return eqx.filter(state, eqx.is_array), metrics


def compile_config_step(
    config: FerryConfig,
    target: Target | None,
    policy: Policy,
    mesh: Mesh,
    options: Mapping[str, object],
    scheduler_costs: bool = False,
    costs_cache: ProfileCache | None = None,
) -> CompiledTrainStep:
    """Compile the step training runs (its `StepRecipe`, compiled as a run compiles it) from the
    state's shapes alone, over `mesh`, with the per-compile XLA `options`, the model as it runs
    on `target` (None: as configured, for this process's backend). `scheduler_costs`: on a GPU
    target, XLA's scheduler times the ops with ferry's cost model (`ferry.xla.scheduler_costs`,
    as `platform.scheduler_costs=ferry` runs do; its profile kept in `costs_cache`)."""
    model_config = config.model if target is None else for_target(config.model, target)
    recipe = StepRecipe.of(config, mesh, model_config, policy)  # offload.optimizer/params: part maybe on host
    scheduler = target if scheduler_costs and isinstance(target, GpuTarget) else None
    where = f"{mesh.size} x {target.description if target else mesh.devices.flat[0].device_kind}"
    step = recipe.compile(scheduler, costs_cache, options, where)
    return CompiledTrainStep(step, model_config, mesh, dict(options))


def plan_memory(
    config: FerryConfig,
    target: Target,
    policy: Policy,
    policy_name: str,
    capacity_bytes: int | None = None,
    xla_flags: Mapping[str, object] | None = None,
    host_capacity_bytes: int | None = None,
    scheduler_costs: bool = False,
    costs_cache: ProfileCache | None = None,
) -> MemoryPlan:
    """Compile the train step of `config` under `policy` for `target` with the XLA flags a real
    run on it uses (`xla_flags`, from its platform preset), on compile-only devices, and read it
    (`read_plan`). `scheduler_costs`: on a GPU target, XLA's scheduler times the ops with ferry's
    cost model (`ferry.xla.scheduler_costs`, as `platform.scheduler_costs=ferry` runs do; its
    profile kept in `costs_cache`)."""
    mesh = compile_only_mesh(target, config.mesh)
    options = target.compile_options(dict(xla_flags or {}))
    try:
        step = compile_config_step(config, target, policy, mesh, options, scheduler_costs, costs_cache)
    except StepOverHbm as over:
        return out_of_memory_plan(over, config, target, policy_name, options, capacity_bytes, host_capacity_bytes)
    return read_plan(step, config, target, policy, policy_name, capacity_bytes, host_capacity_bytes)


def out_of_memory_plan(
    over: StepOverHbm,
    config: FerryConfig,
    target: Target,
    policy_name: str,
    options: Mapping[str, object],
    capacity_bytes: int | None = None,
    host_capacity_bytes: int | None = None,
) -> MemoryPlan:
    """The plan of a step XLA refused to compile over HBM: its OOM row. The compiler's figure is
    its temporaries; the arguments are the state's and the batch's; the FLOPs are the model's
    (what `offload=auto` predicts its other candidates from, with no program to count them in)."""
    model_flops = model_flops_per_device(config, target)
    return MemoryPlan(
        target=target.name,
        mesh=config.mesh.describe(),
        policy=policy_name,
        argument_bytes=over.argument_bytes,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=over.oom.needed_bytes,
        host_bytes=over.host_argument_bytes,
        flops=model_flops,
        matmuls=0,
        capacity_bytes=target.hbm_bytes if capacity_bytes is None else capacity_bytes,
        host_capacity_bytes=host_capacity_bytes,
        compile_options=tuple(sorted(options.items())),
        transfers=(),
        transfer_summary=TransferSummary(0, 0, 0.0, 0.0, 0.0),
        compile_seconds=over.seconds,
        model_flops=model_flops,
        matmul_rate=target.matmul_rate,
        compile_oom=over.oom.describe(),
    )


def read_plan(
    step: CompiledTrainStep,
    config: FerryConfig,
    target: Target,
    policy: Policy,
    policy_name: str,
    capacity_bytes: int | None = None,
    host_capacity_bytes: int | None = None,
) -> MemoryPlan:
    """What a compiled train step needs on `target`: its memory and host copies, timed on the
    target. An offloading policy whose program has no pinned host bytes is an error: the
    offload was dropped somewhere, and a plan that silently keeps it on device would be a lie.
    The program is then verified (`ferry.plan.verify`): every offloaded tensor's copies are in
    it, and every host slice in a loop walks the way its index goes; a failed check is a
    `CompiledProgramError` naming the tensor, its layer group and what the program does instead.
    The layers are traced with the attention kernel the target runs (`attention_platform`)."""
    with attention_platform(target.platform):
        return _read_plan(step, config, target, policy, policy_name, capacity_bytes, host_capacity_bytes)


def _read_plan(
    step: CompiledTrainStep,
    config: FerryConfig,
    target: Target,
    policy: Policy,
    policy_name: str,
    capacity_bytes: int | None,
    host_capacity_bytes: int | None,
) -> MemoryPlan:
    memory = step.compiled.memory_analysis()
    host = _host_bytes(memory)
    offloads = any(placement == "offload" for placement in dict(policy.placements).values())
    if offloads and host == 0:
        raise PlanError(
            f"policy {policy_name} offloads tensors but the program compiled for {target.name} keeps no bytes "
            "in pinned host memory: the offload was dropped"
        )
    hlo = step.compiled.as_text()
    flops, bound = matmul_flops(hlo), matmul_flops(hlo, bound=True)
    schedule = _schedule(config, step.model_config, policy, step.mesh)
    layout = step.layout
    writes = state_writes(layout.model, layout.placement, layout.sharding.model)
    copy_names = _offloaded_bytes(schedule) | {name: write.bytes for name, write in writes.items()}
    transfers, summary = time_transfers(hlo, target, copy_names)
    verification = verify.verify_program(
        hlo,
        schedule,
        config.micro_steps,
        BackwardReads(config, step.model_config, policy),
        f"policy {policy_name} compiled for {target.name}",
        writes,
    )
    return MemoryPlan(
        target=target.name,
        mesh=config.mesh.describe(),
        policy=policy_name,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        host_bytes=host,
        flops=flops,
        flops_bound=None if bound == flops else bound,
        matmuls=matmul_count(hlo),
        xla_rematerialised=xla_rematerialised(hlo),
        capacity_bytes=target.hbm_bytes if capacity_bytes is None else capacity_bytes,
        host_capacity_bytes=host_capacity_bytes,
        compile_options=tuple(sorted(step.options.items())),
        scheduler_costs="ferry" if step.priced else "xla",
        transfers=transfers,
        transfer_summary=summary,
        compile_seconds=step.seconds,
        profile_cached=step.profile_cached,
        verification=verification,
        collectives=collective_traffic(hlo, target),
        model_flops=model_flops_per_device(config, target),
        matmul_rate=target.matmul_rate,
        pipeline_bytes=schedule.pipeline_bytes,
    )


def _host_bytes(memory: Any) -> int:
    """Pinned host bytes of a compiled program's memory analysis: a host-resident state is an
    argument aliased to its output, counted once."""
    return (
        memory.host_temp_size_in_bytes
        + memory.host_argument_size_in_bytes
        + memory.host_output_size_in_bytes
        - memory.host_alias_size_in_bytes
    )


def model_flops_per_device(config: FerryConfig, target: Target) -> float:
    """Model FLOPs of one step per device, by MaxText's convention (`ferry.train.step_flops`)."""
    flops = training_flops(for_target(config.model, target), config.train.global_batch_size, config.train.seq_len)
    return flops.per_device(config.mesh.num_devices)


def _schedule(config: FerryConfig, model_config: Any, policy: Policy, mesh: Mesh) -> TransferSchedule:
    """The transfer schedule of one micro step, sized per device of `mesh`."""
    data_parallel = config.mesh.data_parallel
    return model_schedule(
        abstract_model(model_config),
        policy,
        config.train.rows_per_micro_step(data_parallel),
        config.train.seq_len,
        jnp.dtype(config.train.compute_dtype),
        mesh=mesh,
    )


def _offloaded_bytes(schedule: TransferSchedule) -> dict[str, int]:
    """Bytes per device of one layer's copy of each residual the schedule offloads: how a copy
    in the compiled program is named."""
    return {
        f"{group.name}:{r.name}" if len(schedule.groups) > 1 else r.name: r.bytes_per_device
        for group in schedule.groups
        for r in group.residuals
        if r.placement == "offload"
    }


def layer_group_traces(config: FerryConfig, model_config: Any) -> dict[str, LayerGroupTrace]:
    """Each layer group of the model as the verifier traces it: one device's rows of a micro
    step, in the compute dtype."""
    model = abstract_model(model_config)
    data_parallel = config.mesh.data_parallel
    rows = config.train.rows_per_micro_step(data_parallel) // data_parallel
    dtype = jnp.dtype(config.train.compute_dtype)
    return {
        kind.name: LayerGroupTrace(
            kind.name, kind.run, (rows, config.train.seq_len - kind.seq_shrink, model.config.dim), dtype
        )
        for kind in model.layer_kinds()
    }


class BackwardReads:
    """Does the backward pass of a group's layer read a tensor `policy` offloads? Asked by the
    verifier only for copies missing from a program (one trace of a layer per group, cached)."""

    def __init__(self, config: FerryConfig, model_config: Any, policy: Policy):
        self.model = abstract_model(model_config)
        self.groups = layer_group_traces(config, model_config)
        self.policy = policy
        self.answers: dict[tuple[str, str], bool] = {}

    def __call__(self, group: str, tensor: str) -> bool:
        if (group, tensor) not in self.answers:  # the first question of a group asks of all it offloads, in one trace
            offloaded = {name for name, place in self.policy.pairs if place == "offload" and name != LAYER_INPUT}
            reads = backward_reads(self.model, self.groups[group], self.policy, offloaded | {tensor})
            self.answers |= {(group, name): read for name, read in reads.items() if (group, name) not in self.answers}
        return self.answers[(group, tensor)]
