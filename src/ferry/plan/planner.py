"""Compile ferry's real train step for a GPU or TPU cluster on a machine without one, and read what
the compiler decided: bytes per device in HBM and in pinned host memory, FLOPs, and whether the
host copies it scheduled are hidden behind compute.

The step is the one training runs (`train_step_body`), lowered with `ShapeDtypeStruct` inputs in
their real shardings over a mesh of compile-only devices; nothing is allocated.
"""

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from ferry.errors import FerryError
from ferry.models.registry import abstract_model
from ferry.nn.kernels.choice import attention_platform
from ferry.offload import Policy
from ferry.plan.estimate import CollectiveTraffic, StepEstimate, collective_traffic
from ferry.plan.replay import LayerGroupTrace, read_by_backward
from ferry.plan.transfers import Transfer, TransferSummary, time_transfers, transfers_json
from ferry.schedule import TransferSchedule, model_schedule
from ferry.sharding import MESH_AXES, MeshConfig, batch_sharded
from ferry.train.config import FerryConfig
from ferry.train.flops import training_flops
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.state import StateLayout, run_state_layout
from ferry.train.state_memory import state_writes
from ferry.train.step import LossSettings, train_step_body
from ferry.xla.compile_oom import CompileTimeOom, StepOverHbm, argument_bytes
from ferry.xla.hlo_flops import matmul_count, matmul_flops, xla_rematerialised
from ferry.xla.scheduler_costs import ProfileCache, compile_with_costs
from ferry.xla.targets import GpuTarget, Target


class PlanError(FerryError, RuntimeError):
    """The compiled program contradicts the plan (e.g. an offload the compiler dropped)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What one device of the target holds for one train step, from `memory_analysis()`."""

    target: str
    mesh: str
    policy: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    host_bytes: int  # pinned host: temporaries, arguments and outputs
    flops: float  # matrix products per device per step as they run, from the compiled HLO (`matmul_flops`)
    matmuls: int  # how many matrix products run per device per step (`matmul_count`)
    capacity_bytes: int
    host_capacity_bytes: int | None  # the pinned host pool a run sets up, where the platform sizes one
    compile_options: tuple[tuple[str, object], ...]
    transfers: tuple[Transfer, ...]
    transfer_summary: TransferSummary
    compile_seconds: float  # lowering and compiling on this machine
    verification: Any = None  # `ferry.plan.verify.Verification`: the compiled program checked against the plan
    collectives: CollectiveTraffic = CollectiveTraffic({}, 0.0)
    model_flops: float = 0.0  # per device per step, MaxText's convention (`ferry.train.flops`)
    peak_flops: float = 0.0  # the target's dense bf16 peak, per device
    extrapolated: str | None = None  # how `ferry.plan.extrapolate` made it from shallow compiles; None: compiled whole
    pipeline_bytes: int = 0  # offloaded values a pipelined schedule keeps in HBM (`TransferSchedule.pipeline_bytes`)
    scheduler_costs: str = "xla"  # who timed the ops for XLA's scheduler: ferry's cost model or XLA's estimates
    # the program's static count of them, an upper bound: a MoE's tiles as if every slot of a device
    # routed to one device's experts (`ferry.expected_work`); None: no work is marked, `flops`
    flops_bound: float | None = None
    xla_rematerialised: int = 0  # instructions XLA's own rematerialisation added (`hlo_flops.xla_rematerialised`)
    profile_cached: bool = False  # ferry's cost profile came from its cache: one compile, not two
    # XLA refused to compile the program over HBM (`ferry.xla.compile_oom`): what it said, in words. Then
    # `temp_bytes` is what it said the program needs, the arguments are the state's and the batch's
    # bytes, and `flops` the model FLOPs (no program to count them in); nothing else is known
    compile_oom: str | None = None

    @property
    def device_bytes(self) -> int:
        """Peak HBM the program needs: arguments + outputs - donated aliases + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        """HBM holds the step, and so does the pinned host pool where its size is known."""
        host_fits = self.host_capacity_bytes is None or self.host_bytes <= self.host_capacity_bytes
        return self.compile_oom is None and self.device_bytes <= self.capacity_bytes and host_fits

    @property
    def estimate(self) -> StepEstimate:
        """The step time this program implies on the target: an estimate (`ferry.plan.estimate`)."""
        exposed = self.transfer_summary.exposed_seconds
        return StepEstimate(self.flops / self.peak_flops, exposed, self.collectives.seconds, self.model_flops)

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["transfers"], fields["transfer_summary"], fields["verification"], fields["collectives"]
        return fields | {
            "device_bytes": self.device_bytes,
            "fits": self.fits,
            "collectives": dataclasses.asdict(self.collectives),
            "estimate": self.estimate.to_json(),
            "transfers": transfers_json(self.transfers, self.transfer_summary),
            "verification": None if self.verification is None else self.verification.to_json(),
        }


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

    compiled: Any  # jax.stages.Compiled: (state arrays, tokens) -> (state, metrics), the state donated
    layout: StateLayout
    model_config: Any  # the model as compiled (`for_target`)
    mesh: Mesh
    options: dict[str, object]  # the per-compile XLA options
    priced: bool  # XLA's scheduler timed the ops with ferry's cost model
    seconds: float  # lowering and compiling on this machine
    profile_cached: bool = False  # the cost model's profile came from its cache (one compile)

    def run(self, arrays: Any, tokens: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        """One step on a real mesh: the state's arrays (donated) and a batch in, the next state's
        arrays and the metrics out."""
        state, metrics = self.compiled(arrays, tokens)
        return eqx.filter(state, eqx.is_array), metrics


def compile_train_step(
    config: FerryConfig,
    target: Target | None,
    policy: Policy,
    mesh: Mesh,
    options: Mapping[str, object],
    scheduler_costs: bool = False,
    costs_cache: ProfileCache | None = None,
) -> CompiledTrainStep:
    """Compile the step training runs (`train_step_body`) from the state's shapes alone, over
    `mesh`, with the per-compile XLA `options`, the model as it runs on `target` (None: as
    configured, for this process's backend). `scheduler_costs`: on a GPU target, XLA's scheduler
    times the ops with ferry's cost model (`ferry.xla.scheduler_costs`, as
    `platform.scheduler_costs=ferry` runs do; its profile kept in `costs_cache`)."""
    optimizer = make_optimizer(config.train)
    data_parallel = config.mesh.data_parallel
    model_config = config.model if target is None else for_target(config.model, target)
    layout = run_state_layout(config, mesh, model_config)  # offload.optimizer/params: part maybe on host
    sharding = layout.sharding
    sharded = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), layout.shapes, sharding)
    batch = jax.ShapeDtypeStruct(
        (config.train.global_batch_size, config.train.seq_len + 1), jnp.int32, sharding=batch_sharded(mesh)
    )
    # traced under `jax.set_mesh` of the mesh below, so the engine sees whether its devices have
    # memories (`has_memory_kinds`; compile-only devices have none)
    settings = LossSettings.of(config.train, policy)
    body = train_step_body(
        optimizer,
        settings,
        learning_rate_schedule(config.train),
        config.train.micro_steps(data_parallel),
        sharding,
        stream=layout.streamed_update(config.train),
    )

    def step(arrays: Any, tokens: jax.Array) -> Any:
        return body(eqx.combine(arrays, layout.static), tokens)

    priced = scheduler_costs and isinstance(target, GpuTarget)
    started = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = jax.jit(step, donate_argnums=0).lower(sharded, batch)
        try:
            if priced:
                compiled, _, cached = compile_with_costs(lowered, options, target, costs_cache)
            else:
                compiled, cached = lowered.compile(dict(options)), False
        except jax.errors.JaxRuntimeError as error:
            oom = CompileTimeOom.of(error)
            if oom is None:
                raise
            device, host = argument_bytes((sharded, batch))
            where = f"{mesh.size} x {target.description if target else mesh.devices.flat[0].device_kind}"
            raise StepOverHbm(oom, device, host, time.perf_counter() - started, where) from error
    seconds = time.perf_counter() - started
    return CompiledTrainStep(compiled, layout, model_config, mesh, dict(options), priced, seconds, cached)


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
        step = compile_train_step(config, target, policy, mesh, options, scheduler_costs, costs_cache)
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
        peak_flops=target.bf16_peak_flops,
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
    from ferry.plan.verify import verify_program  # verify subclasses this module's PlanError

    compiled, layout, model_config, mesh = step.compiled, step.layout, step.model_config, step.mesh
    data_parallel = config.mesh.data_parallel
    memory = compiled.memory_analysis()
    host = (  # a host-resident state is an argument aliased to its output: counted once
        memory.host_temp_size_in_bytes
        + memory.host_argument_size_in_bytes
        + memory.host_output_size_in_bytes
        - memory.host_alias_size_in_bytes
    )
    offloads = any(placement == "offload" for _, placement in policy.placements)
    if offloads and host == 0:
        raise PlanError(
            f"policy {policy_name} offloads tensors but the program compiled for {target.name} keeps no bytes "
            "in pinned host memory: the offload was dropped"
        )
    hlo = compiled.as_text()
    flops, bound = matmul_flops(hlo), matmul_flops(hlo, bound=True)
    schedule = _schedule(config, model_config, policy, mesh)
    writes = state_writes(layout.model, layout.placement, layout.sharding.model)
    copy_names = _offloaded_bytes(schedule) | {name: write.bytes for name, write in writes.items()}
    transfers, summary = time_transfers(hlo, target, copy_names)
    verification = verify_program(
        hlo,
        schedule,
        config.train.micro_steps(data_parallel),
        BackwardReads(config, model_config, policy),
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
        peak_flops=target.bf16_peak_flops,
        pipeline_bytes=schedule.pipeline_bytes,
    )


def model_flops_per_device(config: FerryConfig, target: Target) -> float:
    """Model FLOPs of one step per device, by MaxText's convention (`ferry.train.flops`)."""
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
    verifier only for copies missing from a program (a trace of one layer each, cached)."""

    def __init__(self, config: FerryConfig, model_config: Any, policy: Policy):
        self.model = abstract_model(model_config)
        self.groups = layer_group_traces(config, model_config)
        self.policy = policy
        self.answers: dict[tuple[str, str], bool] = {}

    def __call__(self, group: str, tensor: str) -> bool:
        if (group, tensor) not in self.answers:
            self.answers[(group, tensor)] = read_by_backward(self.model, self.groups[group], self.policy, tensor)
        return self.answers[(group, tensor)]
