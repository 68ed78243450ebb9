"""`offload=auto`: choose where each tagged tensor waits for the backward pass (device, offload,
remat), and any further placement choice (`Decision`), for the shortest estimated step
(`ferry.plan.estimate`; the middle estimate, then the worst: `banded_rank`) that fits the
target's HBM with its `hbm_headroom` to spare and its pinned host pool with `HEADROOM`.

The compiler decides: the all-on-device policy is compiled first; it gives the HBM, the matmul time
and the collective time every other candidate is predicted from. Each option of a decision frees
HBM, takes pinned host, costs recompute FLOPs (the matmuls a layer's backward pass runs again for
it, traced: `replay.recompute_flops`) or host copies (exposed where a layer's copies outlast its
compute: the forward pass for the copies out, the backward pass, twice the forward, for the copies
back). A branch-and-bound search over every combination finds the candidate of the least predicted
step time that is predicted to fit; it is compiled, and its compiled program decides whether it
fits and what its estimate is. From then on each candidate is predicted from the compiled program
nearest to it (`anchored`: the fewest decisions apart), and the search runs again, until no
candidate left is predicted faster than the fastest compiled one that fits by more than `MIN_GAIN`
of its step (closer is a tie the estimate cannot resolve), or `MAX_CHECKS` compiles are spent.
Where nothing is predicted to fit, the candidate freeing the most HBM is compiled: the closest.

Where the run leaves `offload.peel` at 0, the all-on-device program's twin with `offload.auto.peel`
end layers of each stack out of the loop is compiled too (`PEEL`, `peel_choice`): where the loop is
over HBM, and wherever the candidates will be timed on the chip (`measuring`), the loop fitting or
not. XLA packs an unrolled stack's buffers otherwise than a loop's, and the chip runs it otherwise:
on the v5e chip `minimal`'s twin fit where its loop was over HBM and beat full_remat, and where the
loop fit too the twin was both smaller and faster (docs/results/tpu-v5e.md, runs 6 and 8). The
estimate cannot tell the two apart (the same FLOPs, the same copies); only timing can, so a plan
that does not time keeps the twin to where the loop does not fit. It is a candidate beside the
search's, not one of its decisions: what peeling frees does not add to what the placements free
(in llama_tiny's programs it frees HBM with every tensor kept and takes more with some
rematerialised).
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ferry.config.root import FerryConfig
from ferry.config.train import DEVICE, DEVICE_STATE, HOST, StatePlacement
from ferry.models.registry import abstract_model
from ferry.offload.engine import LAYER_INPUT, Policy
from ferry.offload.schedule import model_schedule
from ferry.plan.auto_search import (
    Baseline,
    Decision,
    Option,
    Prediction,
    anchored,
    banded_rank,
    faster,
    fastest_fitting,
    predict,
)
from ferry.plan.here import hbm_headroom_of, offers_copies
from ferry.plan.memory_plan import MemoryPlan
from ferry.plan.planner import for_target
from ferry.plan.replay import LayerGroupTrace, backward_reads, recompute_flops, record_names, total_dot_flops
from ferry.precision import cast_floating
from ferry.sharding import attention_platform
from ferry.train.state_layout import run_state_layout
from ferry.train.state_memory import MASTER_WEIGHTS, MOMENTS, float_params, state_copies
from ferry.xla.targets import Target

MAX_CHECKS = 6  # candidates compiled after the all-on-device one (and its peeled twin), at most
PEEL = "offload.peel"  # a candidate's value for how many end layers of each stack run outside its loop


@dataclasses.dataclass(frozen=True)
class TensorCost:
    """One tagged tensor over all layers of one step (per device): what keeping it costs in HBM
    and what rematerialising it costs in FLOPs."""

    name: str
    bytes: int  # held in HBM by every layer's copy, per micro step
    layer_bytes: dict[str, int]  # per layer group: one layer's copies (a ring step tags its own)
    recompute_flops: float  # per micro step: what every layer's backward pass recomputes for it


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    placement: str
    bytes: int
    recompute_flops: float
    reason: str


def forward_flops(model: Any, run: Callable[[Any, Any], Any], x: jax.ShapeDtypeStruct) -> float:
    """One layer's forward matmul FLOPs."""
    return total_dot_flops(eqx.filter_make_jaxpr(run)(model, x)[0].jaxpr)


def tensor_costs(config: FerryConfig, target: Target, mesh: Any) -> tuple[dict[str, TensorCost], dict[str, float]]:
    """Every tagged tensor's HBM bytes (sized on `mesh` by the transfer schedule; none where the
    backward pass never reads it) and recompute FLOPs, and each layer group's forward FLOPs, per
    device per micro step. FLOPs are traced on the whole micro batch and split evenly over the
    devices, with the attention kernel the target runs (`attention_platform`)."""
    with attention_platform(target.platform):
        return _tensor_costs(config, target, mesh)


def _tensor_costs(config: FerryConfig, target: Target, mesh: Any) -> tuple[dict[str, TensorCost], dict[str, float]]:
    model_config = for_target(config.model, target)
    model = abstract_model(model_config)
    tagged = model.tagged_names()
    keep = Policy.from_dict({name: "device" for name in tagged})
    data_parallel = config.mesh.data_parallel
    rows = config.train.rows_per_micro_step(data_parallel)
    dtype = jnp.dtype(config.train.compute_dtype)
    schedule = model_schedule(model, keep, rows, config.train.seq_len, dtype, mesh=mesh)
    kinds = {kind.name: kind for kind in model.layer_kinds()}
    costs: dict[str, TensorCost] = {}
    forward: dict[str, float] = {}
    for group in schedule.groups:
        kind = kinds[group.name]
        trace = LayerGroupTrace(
            kind.name, kind.run, (rows, config.train.seq_len - kind.seq_shrink, model.config.dim), dtype
        )
        x = jax.ShapeDtypeStruct(trace.input_shape, dtype)
        forward[group.name] = forward_flops(cast_floating(model, dtype), kind.run, x) / config.mesh.num_devices
        per_tag = recompute_flops(model, trace, record_names(model, trace))
        # a tag the backward pass never reads with the other tags on device, the baseline every
        # prediction starts from, frees nothing there (`mlpwo`; MLA's `mla_q` while `query_proj` is kept)
        read = backward_reads(model, trace, keep, per_tag) | {LAYER_INPUT: True}
        layer_bytes: dict[str, int] = {}
        for residual in group.residuals:  # a ring step of expert parallelism tags its own copy
            size = residual.bytes_per_device if read[residual.name] else 0
            layer_bytes[residual.name] = layer_bytes.get(residual.name, 0) + size
        for name, size in layer_bytes.items():
            old = costs.get(name, TensorCost(name, 0, {}, 0.0))
            costs[name] = TensorCost(
                name,
                old.bytes + group.num_layers * size,
                old.layer_bytes | {group.name: size},
                old.recompute_flops + group.num_layers * per_tag.get(name, 0.0) / config.mesh.num_devices,
            )
    return costs, forward


HEADROOM = 0.05  # of the pinned host pool left free by auto's choice; of HBM, the target's `hbm_headroom`


def tensor_decisions(costs: dict[str, TensorCost], micro_steps: int, copies: bool = True) -> list[Decision]:
    """device / offload / remat for every tagged tensor the backward pass reads (the layer input is
    never recomputed: it is what recompute starts from). An offloaded residual still passes
    through HBM a layer at a time, so offloading frees its bytes less one layer's copy. Without
    `copies` (a CPU, whose pinned host is its own memory: `ferry.plan.here`) there is no offload."""
    decisions = []
    for cost in costs.values():
        if not cost.bytes:  # never read by the backward pass: every placement is the same
            continue
        staged = max(cost.layer_bytes.values(), default=0)
        options = [Option("device")]
        if copies:
            layers = tuple(sorted(cost.layer_bytes.items()))
            options.append(Option("offload", float(cost.bytes - staged), float(cost.bytes), 0.0, layers))
        if cost.name != LAYER_INPUT:
            options.append(Option("remat", float(cost.bytes), 0.0, cost.recompute_flops * micro_steps))
        decisions.append(Decision(cost.name, tuple(options)))
    return decisions


# offload=auto's decisions on the train state, named by their run-config keys: the StatePlacement
# field each sets, and what it moves
STATE_DECISIONS = {"offload.optimizer": ("optimizer", MOMENTS), "offload.params": ("params", MASTER_WEIGHTS)}


def state_of(values: Mapping[str, str], base: StatePlacement = DEVICE_STATE) -> StatePlacement:
    """The train state's placement that a candidate's decision values name (how it streams, and what
    no decision names: `base`'s)."""
    placed: dict[str, Any] = {
        field: values.get(name, getattr(base, field)) for name, (field, _) in STATE_DECISIONS.items()
    }
    return dataclasses.replace(base, **placed)


def state_values(state: StatePlacement) -> dict[str, str]:
    """The state decisions' values of a placement: `state_of`'s inverse."""
    fields = dataclasses.asdict(state)
    return {name: fields[field] for name, (field, _) in STATE_DECISIONS.items()}


def state_decisions(config: FerryConfig, target: Target, mesh: Any) -> tuple[Decision, ...]:
    """device / host for AdamW's moments and for the float32 master weights: on host they free
    their HBM (the master weights less the compute-dtype copy that stays) and the update streams
    them in and out once per step, each way at the host link's bandwidth, after the backward pass
    (nothing hides it). A stack's update is a scan whose outputs are new stacks: pinned host
    holds its part twice while it runs."""
    layout = run_state_layout(config, mesh, for_target(config.model, target))
    compute_bytes = jnp.dtype(config.train.compute_dtype).itemsize
    master_bytes = max(x.dtype.itemsize for x in jax.tree.leaves(float_params(layout.model)))
    decisions = []
    for name, (_, tensor) in STATE_DECISIONS.items():
        placement = state_of({key: HOST if key == name else DEVICE for key in STATE_DECISIONS})
        copies = [c for c in state_copies(layout.model, placement, layout.sharding.model) if c.tensor == tensor]
        moved = float(sum(c.bytes_per_layer * c.num_layers for c in copies))
        stacked = float(sum(c.bytes_per_layer * c.num_layers for c in copies if c.group != "other"))
        kept = moved * compute_bytes / master_bytes if tensor == MASTER_WEIGHTS else 0.0  # the compute copy
        host = Option(HOST, moved - kept, moved + stacked, seconds=moved / target.host_link_bandwidth)
        decisions.append(Decision(name, (Option(DEVICE), host), tensor=False))
    return tuple(decisions)


def peel_choice(config: FerryConfig) -> int | None:
    """The peel auto may choose besides none: `offload.auto.peel`, cut to the deepest stack's
    layers after its first (`check_peel`'s rule), where the run leaves its own peel at 0, ferry's
    engine pipelines scanned stacks, and the plan compiles the whole model (`plan.extrapolate`'s
    shallow compiles would peel fewer of its layers)."""
    offload, model = config.offload, config.model
    peel = min(offload.auto.peel, max(model.stack_depths().values(), default=0) - 1)
    pipelined = offload.pipelined and offload.engine == "ferry" and model.scan_layers
    if offload.peel or peel < 1 or not pipelined or config.plan.extrapolate:
        return None
    return peel


def departures(values: Mapping[str, str]) -> dict[str, str]:
    """A candidate's values other than keeping everything on device in the loop: what it moves,
    recomputes or peels."""
    return {name: value for name, value in values.items() if value != "device" and (name, value) != (PEEL, "0")}


def hbm_headroom(plan: MemoryPlan) -> float:
    """The share of HBM auto leaves free on the plan's target (`Target.hbm_headroom`)."""
    return hbm_headroom_of(plan.target)


def hbm_limit(plan: MemoryPlan) -> float:
    """The HBM a candidate may take: the device's less its target's headroom."""
    return (1 - hbm_headroom(plan)) * plan.capacity_bytes


def host_limit(plan: MemoryPlan) -> float | None:
    """The pinned host a candidate may take: the pool less `HEADROOM` (None: no pool is sized)."""
    return None if plan.host_capacity_bytes is None else (1 - HEADROOM) * plan.host_capacity_bytes


def fits_with_headroom(plan: MemoryPlan) -> bool:
    """HBM keeps the target's `hbm_headroom` free and the pinned host pool (where its size is
    known) `HEADROOM`."""
    host = host_limit(plan)
    host_fits = host is None or plan.host_bytes <= host
    return plan.compile_oom is None and plan.device_bytes <= hbm_limit(plan) and host_fits


@dataclasses.dataclass(frozen=True)
class Tried:
    """A candidate auto compiled: what it predicted and what the compiled program says."""

    values: dict[str, str]
    predicted: Prediction
    plan: MemoryPlan

    @property
    def fits(self) -> bool:
        return fits_with_headroom(self.plan)

    @property
    def compiled(self) -> Prediction:
        """What the compiled program says, in a prediction's terms."""
        return Prediction(
            self.predicted.values, float(self.plan.device_bytes), float(self.plan.host_bytes), self.plan.estimate
        )


def fastest(fitting: Sequence[Tried]) -> Tried | None:
    """The fastest compiled candidate by `banded_rank` around the least middle estimate of them."""
    least = min((t.plan.estimate.middle_seconds for t in fitting), default=None)
    return min(fitting, key=lambda t: banded_rank(t.plan.estimate, least), default=None)


def policy_of(choices: list[Choice]) -> Policy:
    return Policy.from_dict({c.name: c.placement for c in choices})


def auto_plan(
    config: FerryConfig,
    target: Target,
    mesh: Any,
    compile_policy: Callable[[Policy, str], MemoryPlan],
    extra: tuple[Decision, ...] = (),
    compile_choice: Callable[[Policy, dict[str, str]], MemoryPlan] | None = None,
    known: Sequence[tuple[Policy, MemoryPlan]] = (),
    measuring: bool = False,
) -> tuple[MemoryPlan, list[Choice], list[Tried]]:
    """The fastest-estimated candidate whose compiled step fits both memories with their headroom
    (see the module), its choices, and every candidate compiled on the way. `extra` decisions
    (not tensors) reach the compile through `compile_choice(policy, {decision: value})`; without
    them `compile_policy(policy, "auto")` compiles. `known`: presets this plan already compiled
    (with the run's state placement); they are candidates too, so auto is never slower than the
    fastest of them that fits, and their programs calibrate its predictions. `measuring`: the
    candidates will be timed on the chip (`ferry.plan.auto_measure`), so the peeled twin is
    compiled even where the loop fits (see the module). Where nothing fits: the candidate closest
    to fitting."""
    costs, forward = tensor_costs(config, target, mesh)
    micro_steps = config.micro_steps
    decisions = tensor_decisions(costs, micro_steps, offers_copies(target)) + list(extra)
    compile_values = compile_choice or (lambda policy, values: compile_policy(policy, "auto"))
    all_device = tuple(d.options[0].value for d in decisions)

    def compile_candidate(values: tuple[str, ...], peel: int | None = None) -> MemoryPlan:
        placements = {d.name: v for d, v in zip(decisions, values, strict=True) if d.tensor}
        offload = config.offload  # the run's pipelining and engine, and its peel but for the peeled twin
        peel = offload.peel if peel is None else peel
        policy = Policy.from_dict(placements, pipelined=offload.pipelined, peel=peel, engine=offload.engine)
        return compile_values(policy, {d.name: v for d, v in zip(decisions, values, strict=True) if not d.tensor})

    first = _all_device_plan(decisions, config, known) or compile_candidate(all_device)
    baseline = _baseline(first, config, target, forward, micro_steps)
    tried = _tried_known(baseline, decisions, first, known, config, target)
    peel = peel_choice(config) if measuring or not fits_with_headroom(first) else None
    twins = [] if peel is None else [_peeled_twin(tried[0], peel, compile_candidate)]
    _search(baseline, decisions, target, first, tried, compile_candidate, twins)
    tried[1:1] = twins  # numbered after the all-on-device loop it is the twin of
    fitting = [t for t in tried if t.fits]
    pick = fastest(fitting)
    if pick is None:
        pick = min(tried, key=lambda t: t.plan.device_bytes / t.plan.capacity_bytes)
    plan = pick.plan if pick.plan.policy == "auto" else dataclasses.replace(pick.plan, policy="auto")
    return plan, _choices(pick, costs, decisions, fitting), tried


def _all_device_plan(
    decisions: list[Decision], config: FerryConfig, known: Sequence[tuple[Policy, MemoryPlan]]
) -> MemoryPlan | None:
    """A preset with every tensor on device (`minimal`) is the all-on-device candidate's program:
    not compiled twice (save_all, which keeps the untagged values too, is not)."""
    all_device = tuple(d.options[0].value for d in decisions)
    same = (
        plan for policy, plan in known if not policy.keep_all and known_values(decisions, policy, config) == all_device
    )
    return next(same, None)


def _baseline(
    first: MemoryPlan, config: FerryConfig, target: Target, forward: dict[str, float], micro_steps: int
) -> Baseline:
    """The all-on-device program as the baseline predictions start from."""
    estimate = first.estimate
    model = abstract_model(for_target(config.model, target))
    return Baseline(
        float(first.device_bytes),
        float(first.host_bytes),
        estimate.matmul_seconds,
        estimate.collective_seconds,
        {group: flops / target.matmul_rate for group, flops in forward.items()},
        {kind.name: kind.num_layers * micro_steps for kind in model.layer_kinds()},
    )


def _peeled_twin(loop: Tried, peel: int, compile_candidate: Callable[..., MemoryPlan]) -> Tried:
    """The all-on-device candidate compiled with `peel` end layers of each stack out of the loop;
    its prediction is its compiled program (no search predicted it)."""
    plan = compile_candidate(loop.predicted.values, peel)
    compiled = Prediction(loop.predicted.values, float(plan.device_bytes), float(plan.host_bytes), plan.estimate)
    return Tried(loop.values | {PEEL: str(peel)}, compiled, plan)


def is_peeled_twin(candidate: Tried, loop: Tried) -> bool:
    """Whether `candidate` is `loop` compiled with end layers of each stack out of its loop
    (`_peeled_twin`)."""
    values = dict(candidate.values)
    peel = values.pop(PEEL, None)
    return peel is not None and PEEL not in loop.values and values == dict(loop.values)


def _tried_known(
    baseline: Baseline,
    decisions: list[Decision],
    first: MemoryPlan,
    known: Sequence[tuple[Policy, MemoryPlan]],
    config: FerryConfig,
    target: Target,
) -> list[Tried]:
    """The candidates compiled already: the all-on-device one, then the known presets that are
    candidates (each once)."""
    all_device = tuple(d.options[0].value for d in decisions)
    names = tuple(d.name for d in decisions)
    tried = [Tried(dict(zip(names, all_device, strict=True)), predict(baseline, decisions, all_device, target), first)]
    for policy, plan in known:
        values = known_values(decisions, policy, config)
        if values is not None and values not in {tuple(t.values.values()) for t in tried}:
            predicted = predict(baseline, decisions, values, target)
            tried.append(Tried(dict(zip(names, values, strict=True)), predicted, plan))
    return tried


def _search(
    baseline: Baseline,
    decisions: list[Decision],
    target: Target,
    first: MemoryPlan,
    tried: list[Tried],
    compile_candidate: Callable[[tuple[str, ...]], MemoryPlan],
    others: Sequence[Tried] = (),
) -> None:
    """Compile the fastest candidate predicted to fit, each predicted from the compiled one
    nearest it, until none is predicted faster than the fastest that fits (of `tried` and
    `others`, compiled candidates outside the decisions: the peeled twin) or `MAX_CHECKS` are
    spent; each compiled candidate is added to `tried`."""
    names = tuple(d.name for d in decisions)
    device_limit, pool_limit = hbm_limit(first), host_limit(first)
    for _ in range(MAX_CHECKS):
        best = fastest([t for t in (*tried, *others) if t.fits])
        fastest_seconds = None if best is None else best.plan.estimate.middle_seconds
        exclude = frozenset(t.predicted.values for t in tried)
        anchors = [
            (
                t.predicted.values,
                anchored(baseline, predict(baseline, decisions, t.predicted.values, target), t.compiled),
            )
            for t in tried
        ]
        candidate = fastest_fitting(
            baseline, decisions, target, device_limit, pool_limit, exclude, anchors, fastest_seconds
        )
        if candidate is None and best is None:  # nothing is predicted to fit: compile the least HBM, the closest
            least = tuple(max(d.options, key=lambda o: (o.freed_bytes, -o.host_bytes)).value for d in decisions)
            candidate = None if least in exclude else predict(baseline, decisions, least, target)
        if candidate is None or (best is not None and not faster(candidate.estimate, best.plan.estimate)):
            break
        plan = compile_candidate(candidate.values)
        tried.append(Tried(dict(zip(names, candidate.values, strict=True)), candidate, plan))


def known_values(decisions: list[Decision], policy: Policy, config: FerryConfig) -> tuple[str, ...] | None:
    """A compiled preset's value for each decision: its tensors' placements and the run's state
    placement; None where one is no option of its decision (a preset rematerialising the layer
    input, say)."""
    state = state_values(config.state_placement)
    values = tuple(policy.placement(d.name) if d.tensor else state.get(d.name, d.options[0].value) for d in decisions)
    valid = all(value in {o.value for o in d.options} for d, value in zip(decisions, values, strict=True))
    return values if valid else None


def choices_of(
    config: FerryConfig, target: Target, mesh: Any, pick: Tried, extra: tuple[Decision, ...], why: str
) -> list[Choice]:
    """The choices of a compiled candidate other than the search's own pick (the one measuring
    chose: `ferry.plan.auto_measure`), each decision's saying `why`."""
    costs, _ = tensor_costs(config, target, mesh)
    decisions = tensor_decisions(costs, config.micro_steps, offers_copies(target)) + list(extra)
    return _choices(pick, costs, decisions, [], why)


def _choices(
    pick: Tried, costs: dict[str, TensorCost], decisions: list[Decision], fitting: list[Tried], why: str = ""
) -> list[Choice]:
    why = why or (
        f"the fastest estimate ({pick.plan.estimate.middle_seconds * 1e3:.2f} ms) of {len(fitting)} compiled "
        "candidates that fit with headroom"
        if pick in fitting
        else "nothing compiled fits with headroom: the closest"
    )
    choices = []
    for decision in decisions:
        value = pick.values[decision.name]
        cost = costs.get(decision.name)
        # a tensor's bytes per micro step; another decision's, the bytes its other options move
        size = cost.bytes if cost else int(max(o.host_bytes for o in decision.options))
        recompute = cost.recompute_flops if cost and value == "remat" else 0.0
        choices.append(Choice(decision.name, value, size, recompute, why))
    if PEEL in pick.values:  # the peeled twin
        choices.append(Choice(PEEL, pick.values[PEEL], 0, 0.0, why))
    decided = {d.name for d in decisions}
    unread = "never read by the backward pass with the other tags on device: it frees nothing, so it is left to remat"
    choices += [Choice(name, "remat", 0, 0.0, unread) for name in costs if name not in decided]
    return choices
