"""`plan.extrapolate`: plan a deep model from shallow compiles of it.

A scanned stack runs one loop body per layer, so everything the planner reads from a compiled step
grows by the same amount with each layer of a group: the parameters, optimizer state and gradients
(arguments, outputs), the residuals the forward pass keeps for the backward pass (temporaries or
pinned host bytes), the loop's FLOPs, host copies and collectives. Each of those is affine in the
groups' depths. The step is therefore compiled with `BASE_DEPTH` layers in every deep group and
once more per deep group with `STEP` layers more, and each quantity is extended along the lines
through those points to the model's real depth. A group of at most `WHOLE_DEPTH` layers (DeepSeek-
V3's three dense layers, an MTP block) is compiled whole.

Temporaries are the exception: they are the peak of XLA's buffer assignment, which packs buffers
differently at small depths, so the probes are at 6 and 8 layers, past where Llama 3.1 8B's
temporaries turned affine; probes at 2 and 3 under-estimated them. With XLA's own
rematerialisation pass on (gpu.yaml turns it off), a program near its HBM limit is not on the line
either: XLA recomputes to relieve the pressure, where the shallow probes, far from it, do not
(docs/results/deviceless.md, "Shallow compiles of a deep stack").

That is why it is not the default (`plan.extrapolate=false`): at the DeepSeek-V3 reference plan
(moe_offload, 128 GB200) the line through 6 and 8 MoE layers under-estimates the whole program's
temporaries, as the peak moves to where more layers' buffers are live; and a scanned stack compiles
its layer once whatever its depth, so the whole model compiles in about the time of one probe
(docs/results/reference-plans.md, "How fast it plans").
"""

import dataclasses
import functools
import operator
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ferry.models.base import AbstractModelConfig
from ferry.plan.estimate import CollectiveTraffic
from ferry.plan.memory_plan import MemoryPlan
from ferry.plan.transfers import Transfer, TransferSummary

BASE_DEPTH = 6
STEP = 2
WHOLE_DEPTH = 8


class ExtrapolationError(ValueError):
    """The shallow compiles differ in structure (not only in their loops' length): the plan needs
    the full compile."""


def group_depths(model_config: AbstractModelConfig) -> dict[str, int]:
    """Each scanned layer group's depth (the groups `with_depths` can change): the family's
    stacks, as its config declares them."""
    return model_config.stack_depths()


def with_depths(model_config: AbstractModelConfig, depths: dict[str, int]) -> AbstractModelConfig:
    """`model_config` with its scanned groups `depths` layers deep (the family knows which of its
    fields that changes)."""
    return model_config.with_stack_depths(depths)


def probe_depths(full: dict[str, int]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """The base compile's depths and, per group deep enough to extrapolate, a compile with `STEP`
    layers more in that group."""
    base = {name: BASE_DEPTH if depth > WHOLE_DEPTH else depth for name, depth in full.items()}
    steps = {name: base | {name: base[name] + STEP} for name, depth in full.items() if depth > WHOLE_DEPTH}
    return base, steps


def describe(base: dict[str, int], steps: dict[str, dict[str, int]], full: dict[str, int]) -> str:
    return (
        "; ".join(f"{name} {full[name]} from {base[name]} and {base[name] + STEP}" for name in steps)
        or "compiled whole"
    )


def extrapolated_plan(
    compile_at: Callable[[dict[str, int]], MemoryPlan], full: dict[str, int], model_flops: float
) -> MemoryPlan:
    """Compile at the probe depths (`compile_at(depths)`, side by side) and extend each quantity to `full`.
    The result keeps the base compile's verification (the shallow program's copies and walks) and
    records how it was made in `extrapolated`."""
    base_depths, step_depths = probe_depths(full)
    probes = [base_depths, *step_depths.values()]
    with ThreadPoolExecutor(max_workers=max(1, min(len(probes), os.cpu_count() or 1))) as pool:  # a core each
        base, *stepped = pool.map(compile_at, probes)
    if any(plan.compile_oom is not None for plan in (base, *stepped)):  # no program to extend: compile the whole
        raise ExtrapolationError("a shallow compile is over HBM already (XLA refused it)")
    steps = dict(zip(step_depths, stepped, strict=True))
    extra = {name: full[name] - base_depths[name] for name in steps}

    def line(read: Callable[[MemoryPlan], Any]) -> Any:
        at_base = read(base)
        value = at_base + sum((read(plan) - at_base) * extra[name] / STEP for name, plan in steps.items())
        return round(value) if isinstance(at_base, int) else value

    return dataclasses.replace(
        base,
        argument_bytes=line(lambda p: p.argument_bytes),
        output_bytes=line(lambda p: p.output_bytes),
        alias_bytes=line(lambda p: p.alias_bytes),
        temp_bytes=line(lambda p: p.temp_bytes),
        host_bytes=line(lambda p: p.host_bytes),
        flops=line(lambda p: p.flops),
        flops_bound=None if base.flops_bound is None else line(lambda p: p.flops_bound),
        matmuls=line(lambda p: p.matmuls),
        transfers=_transfers(base, steps, extra),
        transfer_summary=TransferSummary(
            *(line(operator.attrgetter(f"transfer_summary.{f.name}")) for f in dataclasses.fields(TransferSummary))
        ),
        compile_seconds=base.compile_seconds + sum(plan.compile_seconds for plan in steps.values()),
        profile_cached=base.profile_cached and all(plan.profile_cached for plan in steps.values()),
        collectives=CollectiveTraffic(
            {
                op: line(functools.partial(_collective_bytes, op))
                for op in set(base.collectives.bytes).union(*(p.collectives.bytes for p in steps.values()))
            },
            line(lambda p: p.collectives.seconds),
        ),
        model_flops=model_flops,
        extrapolated=describe(base_depths, step_depths, full),
    )


def _collective_bytes(op: str, plan: MemoryPlan) -> float:
    return plan.collectives.bytes.get(op, 0.0)


def _transfers(base: MemoryPlan, steps: dict[str, MemoryPlan], extra: dict[str, int]) -> tuple[Transfer, ...]:
    """The base compile's host copies, each run as often as the line through the compiles gives:
    a copy in a layer loop runs once more per layer. The compiles must schedule the same copies."""

    def key(t: Transfer) -> tuple:
        return t.tensor, t.direction, t.shape, t.bytes

    for name, plan in steps.items():
        if sorted(map(key, plan.transfers)) != sorted(map(key, base.transfers)):
            raise ExtrapolationError(
                f"{base.policy}: the compiles with {name} layers deeper schedule other host copies than the base's"
            )

    def order(plan: MemoryPlan) -> list[Transfer]:  # copies of one tensor and direction by how often they run
        return sorted(plan.transfers, key=lambda t: (key(t), t.executions))

    ordered = {name: order(plan) for name, plan in steps.items()}
    result = []
    for i, transfer in enumerate(order(base)):
        executions = transfer.executions + round(
            sum((ordered[name][i].executions - transfer.executions) * extra[name] / STEP for name in steps)
        )
        result.append(dataclasses.replace(transfer, executions=executions))
    return tuple(result)
