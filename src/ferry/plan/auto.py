"""`offload=auto`: choose where each tagged tensor waits for the backward pass (device, offload,
remat) so that the step fits the target's HBM with the least recompute, offloading only what
the host link moves within the compute of a layer's forward pass.

The compiler decides: the all-on-device policy is compiled first, and if it does not fit, the
bytes it must shed come from its `memory_analysis()`. Tensors go to pinned host, largest first,
while each layer's copies take no longer on the host link than its forward matmuls at peak; if
that is not enough, the tensors whose recompute costs the fewest FLOPs per byte are
rematerialised. The choice is compiled again to check it, rematerialising more until it fits.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ferry.models.registry import abstract_model
from ferry.offload import LAYER_INPUT, Policy, record_tags
from ferry.plan.planner import MemoryPlan, for_target
from ferry.plan.targets import Target
from ferry.precision import cast_floating
from ferry.schedule import format_bytes, model_schedule
from ferry.train.config import FerryConfig

_SHAPE_ONLY = {
    "convert_element_type",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "sharding_constraint",
    "gather",
    "slice",
    "dynamic_slice",
    "concatenate",
    "select_n",
}
MAX_CHECKS = 4  # compiles spent verifying a choice before giving up


@dataclasses.dataclass(frozen=True)
class TensorCost:
    """One tagged tensor over all layers of one step (per device): what keeping it costs in HBM
    and what rematerialising it costs in FLOPs."""

    name: str
    bytes: int  # held in HBM by every layer's copy, per micro step
    layer_bytes: dict[str, int]  # per layer group: one layer's copies (a ring step tags its own)
    recompute_flops: float  # per micro step: its producing matmul in every layer


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    placement: str
    bytes: int
    recompute_flops: float
    reason: str


def dot_flops(eqn: Any) -> float:
    """2 x output elements x contracted size of a `dot_general` or `ragged_dot` equation."""
    out = math.prod(eqn.outvars[0].aval.shape)
    lhs = eqn.invars[0].aval.shape
    if eqn.primitive.name == "ragged_dot":
        return 2.0 * out * lhs[-1]
    (contract, _), _ = eqn.params["dimension_numbers"]
    return 2.0 * out * math.prod(lhs[d] for d in contract)


def _sub_jaxprs(eqn: Any) -> list[Any]:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def total_dot_flops(jaxpr: Any) -> float:
    """Matmul FLOPs of a jaxpr, loops counted by their length."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot"):
            total += dot_flops(eqn)
        repeat = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        total += repeat * sum(total_dot_flops(inner) for inner in _sub_jaxprs(eqn))
    return total


def producer_flops(jaxpr: Any, var: Any) -> float:
    """FLOPs of the matmul that produced `var`, looking through reshapes, casts, gathers and
    calls: what rematerialising the value recomputes. 0 when no matmul produced it."""
    producers = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    for _ in range(64):
        eqn = producers.get(var)
        if eqn is None:
            return 0.0
        if eqn.primitive.name in ("dot_general", "ragged_dot"):
            return dot_flops(eqn)
        inner = _sub_jaxprs(eqn)
        if len(inner) == 1 and len(inner[0].outvars) == len(eqn.outvars):
            return producer_flops(inner[0], inner[0].outvars[eqn.outvars.index(var)])
        if eqn.primitive.name not in _SHAPE_ONLY:
            return 0.0
        arrays = [v for v in eqn.invars if hasattr(v, "aval") and jnp.issubdtype(v.aval.dtype, jnp.floating)]
        if not arrays:
            return 0.0
        var = max(arrays, key=lambda v: math.prod(v.aval.shape))
    return 0.0


def layer_flops(model: Any, run: Callable[[Any, jax.Array], Any], x: jax.ShapeDtypeStruct) -> tuple[float, dict]:
    """One layer's forward matmul FLOPs and, per tag, its producing matmul's FLOPs."""

    names: list[str] = []

    def tagged_values(model: Any, x: jax.Array) -> Any:
        _, values = record_tags(run, model, x)
        names.extend(name for name, _ in values)  # traced once: the names in the outputs' order
        return [value for _, value in values]

    closed = eqx.filter_make_jaxpr(tagged_values)(model, x)[0]
    jaxpr = closed.jaxpr
    per_tag: dict[str, float] = {}
    for name, var in zip(names, jaxpr.outvars, strict=True):
        per_tag[name] = per_tag.get(name, 0.0) + producer_flops(jaxpr, var)
    return total_dot_flops(jaxpr), per_tag


def tensor_costs(config: FerryConfig, target: Target, mesh: Any) -> tuple[dict[str, TensorCost], dict[str, float]]:
    """Every tagged tensor's HBM bytes (sized on `mesh` by the transfer schedule) and recompute
    FLOPs, and each layer group's forward FLOPs, per device per micro step. FLOPs are traced on
    the whole micro batch and split evenly over the devices."""
    model_config = for_target(config.model, target)
    model = abstract_model(model_config)
    tagged = model.tagged_names()
    keep = Policy.from_dict({name: "device" for name in tagged})
    data_parallel = config.mesh.data_parallel
    rows = config.train.rows_per_micro_step(data_parallel)
    dtype = jnp.dtype(config.train.compute_dtype)
    schedule = model_schedule(model, keep, rows // data_parallel, config.train.seq_len, dtype, mesh=mesh)
    kinds = {kind.name: kind for kind in model.layer_kinds()}
    costs: dict[str, TensorCost] = {}
    forward: dict[str, float] = {}
    for group in schedule.groups:
        kind = kinds[group.name]
        x = jax.ShapeDtypeStruct((rows, config.train.seq_len - kind.seq_shrink, model.config.dim), dtype)
        flops, per_tag = layer_flops(cast_floating(model, dtype), kind.run, x)
        forward[group.name] = flops / config.mesh.num_devices
        layer_bytes: dict[str, int] = {}
        for residual in group.residuals:  # a ring step of expert parallelism tags its own copy
            layer_bytes[residual.name] = layer_bytes.get(residual.name, 0) + residual.bytes_per_device
        for name, size in layer_bytes.items():
            old = costs.get(name, TensorCost(name, 0, {}, 0.0))
            costs[name] = TensorCost(
                name,
                old.bytes + group.num_layers * size,
                old.layer_bytes | {group.name: size},
                old.recompute_flops + group.num_layers * per_tag.get(name, 0.0) / config.mesh.num_devices,
            )
    return costs, forward


def choose(
    costs: dict[str, TensorCost],
    forward_flops: dict[str, float],
    target: Target,
    excess_bytes: int,
    no_offload: frozenset[str] = frozenset(),
) -> list[Choice]:
    """Shed `excess_bytes` of HBM: offload largest first within each layer's transfer budget
    (never the tensors in `no_offload`), then rematerialise the cheapest recompute per byte."""
    budget = {
        group: flops / target.bf16_peak_flops * target.host_link_bandwidth for group, flops in forward_flops.items()
    }
    used = dict.fromkeys(budget, 0)
    shed = 0
    choices: dict[str, Choice] = {}
    for cost in sorted(costs.values(), key=lambda c: -c.bytes):
        if shed >= excess_bytes:
            break
        if cost.name not in no_offload and all(used[g] + b <= budget[g] for g, b in cost.layer_bytes.items()):
            for g, b in cost.layer_bytes.items():
                used[g] += b
            shed += cost.bytes
            worst = max(cost.layer_bytes, key=lambda g: used[g] / budget[g])
            choices[cost.name] = Choice(
                cost.name,
                "offload",
                cost.bytes,
                0.0,
                f"copies of a {worst} layer ({format_bytes(used[worst])} so far) take "
                f"{used[worst] / target.host_link_bandwidth * 1e3:.2f} ms of the "
                f"{forward_flops[worst] / target.bf16_peak_flops * 1e3:.2f} ms its forward matmuls take",
            )
    remat = [c for c in costs.values() if c.name not in choices and c.name != LAYER_INPUT]
    for cost in sorted(remat, key=lambda c: c.recompute_flops / max(c.bytes, 1)):
        if shed >= excess_bytes:
            break
        shed += cost.bytes
        choices[cost.name] = Choice(
            cost.name,
            "remat",
            cost.bytes,
            cost.recompute_flops,
            f"{cost.recompute_flops / max(cost.bytes, 1):.0f} recompute FLOPs per byte freed, the least left; "
            "the host link has no time left to move it",
        )
    for cost in costs.values():
        choices.setdefault(cost.name, Choice(cost.name, "device", cost.bytes, 0.0, "fits on device"))
    return [choices[name] for name in costs]


def policy_of(choices: list[Choice]) -> Policy:
    return Policy.from_dict({c.name: c.placement for c in choices})


def auto_plan(
    config: FerryConfig, target: Target, mesh: Any, compile_policy: Callable[[Policy, str], MemoryPlan]
) -> tuple[MemoryPlan, list[Choice]]:
    """Compile the all-on-device policy; if it does not fit, choose, compile the choice, and
    shed more per check until it fits: the bytes the estimate fell short by while tensors remain
    on device, else rematerialise the offloaded tensor cheapest to recompute (an offloaded
    residual still passes through HBM, so offloading frees less than its size)."""
    costs, forward = tensor_costs(config, target, mesh)
    keep = [Choice(c.name, "device", c.bytes, 0.0, "fits on device: no recompute, no copies") for c in costs.values()]
    plan = compile_policy(policy_of(keep), "auto")
    if plan.fits:
        return plan, keep
    excess = plan.device_bytes - plan.capacity_bytes
    no_offload: frozenset[str] = frozenset()
    for _ in range(MAX_CHECKS):
        choices = choose(costs, forward, target, excess, no_offload)
        plan = compile_policy(policy_of(choices), "auto")
        if plan.fits:
            break
        if any(c.placement == "device" for c in choices if c.name != LAYER_INPUT):
            excess += plan.device_bytes - plan.capacity_bytes  # the estimate fell short by this much
            continue
        offloaded = [costs[c.name] for c in choices if c.placement == "offload" and c.name != LAYER_INPUT]
        if not offloaded:
            break  # everything is rematerialised: nothing is left to shed
        cheapest = min(offloaded, key=lambda c: c.recompute_flops / max(c.bytes, 1))
        no_offload |= {cheapest.name}
    return plan, choices
