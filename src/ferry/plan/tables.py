"""`mode=plan`'s tables: the memory of each preset, their step estimates, each plan's host copies
and what the verifier found, and `offload=auto`'s candidates and choices.

A terminal is often 100 columns: a column that says the same in every row (each preset's
capacity, a plan with no host copies) is said once under the table instead (`folded`)."""

from collections.abc import Collection, Sequence

from rich.table import Table

from ferry.config.root import FerryConfig
from ferry.offload.schedule import format_bytes
from ferry.plan.auto import (
    HEADROOM,
    Choice,
    Tried,
    departures,
    fits_with_headroom,
    hbm_headroom,
)
from ferry.plan.auto_measure import MeasuredPick
from ferry.plan.auto_search import MIN_GAIN
from ferry.plan.copy_match import DEAD
from ferry.plan.estimate import REFERENCE, ranked
from ferry.plan.memory_plan import MemoryPlan
from ferry.xla.targets import TARGETS

HOST_POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # GiB of pinned host XLA's GPU client sets up
# the share of a GPU's HBM JAX's allocator takes, and its default where a platform leaves it unset: a
# program is planned against that pool, as a run's memory check (its `memory_stats()` limit) holds it
HBM_POOL_VARIABLE, DEFAULT_HBM_POOL = "XLA_CLIENT_MEM_FRACTION", 0.75


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def folded(
    title: str,
    caption: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    keep: Collection[str],
    right: Collection[str],
) -> Table:
    """A table of `rows` under `columns` (those in `right` right-aligned), narrowed for a terminal:
    a column whose rows all read "-" is left out, and one whose rows (two or more) all read the same
    is said once in the caption; the columns in `keep` are always shown."""
    shown, same = [], []
    for index, column in enumerate(columns):
        values = {row[index] for row in rows}
        if column in keep or not rows or (len(rows) == 1 and values != {"-"}):
            shown.append(index)
        elif values != {"-"} and len(values) == 1:
            same.append(f"{column} {values.pop()}")
        elif values != {"-"}:
            shown.append(index)
    note = "every row: " + ", ".join(same) if same else ""
    table = Table(
        title=title, caption="; ".join(part for part in (note, caption) if part) or None, caption_justify="left"
    )
    for index in shown:
        table.add_column(columns[index], justify="right" if columns[index] in right else "left")
    for row in rows:
        table.add_row(*(row[index] for index in shown))
    return table


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
    columns = ("preset", "arguments", "outputs", "temp", "HBM total", "capacity", "verdict", "pinned host") + (
        "matmul TFLOP",
        "copies exposed",
        "compile",
        "planned",
    )
    rows = [_plan_row(plan) for plan in plans]
    return folded(
        f"{config.model_name} on {first.target} x {config.mesh.num_devices} ({first.mesh}), "
        f"batch {config.train.global_batch_size} x {config.train.seq_len}: per device",
        "compile options: " + ", ".join(f"{k}={v}" for k, v in first.compile_options) + pool + bound,
        columns,
        rows,
        keep=("preset", "HBM total", "verdict"),
        right=set(columns) - {"preset", "verdict", "planned"},
    )


def _plan_row(plan: MemoryPlan) -> Sequence[str]:
    """One preset's row of `plan_table`: what XLA said it needs where it refused to compile it."""
    summary = plan.transfer_summary
    if plan.compile_oom is not None:  # no program: what XLA said it needs, the arguments, and nothing else
        return (
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
    return (
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


def estimate_table(plans: list[MemoryPlan]) -> Table:
    """Each preset's step-time estimate (`ferry.plan.estimate`), fastest first."""
    target = plans[0].target
    caption = (
        "estimate: matmuls at the target's matmul rate (its dense bf16 peak, times the compute fraction "
        "measured on a v5e chip) + host copies left exposed + collectives over the "
        "interconnect (targets.py); best overlaps collectives with compute, worst adds them, middle is halfway "
        f"(ranked by it, then the worst); model TFLOPs by MaxText's convention; speed-up: {REFERENCE}'s middle "
        "estimate over the preset's"
    )
    compiled = {p.policy: p.estimate for p in plans if p.compile_oom is None}
    # with no collectives best, middle and worst are one figure: one column
    spread = any(e.best_seconds != e.worst_seconds for e in compiled.values())
    steps = ("best", "middle", "worst") if spread else ("step",)
    columns = ("rank", "preset", "verdict", "matmuls", "copies exposed", "collectives", *steps)
    columns += ("TFLOPs/s/device", f"vs {REFERENCE}")
    rows: list[Sequence[str]] = []
    for rank, (name, estimate, speedup) in enumerate(ranked(compiled), 1):
        plan = next(p for p in plans if p.policy == name)
        seconds = (
            (estimate.best_seconds, estimate.middle_seconds, estimate.worst_seconds)
            if spread
            else (estimate.middle_seconds,)
        )
        tflops = f"{estimate.best_tflops:.1f}" + (f" - {estimate.worst_tflops:.1f}" if spread else "")
        rows.append(
            (
                str(rank),
                name,
                "FITS" if plan.fits else "OOM",
                format_seconds(estimate.matmul_seconds),
                format_seconds(estimate.exposed_copy_seconds),
                format_seconds(estimate.collective_seconds),
                *(format_seconds(s) for s in seconds),
                tflops,
                "-" if speedup is None else f"{speedup:.3f}x",
            )
        )
    for plan in plans:
        if plan.compile_oom is not None:
            rows.append(("-", plan.policy, "OOM (XLA refused to compile it)", *["-"] * (len(columns) - 3)))
    return folded(
        f"step-time ESTIMATE on {target} (per device; from the compiled program, not measured)",
        caption,
        columns,
        rows,
        keep=("rank", "preset", "verdict", *steps),
        right=set(columns) - {"preset", "verdict"},
    )


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
            "its loop, where their copies may overlap the loss head: docs/concepts/schedule.md, "
            '"Peeling the stack\'s ends")'
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
    columns = ("tensor", "direction", "engine", "shape", "bytes", "x per step", "transfer", "hiding compute", "hidden")
    rows = [
        (
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
        for t in plan.transfers
    ]
    return folded(
        f"{plan.policy}: host copies in the compiled program (per device)",
        caption,
        columns,
        rows,
        keep=("tensor", "direction", "hidden"),
        right=("bytes", "x per step", "transfer", "hiding compute"),
    )


def verification_notes(plan: MemoryPlan) -> str:
    """What the verifier found besides each tensor's copies: the recompute check, and host copies
    of no offloaded tensor's size."""
    verification = plan.verification
    assert verification is not None
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
    return "; ".join(caption)


def verification_table(plan: MemoryPlan) -> Table:
    """The compiled program checked against the plan (`ferry.plan.verify`): each offloaded
    tensor's copies per step, listed and found, and the walks of its host slices in loops."""
    verification = plan.verification
    assert verification is not None
    table = Table(
        title=f"{plan.policy}: the compiled program checked (per device, per step)", caption=verification_notes(plan)
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
    headroom = hbm_headroom(tried[0].plan) if tried else 0.0
    table = Table(
        title="offload=auto: candidates compiled (per device; step times are ESTIMATES)",
        caption=f"fits: HBM keeps {headroom:.0%} free (the target's hbm_headroom), "
        f"the pinned host pool {HEADROOM:.0%}; "
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
        moved = [f"{name}={value}" for name, value in departures(t.values).items()]
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
        moved = ", ".join(f"{k}={v}" for k, v in departures(c.values).items()) or "(all on device)"
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
