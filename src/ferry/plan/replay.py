"""What one layer's backward pass reads and recomputes, found on its jaxpr (traced abstractly on
the CPU, nothing computed): the planner's verifier asks it why a copy is missing from a compiled
program and which tag keeps its producer alive.

A value is *needed* when the gradients depend on it. Dependence is followed through the
equations whose inner jaxpr maps inputs to outputs one to one (calls, custom derivatives,
`device_put`, optimisation barriers); any other equation with an inner jaxpr (a `scan`, a
`cond`) needs all its inputs once any of its outputs is needed. The walk therefore never calls a
needed value unneeded: "never read by the backward pass" is a proof, not a guess.
"""

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex
from jax.sharding import Mesh

from ferry.offload.engine import COPY_SCOPE, LAYER_INPUT, Policy, offloaded, record_tags, tagged_names
from ferry.precision import cast_floating
from ferry.xla.expected_work import expected_fraction

_MATMULS = ("dot_general", "ragged_dot")
_ONE_TO_ONE = ("device_put", "optimization_barrier")  # output k is input k, moved or fenced
# a loop's body maps its inputs to its outputs one to one too, but a carry feeds the next trip:
# one pass over the body would miss what a needed carry needs, so a loop needs all its inputs
_LOOPS = ("scan", "while")


@dataclasses.dataclass(frozen=True)
class LayerGroupTrace:
    """One kind of layer of a model, as the verifier traces it: `run(model, x)` on an input of
    `input_shape` in `dtype` (the compute dtype of the step)."""

    name: str
    run: Callable[[Any, jax.Array], Any]
    input_shape: tuple[int, ...]
    dtype: Any


def _is_host(sharding: Any) -> bool:
    kind = getattr(sharding, "memory_kind", None)
    return kind == "pinned_host" or sharding == jax.memory.Space.Host


def _inner_jaxprs(eqn: Any) -> list[Any]:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jex.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jex.Jaxpr):
                found.append(item)
    return found


@dataclasses.dataclass
class _Needed:
    """The equations the gradients need, counted with the trip counts of the loops around them."""

    host_copies: int = 0  # device_puts to pinned host
    host_scopes: list[str] = dataclasses.field(default_factory=list)  # each one's whole name stack
    matmuls: float = 0.0  # every execution the program holds
    matmul_flops: float = 0.0  # of work marked as run in part (`ferry.xla.expected_work`), what runs


def dot_flops(eqn: Any) -> float:
    """2 x output elements x contracted size of a `dot_general` or `ragged_dot` equation."""
    out = math.prod(eqn.outvars[0].aval.shape)
    lhs = eqn.invars[0].aval.shape
    if eqn.primitive.name == "ragged_dot":
        return 2.0 * out * lhs[-1]
    (contract, _), _ = eqn.params["dimension_numbers"]
    return 2.0 * out * math.prod(lhs[d] for d in contract)


def _share(eqn: Any) -> float:
    """The share of an equation's work that runs (`ferry.xla.expected_work`; the scopes of its inner
    jaxprs' equations are relative to it, so the share passes down to them)."""
    return expected_fraction(str(eqn.source_info.name_stack))


def _loop_trips(eqn: Any) -> int:
    """How often a scan's body runs per run of the scan (once for any other equation)."""
    return eqn.params["length"] if eqn.primitive.name == "scan" else 1


def kernel_flops(eqn: Any, share: float = 1.0) -> float:
    """Matmul FLOPs of a Pallas kernel: its body's (one block's work) times its grid (counted
    once, splash attention's forward was priced at a sliver of its work: docs/results/deviceless.md).
    A grid dimension can be dynamic, its size an operand known only when the kernel runs (megablox's
    row tiles, as many as the routing visits): such a kernel counts as its own cost estimate, the
    count the compiled program's custom call is priced with too (`ferry.xla.hlo_flops`), or,
    declaring none, as its static dimensions alone (a lower bound). The body's matmuls are not
    counted as matmul ops: the compiled program runs one custom call for them."""
    static = [d for d in eqn.params["grid_mapping"].grid if isinstance(d, int)]  # a dynamic one is no int
    dynamic = len(static) < len(eqn.params["grid_mapping"].grid)
    estimate = getattr(eqn.params.get("cost_estimate"), "flops", None)
    if dynamic and estimate:
        return share * float(estimate)
    return sum(total_dot_flops(inner, share * math.prod(static)) for inner in _inner_jaxprs(eqn))


def total_dot_flops(jaxpr: Any, share: float = 1.0) -> float:
    """Matmul FLOPs of every equation of a jaxpr, needed or not, a scan's body counted by its
    length and a kernel's by its grid; of work the model marked as run in part
    (`ferry.xla.expected_work`), what runs."""
    total = 0.0
    for eqn in jaxpr.eqns:
        runs = share * _share(eqn)
        if eqn.primitive.name in _MATMULS:
            total += runs * dot_flops(eqn)
        elif eqn.primitive.name == "pallas_call":
            total += kernel_flops(eqn, runs)
        else:
            total += sum(total_dot_flops(inner, _loop_trips(eqn) * runs) for inner in _inner_jaxprs(eqn))
    return total


def _walk(
    jaxpr: Any, needed_out: list[bool], found: _Needed, times: float, share: float = 1.0, scope: str = ""
) -> list[bool]:
    """Mark what `jaxpr` needs to produce the outputs flagged in `needed_out`; returns which of
    its inputs are needed. `times`: how often it runs; `share`: of its marked work, what runs;
    `scope`: the name stack around it (an inner jaxpr's equations name theirs relative to it)."""
    needed = {v for v, n in zip(jaxpr.outvars, needed_out, strict=True) if n and isinstance(v, jex.Var)}
    for eqn in reversed(jaxpr.eqns):
        outs = [isinstance(o, jex.Var) and not isinstance(o, jex.DropVar) and o in needed for o in eqn.outvars]
        if not any(outs):
            continue
        name = eqn.primitive.name
        inner = _inner_jaxprs(eqn)
        runs = share * _share(eqn)
        where = f"{scope}|{eqn.source_info.name_stack}"
        ins = [True] * len(eqn.invars)
        if name in _ONE_TO_ONE and len(eqn.invars) == len(eqn.outvars):
            ins = outs
            if name == "device_put":
                copies = sum(
                    1 for out, to in zip(outs, eqn.params.get("devices", ()), strict=False) if out and _is_host(to)
                )
                found.host_copies += copies
                found.host_scopes += [where] * copies
        elif name in _MATMULS:
            found.matmuls += times
            found.matmul_flops += times * runs * dot_flops(eqn)
        elif name == "pallas_call":  # its body writes the outputs through refs: any one needs all its work
            flops = kernel_flops(eqn, runs)
            found.matmuls += times if flops > 0 else 0  # one custom call, as `hlo_flops.matmul_count` counts it
            found.matmul_flops += times * flops
        elif (
            name not in _LOOPS
            and len(inner) == 1
            and len(inner[0].invars) == len(eqn.invars)
            and len(inner[0].outvars) == len(eqn.outvars)
        ):
            ins = _walk(inner[0], outs, found, times, runs, where)
        else:
            for sub in inner:
                _walk(sub, [True] * len(sub.outvars), found, times * _loop_trips(eqn), runs, where)
        needed.update(v for v, n in zip(eqn.invars, ins, strict=True) if n and isinstance(v, jex.Var))
    return [isinstance(v, jex.Var) and v in needed for v in jaxpr.invars]


def _cotangent(out: Any) -> Any:
    if jnp.issubdtype(out.dtype, jnp.inexact):
        return jnp.ones(out.shape, out.dtype)
    return np.zeros(out.shape, jax.dtypes.float0)


def _needed(model: Any, group: LayerGroupTrace, policy: Policy) -> _Needed:
    """Trace the gradient of one layer of `group` under `policy` (through the engine, or plain
    autodiff for `save_all`) and count what it needs."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))  # tracing only: any backend with memory kinds
    layer = group.run if policy.keep_all else offloaded(group.run, policy, check_names=False)

    def gradients(model: Any, x: Any) -> Any:  # x: the layer input, traced from a ShapeDtypeStruct
        out, vjp = eqx.filter_vjp(lambda m, h: layer(cast_floating(m, group.dtype), h), model, x)
        return out, vjp(jax.tree.map(_cotangent, out))  # the output too: in a model the next layer reads it

    x = jax.ShapeDtypeStruct(group.input_shape, group.dtype)
    with jax.set_mesh(mesh):
        closed = eqx.filter_make_jaxpr(gradients)(model, x)[0]
    found = _Needed()
    _walk(closed.jaxpr, [True] * len(closed.jaxpr.outvars), found, 1.0)
    return found


def _alone(policy: Policy, tensors: Iterable[str]) -> Policy:
    """`policy` with only `tensors` offloaded: what else it offloads stays on device, and the layer
    input, unless it is one of them or the policy places it, is kept on device."""
    placements = {name: ("device" if p == "offload" else p) for name, p in dict(policy.placements).items()}
    placements |= dict.fromkeys(tensors, "offload")
    placements.setdefault(LAYER_INPUT, "device")
    return Policy.from_dict(placements)


def read_by_backward(model: Any, group: LayerGroupTrace, policy: Policy, tensor: str) -> bool:
    """Does the backward pass of a `group` layer read `tensor` when `policy` offloads it? Traced
    with only `tensor` offloaded (everything else placed as `policy` places it, on device where
    it offloads): its host copy is needed exactly when the backward pass reads the value."""
    return _needed(model, group, _alone(policy, [tensor])).host_copies > 0


# the tensor a host copy moves, from its name stack (`ferry.offload.engine.copy_scope`, inside transforms)
_TO_HOST = re.compile(rf"{COPY_SCOPE}/[^/()|]+/([^/()|]+)/to_host")


def backward_reads(model: Any, group: LayerGroupTrace, policy: Policy, tensors: Iterable[str]) -> dict[str, bool]:
    """`read_by_backward` for each of `tensors`, with one trace for all of them where it can: the
    tensors `policy` keeps or offloads (not the layer input, nor one it rematerialises, whose
    placement changes what the others' replay reads) are offloaded together, and each one's host
    copies are told apart by their copy scope. Moving a saved value between device and host
    changes no dependence, so each answer is the one tensor's own trace's. Where a needed host
    copy names no such tensor, each is traced alone."""
    tensors = sorted(set(tensors))
    together = [t for t in tensors if t != LAYER_INPUT and policy.placement(t) != "remat"]
    reads: dict[str, bool] = {}
    if len(together) > 1:
        found = _needed(model, group, _alone(policy, together))
        moved = [_TO_HOST.search(scope) for scope in found.host_scopes]
        named = {m.group(1) for m in moved if m is not None}
        if all(m is not None for m in moved) and named <= set(together):
            reads = {t: t in named for t in together}
    return reads | {t: read_by_backward(model, group, policy, t) for t in tensors if t not in reads}


def record_names(model: Any, group: LayerGroupTrace) -> frozenset[str]:
    """The names a `group` layer tags (with the layer input), found abstractly, its weights cast to
    the group's dtype as training runs it (which attention kernel runs depends on the dtype)."""
    run = lambda m, h: group.run(cast_floating(m, group.dtype), h)
    return tagged_names(run, model, jax.ShapeDtypeStruct(group.input_shape, group.dtype))


def all_saved(policy: Policy, tagged: frozenset[str] | set[str]) -> Policy:
    """`policy` with nothing rematerialised: each of the `tagged` names kept where the policy
    keeps or offloads it, the rest on device. Its matmuls equal `save_all`'s unless a saved
    value's producer is recomputed anyway."""
    if policy.keep_all:
        return policy
    return Policy.from_dict({name: policy.placement(name).replace("remat", "device") for name in tagged})


def matmul_fed(model: Any, group: LayerGroupTrace) -> frozenset[str]:
    """The tags of a `group` layer whose value a matmul of the layer feeds through untagged
    values (`tanh(x @ w)`, `x @ w`; not `norm(x)`, nor `silu(u)` of another tag `u`): the ones
    whose saving can spare a recomputed matmul."""
    names: list[str] = []

    def tagged_values(model: Any, x: Any) -> Any:  # x: the layer input, traced from a ShapeDtypeStruct
        _, values = record_tags(group.run, model, x)
        names.extend(name for name, _ in values)
        return [value for _, value in values]

    x = jax.ShapeDtypeStruct(group.input_shape, group.dtype)
    jaxpr = eqx.filter_make_jaxpr(tagged_values)(cast_floating(model, group.dtype), x)[0].jaxpr
    producers: dict[Any, Any] = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    fed = set()
    for name, var in zip(names, jaxpr.outvars, strict=True):
        others = {v for v in jaxpr.outvars if v is not var}
        stack, seen = [var], set()
        while stack:
            eqn = producers.get(stack.pop())
            if eqn is None or id(eqn) in seen:
                continue
            seen.add(id(eqn))
            if eqn.primitive.name in _MATMULS or any(_has_matmul(inner) for inner in _inner_jaxprs(eqn)):
                fed.add(name)
                break
            stack += [v for v in eqn.invars if isinstance(v, jex.Var) and v not in others]
    return frozenset(fed)


def _has_matmul(jaxpr: Any) -> bool:
    return any(e.primitive.name in _MATMULS or any(_has_matmul(i) for i in _inner_jaxprs(e)) for e in jaxpr.eqns)


def recomputed_producers(model: Any, group: LayerGroupTrace, policy: Policy, tagged: list[str]) -> list[str]:
    """The tags of a `group` layer the backward pass reads but whose saving spares no matmul: the
    gradient of the layer with every tag saved (`all_saved`) needs as many matmuls as with that
    one tag rematerialised, so its producer runs again either way (a tag on a nonlinear output,
    whose tangent needs the recomputed matmul). Only tags a matmul feeds (`matmul_fed`) can be
    blamed; a tag the backward pass never reads (`mlpwo`) costs no recompute either way."""
    base = dict(all_saved(policy, set(tagged)).placements)
    saved = _needed(model, group, Policy.from_dict(base)).matmuls
    blamed = []
    for name in sorted(matmul_fed(model, group) - {LAYER_INPUT}):
        without = _needed(model, group, Policy.from_dict(base | {name: "remat"})).matmuls
        if math.isclose(without, saved) and read_by_backward(model, group, policy, name):
            blamed.append(name)
    return blamed


def recompute_flops(model: Any, group: LayerGroupTrace, tagged: frozenset[str] | set[str]) -> dict[str, float]:
    """What rematerialising each of the `tagged` names alone costs the gradient of one `group`
    layer, in matmul FLOPs: what it needs with that name recomputed beyond what it needs with
    every name saved. Not the producing matmul's FLOPs: a name the backward pass never reads
    (`mlpwo`, read only by the residual sum) costs nothing, nor does one whose producer runs
    again anyway (`recomputed_producers`)."""
    base = {name: "device" for name in tagged}
    saved = _needed(model, group, Policy.from_dict(base)).matmul_flops
    return {
        name: _needed(model, group, Policy.from_dict(base | {name: "remat"})).matmul_flops - saved
        for name in sorted(set(tagged) - {LAYER_INPUT})
    }


def untagged_matmuls(model: Any, group: LayerGroupTrace, policy: Policy, tagged: list[str]) -> float:
    """Matmuls the gradient of one `group` layer needs with every tag saved (`all_saved`) beyond
    plain autodiff's (`save_all`): those whose output nobody tags, which the replay recomputes
    between saved values (an attention's scores, which its softmax's gradient reads)."""
    saved = _needed(model, group, all_saved(policy, set(tagged))).matmuls
    return saved - _needed(model, group, Policy.save_all()).matmuls
