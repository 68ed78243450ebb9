"""`mode=plan`: compile the step for a target once per offload preset and report them side by
side, as tables (memory, then the host copies of each offloading preset) and as `plan.json`."""

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from ferry.config.root import FerryConfig, check_mesh_shape
from ferry.config.train import OffloadConfig, StatePlacement
from ferry.models.registry import abstract_model
from ferry.offload.engine import Policy
from ferry.offload.schedule import format_bytes
from ferry.plan.advice import step_identity
from ferry.plan.auto import (
    PEEL,
    STATE_DECISIONS,
    Choice,
    Tried,
    auto_plan,
    choices_of,
    state_decisions,
    state_of,
)
from ferry.plan.auto_measure import MeasuredPick, measure_candidates
from ferry.plan.estimate import ranked
from ferry.plan.extrapolate import (
    ExtrapolationError,
    extrapolated_plan,
    group_depths,
    probe_depths,
    with_depths,
)
from ferry.plan.here import offers_copies
from ferry.plan.measure import Measurement
from ferry.plan.memory_plan import MemoryPlan
from ferry.plan.planner import (
    compile_only_mesh,
    for_target,
    layer_group_traces,
    model_flops_per_device,
    plan_memory,
)
from ferry.plan.tables import (
    DEFAULT_HBM_POOL,
    HBM_POOL_VARIABLE,
    HOST_POOL_VARIABLE,
    candidate_table,
    choice_table,
    estimate_table,
    measured_table,
    plan_table,
    transfer_table,
    verification_notes,
    verification_table,
)
from ferry.plan.verify import RecomputeNotChecked, explain_recompute, recompute_checked
from ferry.platform import PlatformConfig
from ferry.xla.scheduler_costs import ProfileCache
from ferry.xla.targets import Target, named_target


def plan_presets(config: FerryConfig) -> tuple[str, ...]:
    if config.plan.presets is not None:
        return config.plan.presets
    return tuple(dict.fromkeys(("save_all", "full_remat", config.offload.name)))


def target_platform(
    config: FerryConfig, target: Target, load_platform: Callable[[str], PlatformConfig]
) -> PlatformConfig:
    """The platform preset a real run on `target` uses: the configured one where it names the
    target's platform (`platform=gpu platform.xla_flags.X=...` changes the plan's flags too),
    else the target's own preset."""
    return config.platform if config.platform.name == target.platform else load_platform(target.platform)


def run_plan(
    config: FerryConfig,
    load_preset: Callable[[str], OffloadConfig],
    load_platform: Callable[[str], PlatformConfig],
    console: Console,
    measure_one: Callable[[int, Tried], Measurement] | None = None,
    compile_ahead: Callable[[Sequence[tuple[int, Tried]]], list[str]] | None = None,
) -> tuple[list[MemoryPlan], list[Choice], MeasuredPick | None]:
    """One plan per preset (`auto`: the one it chooses, with its choices); every check first
    (target, mesh, presets), then the compiles. With `measure_one` (`ferry.plan.auto_measure`),
    auto's best candidates are timed on this machine (compiled first by `compile_ahead`, where
    given) and the fastest that fits is its pick: the third value says how it went (None: not
    measured)."""
    target, tagged, policies = _checked(config, load_preset)
    auto = policies.pop("auto", None) is not None
    compiler = PlanCompiler(config, target, target_platform(config, target, load_platform), tagged, console)
    plans = _recompute_checked(compiler, policies, compiler.presets(policies))
    choices: list[Choice] = []
    tried: list[Tried] = []
    measured: MeasuredPick | None = None
    if auto:
        auto_result, choices, tried, measured = auto_pick(compiler, policies, plans, measure_one, compile_ahead)
        plans.append(auto_result)
    _print_plans(console, config, plans, choices, tried, measured)
    return plans, choices, measured


def _checked(
    config: FerryConfig, load_preset: Callable[[str], OffloadConfig]
) -> tuple[Target, frozenset[str], dict[str, Policy]]:
    """The target, the model's tagged tensors and each preset's policy, every one checked before
    anything compiles."""
    target = named_target(config.target)
    target.topology(config.mesh.num_devices)  # whole hosts of GPUs, or a TPU slice
    check_mesh_shape(config)
    tagged = abstract_model(config.model).tagged_names()
    policies = {}
    for name in plan_presets(config):
        preset = config.offload if name == config.offload.name else load_preset(name)
        policies[name] = preset.policy(tagged)
        policies[name].validate(tagged)
    return target, tagged, policies


class PlanCompiler:
    """Compiles the plan's programs for one target with the flags, pools and cost model a real
    run on it uses; each distinct program once (auto's all-on-device candidate is `minimal`,
    say), extrapolated from shallow compiles where `plan.extrapolate` says so."""

    def __init__(
        self, config: FerryConfig, target: Target, platform: PlatformConfig, tagged: frozenset[str], console: Console
    ):
        self.config, self.target, self.platform, self.tagged, self.console = config, target, platform, tagged, console
        pool = platform.env.get(HOST_POOL_VARIABLE) if target.platform == "gpu" else None
        capacity = None if config.plan.capacity_gib is None else int(config.plan.capacity_gib * 2**30)
        if capacity is None and target.platform == "gpu":
            capacity = int(float(str(platform.env.get(HBM_POOL_VARIABLE, DEFAULT_HBM_POOL))) * target.hbm_bytes)
        self.capacity = capacity
        self.host_capacity = None if pool is None else int(str(pool)) * 2**30
        self.compiled: dict[tuple, MemoryPlan] = {}

    def presets(self, policies: dict[str, Policy]) -> list[MemoryPlan]:
        """Each preset's plan. XLA compiles one program on one core: the presets compile side by
        side, a core per compile."""
        config = self.config
        per_plan = 1 + len(probe_depths(group_depths(config.model))[1]) if config.plan.extrapolate else 1
        workers = max(1, min(len(policies), (os.cpu_count() or 1) // per_plan))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda item: self.compile_policy(item[1], item[0]), policies.items()))

    def compile_policy(self, policy: Policy, name: str, state: StatePlacement | None = None) -> MemoryPlan:
        """The plan of `policy` with the train state placed by `state` (default: the run's)."""
        state = self.config.state_placement if state is None else state
        placements = tuple(policy.placement(tensor) for tensor in sorted(self.tagged))
        # the engine, pipelining and peel compile other programs of the same placements
        key = (policy.keep_all, placements, policy.engine, policy.pipelined, policy.peel, state)
        if key not in self.compiled:
            self.compiled[key] = self.compile_new(policy, name, state)
        return dataclasses.replace(self.compiled[key], policy=name)

    def compile_new(self, policy: Policy, name: str, state: StatePlacement) -> MemoryPlan:
        if not self.config.plan.extrapolate:
            return self.compile_at(policy, name, state)
        try:
            return extrapolated_plan(
                lambda depths: self.compile_at(policy, name, state, depths),
                group_depths(self.config.model),
                model_flops_per_device(self.config, self.target),
            )
        except ExtrapolationError as error:
            self.console.print(f"not extrapolated: {error}; compiling the whole model", highlight=False)
            return self.compile_at(policy, name, state)

    def compile_at(
        self, policy: Policy, name: str, state: StatePlacement, depths: dict[str, int] | None = None
    ) -> MemoryPlan:
        config, target, platform = self.config, self.target, self.platform
        model = config.model if depths is None else with_depths(config.model, depths)
        offload = dataclasses.replace(config.offload, optimizer=state.optimizer, params=state.params)
        at = dataclasses.replace(config, model=model, offload=offload)
        shown = "" if depths is None else " (" + ", ".join(f"{g} {d} layers" for g, d in depths.items()) + ")"
        self.console.print(
            f"compiling the train step for {config.mesh.num_devices} x {target.description}: {name}{shown}"
        )
        costs = platform.scheduler_costs == "ferry"
        cache = ProfileCache.of(platform) if costs else None
        # the flags a run of this policy gets: a policy that copies to host adds the platform's host-offload ones
        flags = dict(platform.for_host_copies(policy.copies_to_host or state.streams).xla_flags)
        return plan_memory(at, target, policy, name, self.capacity, flags, self.host_capacity, costs, cache)


def _recompute_checked(
    compiler: PlanCompiler, policies: dict[str, Policy], plans: list[MemoryPlan]
) -> list[MemoryPlan]:
    """The plans with the recompute check run (`ferry.plan.verify.recompute_checked`); as they are
    where it cannot run (save_all, the reference, over HBM)."""
    config, target = compiler.config, compiler.target
    model_config = for_target(config.model, target)
    model, groups = abstract_model(model_config), layer_group_traces(config, model_config)
    micro_steps = config.micro_steps
    layers = {kind.name: kind.num_layers * micro_steps for kind in model.layer_kinds()}
    try:
        return recompute_checked(
            plans,
            list(policies.values()),
            compiler.tagged,
            compiler.compile_policy,
            lambda policy: explain_recompute(model, groups, layers, policy),
            f"{config.model_name} compiled for {target.name}",
        )
    except RecomputeNotChecked as error:  # save_all (the reference) over HBM, at compile time or after
        compiler.console.print(f"recompute check not run: {error}", highlight=False)
        return plans


def auto_pick(
    compiler: PlanCompiler,
    policies: dict[str, Policy],
    plans: list[MemoryPlan],
    measure_one: Callable[[int, Tried], Measurement] | None,
    compile_ahead: Callable[[Sequence[tuple[int, Tried]]], list[str]] | None = None,
) -> tuple[MemoryPlan, list[Choice], list[Tried], MeasuredPick | None]:
    """offload=auto's plan, its choices and candidates; with `measure_one`, its best candidates
    (compiled first by `compile_ahead`) timed and the fastest that fits picked, the all-on-device
    program's peeled twin among them even where its loop fits (`auto_plan`'s `measuring`)."""
    config, target, console = compiler.config, compiler.target, compiler.console
    mesh = compile_only_mesh(target, config.mesh)

    def compile_choice(policy: Policy, values: dict[str, str]) -> MemoryPlan:
        return compiler.compile_policy(policy, "auto", state_of(values, config.state_placement))

    extra = state_decisions(config, target, mesh) if offers_copies(target) else ()
    known = list(zip(policies.values(), plans, strict=True))
    measuring = measure_one is not None  # the peeled twin is compiled to be timed, its loop fitting or not
    auto_result, choices, tried = auto_plan(
        config, target, mesh, compiler.compile_policy, extra, compile_choice, known, measuring
    )
    measured = None
    if measure_one is not None:
        strict = config.offload.auto.measure is True
        say = lambda line: console.print(line, highlight=False)
        count = config.offload.auto.candidates
        measured = measure_candidates(tried, count, measure_one, say, strict, compile_ahead)
        if measured.pick is not None:
            pick = tried[measured.pick.number - 1]
            auto_result = dataclasses.replace(pick.plan, policy="auto")
            choices = choices_of(config, target, mesh, pick, extra, "measured: " + measured.reason)
    return auto_result, choices, tried, measured


def _print_plans(
    console: Console,
    config: FerryConfig,
    plans: list[MemoryPlan],
    choices: list[Choice],
    tried: list[Tried],
    measured: MeasuredPick | None,
) -> None:
    """The plan's tables and notes, in the order a reader needs them."""
    console.print(plan_table(plans, config))
    for line in refused_lines(plans):
        console.print(line, highlight=False)
    for plan in plans:
        if plan.xla_rematerialised:
            console.print(
                f"{plan.policy}: XLA rematerialised {plan.xla_rematerialised} instructions on its own (its "
                "rematerialisation pass is on, and its memory estimate, which counts pinned host bytes as HBM, "
                "exceeded its limit); the matmul count includes that recomputation",
                highlight=False,
            )
    console.print(estimate_table(plans))
    for plan in plans:
        if plan.transfers:
            console.print(transfer_table(plan))
        if plan.verification is not None and plan.verification.copies:
            console.print(verification_table(plan))
        elif plan.verification is not None and (notes := verification_notes(plan)):  # no copies: no empty table
            console.print(f"{plan.policy}: the compiled program checked, no host copies; {notes}", highlight=False)
    if choices:
        console.print(candidate_table(tried))
        if measured is not None:
            console.print(measured_table(measured))
        console.print(choice_table(choices, plans[-1]))


def refused_lines(plans: list[MemoryPlan]) -> list[str]:
    """One line per preset XLA refused to compile over HBM: what it needs, what the device has,
    and which of the planned presets fit, fastest first by the estimate."""
    refused = [plan for plan in plans if plan.compile_oom is not None]
    if not refused:
        return []
    fitting = fitting_presets(plans)
    fits = (
        "planned presets that fit, fastest first by the estimate: " + ", ".join(fitting)
        if fitting
        else "none of the planned presets fits; try offload=auto, train.micro_batch_size or offload.optimizer=host"
    )
    return [
        f"{plan.policy}: OOM at compile for {plan.target}: {plan.compile_oom} (arguments "
        f"{format_bytes(plan.argument_bytes)} on top); {fits}"
        for plan in refused
    ]


def fitting_presets(plans: list[MemoryPlan]) -> list[str]:
    """The plans that fit, fastest first by the estimate (`ranked`), each with its HBM."""
    fitting = {plan.policy: plan for plan in plans if plan.fits}
    return [
        f"{name} ({format_bytes(fitting[name].device_bytes)})"
        for name, _, _ in ranked({name: plan.estimate for name, plan in fitting.items()})
    ]


def write_plan(
    plans: list[MemoryPlan],
    choices: list[Choice],
    run_dir: Path,
    config: FerryConfig | None = None,
    measured: MeasuredPick | None = None,
) -> list[Path]:
    """`plan.json` (with the step planned, `step_identity`, where `config` is given: a run of that
    step over HBM reads what fitted: `ferry.plan.advice`), and for offload=auto the chosen
    placement as a preset to train with; where auto measured its candidates, the record of them in
    both (`measured`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "plan.json"
    record: dict[str, Any] = {
        "plans": [plan.to_json() for plan in plans],
        "auto": [dataclasses.asdict(c) for c in choices],
    }
    if config is not None:
        record["step"] = step_identity(config)
    if measured is not None:
        record["measured"] = measured.record()
    path.write_text(json.dumps(record, indent=2))
    if not choices:
        return [path]
    preset = run_dir / "offload_auto.yaml"
    how = "the fastest of its best candidates timed on this machine" if measured and measured.pick else "estimated"
    preset.write_text(auto_preset_text(plans[-1], choices, f"chosen by mode=plan: {how}", config, measured))
    return [path, preset]


def auto_preset_text(
    plan: MemoryPlan,
    choices: list[Choice],
    how: str,
    config: FerryConfig | None = None,
    measured: MeasuredPick | None = None,
) -> str:
    """offload=auto's choice as an offload preset to train with (YAML), `how` it was chosen in its
    first line; where auto measured its candidates, the record of them (`measured`)."""
    tensors = "\n".join(f"  {c.name}: {c.placement}" for c in choices if c.name not in (*STATE_DECISIONS, PEEL))
    state = "".join(f"{STATE_DECISIONS[c.name][0]}: {c.placement}\n" for c in choices if c.name in STATE_DECISIONS)
    text = (
        f"# offload=auto for {plan.target} ({plan.mesh}), {how}\n"
        f"name: auto_{plan.target}\nkeep_all: false\ndefault: null\n{state}tensors:\n{tensors}\n"
    )
    if config is not None:  # what the candidates compiled with (pipelining, engine, stream); the peel chosen
        offload = config.offload
        peel = next((c.placement for c in choices if c.name == PEEL), offload.peel)
        text += f"pipelined: {str(offload.pipelined).lower()}\npeel: {peel}\nengine: {offload.engine}\n"
        text += f"stream_mib: {offload.stream_mib:g}\nstream_prefetch: {str(offload.stream_prefetch).lower()}\n"
    if measured is not None:  # read by no run: every candidate timed, and why this one
        text += yaml.safe_dump({"measured": measured.record()}, sort_keys=False, width=1000)
    return text
