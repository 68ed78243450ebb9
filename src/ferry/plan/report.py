"""`mode=plan`: compile the step for a target once per offload preset and report them side by
side, as tables (memory, then the host copies of each offloading preset) and as `plan.json`."""

import dataclasses
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from ferry.config import ConfigError
from ferry.models.registry import abstract_model
from ferry.offload import Policy
from ferry.plan.auto import (
    HEADROOM,
    STATE_DECISIONS,
    Choice,
    Tried,
    auto_plan,
    choices_of,
    fits_with_headroom,
    state_decisions,
    state_of,
)
from ferry.plan.auto_measure import MeasuredPick, measure_candidates
from ferry.plan.auto_search import MIN_GAIN
from ferry.plan.copy_match import DEAD
from ferry.plan.estimate import REFERENCE, ranked
from ferry.plan.extrapolate import (
    ExtrapolationError,
    extrapolated_plan,
    group_depths,
    probe_depths,
    with_depths,
)
from ferry.plan.measure import Measurement
from ferry.plan.memory_plan import MemoryPlan
from ferry.plan.planner import (
    compile_only_mesh,
    for_target,
    layer_group_traces,
    model_flops_per_device,
    plan_memory,
)
from ferry.plan.verify import RecomputeNotChecked, explain_recompute, recompute_checked
from ferry.platform import PlatformConfig
from ferry.schedule import format_bytes
from ferry.train.config import FerryConfig, OffloadConfig, check_mesh_shape
from ferry.train.plan_advice import step_identity
from ferry.train.state_memory import StatePlacement
from ferry.xla.scheduler_costs import ProfileCache
from ferry.xla.targets import TARGETS, Target

HOST_POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # GiB of pinned host XLA's GPU client sets up
# the share of a GPU's HBM JAX's allocator takes, and its default where a platform leaves it unset: a
# program is planned against that pool, as a run's memory check (its `memory_stats()` limit) holds it
HBM_POOL_VARIABLE, DEFAULT_HBM_POOL = "XLA_CLIENT_MEM_FRACTION", 0.75


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
) -> tuple[list[MemoryPlan], list[Choice], MeasuredPick | None]:
    """One plan per preset (`auto`: the one it chooses, with its choices); every check first
    (target, mesh, presets), then the compiles. With `measure_one` (`ferry.plan.auto_measure`),
    auto's best candidates are timed on this machine and the fastest that fits is its pick: the
    third value says how it went (None: not measured)."""
    if config.target not in TARGETS:
        raise ConfigError(f"target is {config.target!r}; the planner knows {', '.join(TARGETS)}")
    target = TARGETS[config.target]
    target.topology(config.mesh.num_devices)  # whole hosts of GPUs, or a TPU slice
    check_mesh_shape(config)
    tagged = abstract_model(config.model).tagged_names()
    policies = {}
    for name in plan_presets(config):
        preset = config.offload if name == config.offload.name else load_preset(name)
        policies[name] = preset.policy(tagged)
        policies[name].validate(tagged)
    auto = policies.pop("auto", None) is not None
    platform = target_platform(config, target, load_platform)
    pool = platform.env.get(HOST_POOL_VARIABLE) if target.platform == "gpu" else None
    capacity = None if config.plan.capacity_gib is None else int(config.plan.capacity_gib * 2**30)
    if capacity is None and target.platform == "gpu":
        capacity = int(float(platform.env.get(HBM_POOL_VARIABLE, DEFAULT_HBM_POOL)) * target.hbm_bytes)

    host_capacity = None if pool is None else int(pool) * 2**30

    def compile_at(
        policy: Policy, name: str, state: StatePlacement, depths: dict[str, int] | None = None
    ) -> MemoryPlan:
        model = config.model if depths is None else with_depths(config.model, depths)
        offload = dataclasses.replace(config.offload, optimizer=state.optimizer, params=state.params)
        at = dataclasses.replace(config, model=model, offload=offload)
        shown = "" if depths is None else " (" + ", ".join(f"{g} {d} layers" for g, d in depths.items()) + ")"
        console.print(f"compiling the train step for {config.mesh.num_devices} x {target.description}: {name}{shown}")
        costs = platform.scheduler_costs == "ferry"
        cache = ProfileCache.of(platform) if costs else None
        flags = dict(platform.xla_flags)
        return plan_memory(at, target, policy, name, capacity, flags, host_capacity, costs, cache)

    compiled: dict[tuple, MemoryPlan] = {}  # auto's all-on-device candidate is `minimal`, say: compile once

    def compile_policy(policy: Policy, name: str, state: StatePlacement | None = None) -> MemoryPlan:
        state = config.offload.state_placement if state is None else state
        key = (policy.keep_all, tuple(policy.placement(tensor) for tensor in sorted(tagged)), state)
        if key not in compiled:
            compiled[key] = compile_new(policy, name, state)
        return dataclasses.replace(compiled[key], policy=name)

    def compile_new(policy: Policy, name: str, state: StatePlacement) -> MemoryPlan:
        if not config.plan.extrapolate:
            return compile_at(policy, name, state)
        try:
            return extrapolated_plan(
                lambda depths: compile_at(policy, name, state, depths),
                group_depths(config.model),
                model_flops_per_device(config, target),
            )
        except ExtrapolationError as error:
            console.print(f"not extrapolated: {error}; compiling the whole model", highlight=False)
            return compile_at(policy, name, state)

    # XLA compiles one program on one core: the presets compile side by side, a core per compile
    per_plan = 1 + len(probe_depths(group_depths(config.model))[1]) if config.plan.extrapolate else 1
    workers = max(1, min(len(policies), (os.cpu_count() or 1) // per_plan))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        plans = list(pool.map(lambda item: compile_policy(item[1], item[0]), policies.items()))
    model_config = for_target(config.model, target)
    model, groups = abstract_model(model_config), layer_group_traces(config, model_config)
    micro_steps = config.train.micro_steps(config.mesh.data_parallel)
    layers = {kind.name: kind.num_layers * micro_steps for kind in model.layer_kinds()}
    try:
        plans = recompute_checked(
            plans,
            list(policies.values()),
            tagged,
            compile_policy,
            lambda policy: explain_recompute(model, groups, layers, policy),
            f"{config.model_name} compiled for {target.name}",
        )
    except RecomputeNotChecked as error:  # save_all (the reference) over HBM, at compile time or after
        console.print(f"recompute check not run: {error}", highlight=False)
    choices: list[Choice] = []
    tried: list[Tried] = []
    measured: MeasuredPick | None = None
    if auto:
        mesh = compile_only_mesh(target, config.mesh)

        def compile_choice(policy: Policy, values: dict[str, str]) -> MemoryPlan:
            return compile_policy(policy, "auto", state_of(values))

        extra = state_decisions(config, target, mesh)
        auto_result, choices, tried = auto_plan(
            config,
            target,
            mesh,
            compile_policy,
            extra,
            compile_choice,
            known=list(zip(policies.values(), plans, strict=True)),
        )
        if measure_one is not None:
            say = lambda line: console.print(line, highlight=False)  # noqa: E731
            strict = config.offload.auto.measure is True
            measured = measure_candidates(tried, config.offload.auto.candidates, measure_one, say, strict)
            if measured.pick is not None:
                pick = tried[measured.pick.number - 1]
                auto_result = dataclasses.replace(pick.plan, policy="auto")
                choices = choices_of(config, target, mesh, pick, extra, "measured: " + measured.reason)
        plans.append(auto_result)
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
        if plan.verification is not None and (plan.verification.copies or plan.verification.recompute):
            console.print(verification_table(plan))
    if choices:
        console.print(candidate_table(tried))
        if measured is not None:
            console.print(measured_table(measured))
        console.print(choice_table(choices, plans[-1]))
    return plans, choices, measured


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def plan_table(plans: list[MemoryPlan], config: FerryConfig) -> Table:
    first = plans[0]
    pool = "" if first.host_capacity_bytes is None else f"; pinned host pool {format_bytes(first.host_capacity_bytes)}"
    target = TARGETS[first.target]
    if target.platform == "gpu" and first.capacity_bytes != target.hbm_bytes:
        share = first.capacity_bytes / target.hbm_bytes
        pool += (
            f"; capacity: {share:.0%} of the {format_bytes(target.hbm_bytes)} of HBM (the pool JAX's allocator "
            f"holds, {HBM_POOL_VARIABLE}, or plan.capacity_gib)"
        )
    pool += f"; scheduler costs: {first.scheduler_costs}"
    bound = (
        "; matmul TFLOP: the MoE's tiles a balanced router fills (the program's static count, every slot of a "
        "device routed to one device's experts, in parentheses)"
        if any(plan.flops_bound is not None for plan in plans)
        else ""
    )
    table = Table(
        title=f"{config.model_name} on {first.target} x {config.mesh.num_devices} ({first.mesh}), "
        f"batch {config.train.global_batch_size} x {config.train.seq_len}: per device",
        caption="compile options: " + ", ".join(f"{k}={v}" for k, v in first.compile_options) + pool + bound,
    )
    columns = ("preset", "arguments", "outputs", "temp", "HBM total", "capacity", "verdict", "pinned host")
    for column in (*columns, "matmul TFLOP", "copies exposed", "compile", "planned"):
        table.add_column(column, justify="left" if column in ("preset", "verdict", "planned") else "right")
    for plan in plans:
        summary = plan.transfer_summary
        if plan.compile_oom is not None:  # no program: what XLA said it needs, the arguments, and nothing else
            table.add_row(
                plan.policy,
                format_bytes(plan.argument_bytes),
                "-",
                format_bytes(plan.temp_bytes),
                format_bytes(plan.device_bytes),
                format_bytes(plan.capacity_bytes),
                "OOM (XLA refused to compile it)",
                "-",
                "-",
                "-",
                f"{plan.compile_seconds:.0f} s",
                "compile refused",
            )
            continue
        table.add_row(
            plan.policy,
            format_bytes(plan.argument_bytes),
            format_bytes(plan.output_bytes - plan.alias_bytes),
            format_bytes(plan.temp_bytes),
            format_bytes(plan.device_bytes),
            format_bytes(plan.capacity_bytes),
            "FITS" if plan.fits else "OOM",
            format_bytes(plan.host_bytes),
            f"{plan.flops / 1e12:.4f}" + ("" if plan.flops_bound is None else f" (<= {plan.flops_bound / 1e12:.4f})"),
            format_seconds(summary.exposed_seconds) if plan.transfers else "-",
            f"{plan.compile_seconds:.0f} s" + (" (costs cached)" if plan.profile_cached else ""),
            "compiled whole" if plan.extrapolated is None else f"EXTRAPOLATED: {plan.extrapolated}",
        )
    return table


def estimate_table(plans: list[MemoryPlan]) -> Table:
    """Each preset's step-time estimate (`ferry.plan.estimate`), fastest first."""
    target = plans[0].target
    table = Table(
        title=f"step-time ESTIMATE on {target} (per device; from the compiled program, not measured)",
        caption="estimate: matmuls at the dense bf16 peak + host copies left exposed + collectives over the "
        "interconnect (targets.py); best overlaps collectives with compute, worst adds them, middle is halfway "
        f"(ranked by it, then the worst); model TFLOPs by MaxText's convention; speed-up: {REFERENCE}'s middle "
        "estimate over the preset's",
    )
    columns = ("rank", "preset", "verdict", "matmuls", "copies exposed", "collectives")
    for column in (*columns, "best", "middle", "worst", "TFLOPs/s/device", f"vs {REFERENCE}"):
        table.add_column(column, justify="left" if column in ("preset", "verdict") else "right")
    compiled = {p.policy: p.estimate for p in plans if p.compile_oom is None}
    for rank, (name, estimate, speedup) in enumerate(ranked(compiled), 1):
        plan = next(p for p in plans if p.policy == name)
        table.add_row(
            str(rank),
            name,
            "FITS" if plan.fits else "OOM",
            format_seconds(estimate.matmul_seconds),
            format_seconds(estimate.exposed_copy_seconds),
            format_seconds(estimate.collective_seconds),
            format_seconds(estimate.best_seconds),
            format_seconds(estimate.middle_seconds),
            format_seconds(estimate.worst_seconds),
            f"{estimate.best_tflops:.1f} - {estimate.worst_tflops:.1f}",
            "-" if speedup is None else f"{speedup:.3f}x",
        )
    for plan in plans:
        if plan.compile_oom is not None:
            table.add_row("-", plan.policy, "OOM (XLA refused to compile it)", *["-"] * 8)
    return table


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


def transfer_table(plan: MemoryPlan) -> Table:
    """Every host copy XLA scheduled, with the compute it overlaps, per step."""
    summary = plan.transfer_summary
    caption = (
        f"per step: {format_bytes(summary.bytes_to_host)} to host, {format_bytes(summary.bytes_to_device)} "
        f"back; link busy {format_seconds(summary.link_seconds)}, compute overlapping copies "
        f"{format_seconds(summary.overlapped_compute_seconds)}, exposed {format_seconds(summary.exposed_seconds)}"
    )
    if summary.floor_seconds:
        caption += (
            f" (at least {format_seconds(summary.floor_seconds)} in any order: a loop iteration's copies outlast "
            "all its matrix work, and no copy outlives its iteration; offload.peel takes a stack's end layers out of "
            'its loop, where their copies may overlap the loss head: README, "Peeling the stack\'s ends")'
        )
    if summary.kernel_copies:
        caption += (
            f"; {summary.kernel_copies} of them ({format_bytes(summary.kernel_bytes)}) run as kernels that read or "
            "write pinned host memory through the SMs, not on a copy engine (host slices XLA gave no memcpy "
            "descriptor, such as those of the loop iterations its pipelining peels)"
        )
    if plan.pipeline_bytes:
        caption += (
            f"; pipelined one layer apart, for {format_bytes(plan.pipeline_bytes)} of offloaded values in HBM "
            "(each stack's last layer; one more layer's while a stack runs), in the temporaries above"
        )
    table = Table(title=f"{plan.policy}: host copies in the compiled program (per device)", caption=caption)
    columns = ("tensor", "direction", "engine", "shape", "bytes", "x per step", "transfer", "hiding compute", "hidden")
    for column in columns:
        table.add_column(
            column, justify="right" if column in ("bytes", "x per step", "transfer", "hiding compute") else "left"
        )
    for t in plan.transfers:
        table.add_row(
            t.tensor,
            t.direction,
            t.engine,
            t.shape,
            format_bytes(t.bytes),
            str(t.executions),
            format_seconds(t.transfer_seconds),
            format_seconds(t.compute_seconds),
            "yes" if t.hidden else "no",
        )
    return table


def verification_table(plan: MemoryPlan) -> Table:
    """The compiled program checked against the plan (`ferry.plan.verify`): each offloaded
    tensor's copies per step, listed and found, and the walks of its host slices in loops."""
    verification = plan.verification
    recompute = verification.recompute
    caption = []
    if recompute is not None:
        caption.append(
            f"nothing rematerialised ({recompute.policy}): {recompute.matmuls} matmuls, "
            f"{recompute.flops / 1e12:.4f} TFLOP per step; save_all: {recompute.save_all_matmuls}, "
            f"{recompute.save_all_flops / 1e12:.4f} TFLOP"
            + (
                f" (untagged intermediates recomputed between saved values: {recompute.untagged_matmuls:.0f})"
                if recompute.untagged_matmuls
                else ""
            )
        )
    if verification.unmatched:
        caption.append("host copies of no offloaded tensor's size: " + ", ".join(verification.unmatched))
    table = Table(
        title=f"{plan.policy}: the compiled program checked (per device, per step)", caption="; ".join(caption)
    )
    for column in ("layers", "tensor", "bytes", "to host", "to device", "host slices in loops", "named by", "verdict"):
        right = column in ("bytes", "to host", "to device")
        table.add_column(column, justify="right" if right else "left", no_wrap=column == "verdict")
    rows: dict[tuple[str, str], dict] = {}
    for c in verification.copies:
        row = rows.setdefault((c.group, c.tensor), {"bytes": c.bytes, "named": c.named_by, "verdicts": []})
        row[c.direction] = f"{c.found}/{c.expected}"
        row["verdicts"].append(f"{c.direction}: {c.status}")
    for (group, tensor), row in rows.items():
        verdicts = {v.split(": ", 1)[1] for v in row["verdicts"]}
        # a copy named by its size names every tensor of that size; a dead tensor has no slices
        walks = [w for w in verification.walks if w.group == group and tensor in w.tensor.split("/")]
        walks = [] if verdicts == {DEAD} else walks
        table.add_row(
            group,
            tensor,
            format_bytes(row["bytes"]),
            row.get("to host", "-"),
            row.get("to device", "-"),
            ", ".join(sorted({f"{w.kind.removeprefix('host ')} {w.index.replace(' ', '')} {w.status}" for w in walks}))
            or "-",
            row["named"],
            verdicts.pop() if len(verdicts) == 1 else "; ".join(row["verdicts"]),
        )
    return table


def candidate_table(tried: list[Tried]) -> Table:
    """The candidates offload=auto weighed, in order (the presets compiled beside it, then its
    own): what it predicted, what each compiled to."""
    table = Table(
        title="offload=auto: candidates compiled (per device; step times are ESTIMATES)",
        caption=f"fits: HBM and the pinned host pool each keep {HEADROOM:.0%} free; "
        f"the fastest is the least middle estimate (halfway between best and worst; within {MIN_GAIN:.1%} of the "
        "least counts as a tie), then the least worst",
    )
    columns = (
        "#",
        "from",
        "off device",
        "HBM predicted",
        "HBM",
        "pinned host",
        "predicted (middle)",
        "best estimate",
        "middle estimate",
        "worst estimate",
    )
    for column in (*columns, "fits"):
        table.add_column(column, justify="left" if column in ("from", "off device", "fits") else "right")
    for number, t in enumerate(tried, 1):
        moved = [f"{name}={value}" for name, value in t.values.items() if value != "device"]
        table.add_row(
            str(number),
            t.plan.policy,  # a preset this plan compiled anyway, or auto's own candidate
            ", ".join(moved) or "(all on device)",
            format_bytes(int(t.predicted.hbm_bytes)),
            format_bytes(t.plan.device_bytes),
            format_bytes(t.plan.host_bytes),
            format_seconds(t.predicted.seconds),
            format_seconds(t.plan.estimate.best_seconds),
            format_seconds(t.plan.estimate.middle_seconds),
            format_seconds(t.plan.estimate.worst_seconds),  # breaks ties within the band
            "yes" if t.fits else "no",
        )
    return table


def measured_table(measured: MeasuredPick) -> Table:
    """The candidates timed, in the search's order: estimate against measurement."""
    device = measured.record()["device"]
    table = Table(
        title=f"offload=auto: candidates MEASURED on this machine ({device})",
        caption=f"pick: {'#' + str(measured.pick.number) if measured.pick else 'none'}: {measured.reason}",
    )
    columns = ("#", "from", "off device", "estimated step", "measured step", "HBM (compiled here)", "peak", "verdict")
    for column in columns:
        table.add_column(column, justify="left" if column in ("from", "off device", "verdict") else "right")
    for c in measured.candidates:
        m = c.measurement
        moved = ", ".join(f"{k}={v}" for k, v in c.values.items() if v != "device") or "(all on device)"
        chosen = measured.pick is not None and c.number == measured.pick.number
        table.add_row(
            str(c.number),
            c.source,
            moved,
            format_seconds(c.predicted_seconds),
            "-" if m.step_seconds is None else format_seconds(m.step_seconds),
            "-" if m.device_bytes is None else format_bytes(m.device_bytes),
            "-" if m.peak_bytes is None else format_bytes(m.peak_bytes),
            ("PICK: " if chosen else "") + ("timed" if m.fits else f"dropped: {m.reason}"),
        )
    return table


def choice_table(choices: list[Choice], plan: MemoryPlan) -> Table:
    fits = fits_with_headroom(plan)
    table = Table(
        title=f"offload=auto for {plan.target}: {'FITS' if fits else 'nothing fits; the closest'}, "
        f"{format_bytes(plan.device_bytes)} of {format_bytes(plan.capacity_bytes)} HBM per device, "
        f"estimated step {format_seconds(plan.estimate.middle_seconds)} (best "
        f"{format_seconds(plan.estimate.best_seconds)}, worst {format_seconds(plan.estimate.worst_seconds)})",
    )
    for column in ("tensor", "placement", "bytes per micro step", "recompute TFLOP", "why"):
        table.add_column(column, justify="right" if column in ("bytes per micro step", "recompute TFLOP") else "left")
    for c in choices:
        table.add_row(c.name, c.placement, format_bytes(c.bytes), f"{c.recompute_flops / 1e12:.4f}", c.reason)
    return table


def write_plan(
    plans: list[MemoryPlan],
    choices: list[Choice],
    run_dir: Path,
    config: FerryConfig | None = None,
    measured: MeasuredPick | None = None,
) -> list[Path]:
    """`plan.json` (with the step planned, `step_identity`, where `config` is given: a run of that
    step over HBM reads what fitted: `ferry.train.plan_advice`), and for offload=auto the chosen
    placement as a preset to train with; where auto measured its candidates, the record of them in
    both (`measured`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "plan.json"
    record = {"plans": [plan.to_json() for plan in plans], "auto": [dataclasses.asdict(c) for c in choices]}
    if config is not None:
        record["step"] = step_identity(config)
    if measured is not None:
        record["measured"] = measured.record()
    path.write_text(json.dumps(record, indent=2))
    if not choices:
        return [path]
    preset = run_dir / "offload_auto.yaml"
    tensors = "\n".join(f"  {c.name}: {c.placement}" for c in choices if c.name not in STATE_DECISIONS)
    state = "".join(f"{STATE_DECISIONS[c.name][0]}: {c.placement}\n" for c in choices if c.name in STATE_DECISIONS)
    how = "the fastest of its best candidates timed on this machine" if measured and measured.pick else "estimated"
    text = (
        f"# offload=auto for {plans[-1].target} ({plans[-1].mesh}), chosen by mode=plan: {how}\n"
        f"name: auto_{plans[-1].target}\nkeep_all: false\ndefault: null\n{state}tensors:\n{tensors}\n"
    )
    if measured is not None:  # read by no run: every candidate timed, and why this one
        text += yaml.safe_dump({"measured": measured.record()}, sort_keys=False, width=1000)
    preset.write_text(text)
    return [path, preset]
