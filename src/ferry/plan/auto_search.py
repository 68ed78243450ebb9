"""`offload=auto`'s predictions and its search (`ferry.plan.auto`): each candidate's HBM, host
bytes and step time predicted from a compiled baseline (or the compiled candidate nearest it),
and the branch and bound that finds the fastest candidate predicted to fit."""

import dataclasses
from collections.abc import Sequence

from ferry.plan.estimate import StepEstimate
from ferry.xla.targets import Target

# step estimates this close are a tie: the estimate cannot resolve them (at the DeepSeek-V3 reference
# plan collectives a fraction of a percent apart once picked the placement with the longer worst
# estimate: docs/results/reference-plans.md, "What offload=auto's rules rest on"); mirror images
# (`mlpwi_1` offloaded for `mlpwi_0`) predict within it, so one compiled stops the search
MIN_GAIN = 0.005


@dataclasses.dataclass(frozen=True)
class Option:
    """One value of a decision and what it changes against keeping everything on device, per
    device per step."""

    value: str
    freed_bytes: float = 0.0  # HBM
    host_bytes: float = 0.0  # pinned host taken
    recompute_flops: float = 0.0
    copy_bytes: tuple[tuple[str, int], ...] = ()  # per layer group: one layer's copies, each way
    seconds: float = 0.0  # any other time it adds (its own copies, already known exposed)


@dataclasses.dataclass(frozen=True)
class Decision:
    """A choice `auto` makes: a tagged tensor's placement, or another placement (the optimizer
    state's, say) given by its options; the first option is the all-on-device one."""

    name: str
    options: tuple[Option, ...]
    tensor: bool = True  # a tagged tensor: its value goes into the policy


@dataclasses.dataclass(frozen=True)
class Baseline:
    """The all-on-device step that predictions start from (compiled, or as a compiled candidate
    implies it: `anchored`), and the layers behind each group's copies."""

    hbm_bytes: float
    host_bytes: float
    matmul_seconds: float
    collective_seconds: float
    forward_seconds: dict[str, float]  # one layer of each group, per micro step
    layer_runs: dict[str, int]  # layers x micro steps of each group, per step


@dataclasses.dataclass(frozen=True)
class Prediction:
    values: tuple[str, ...]  # one per decision
    hbm_bytes: float
    host_bytes: float
    estimate: StepEstimate  # predicted, as a compiled program's is read

    @property
    def seconds(self) -> float:
        """The middle estimate, which candidates are ranked by."""
        return self.estimate.middle_seconds

    @property
    def worst(self) -> float:
        return self.estimate.worst_seconds

    @property
    def rank(self) -> tuple[float, float]:
        return self.estimate.rank


def predict(baseline: Baseline, decisions: list[Decision], values: tuple[str, ...], target: Target) -> Prediction:
    """The HBM, host bytes and step-time estimate of one candidate, from the baseline."""
    chosen = [next(o for o in d.options if o.value == v) for d, v in zip(decisions, values, strict=True)]
    return _prediction(baseline, values, *_totals(chosen), target)


def anchored(baseline: Baseline, predicted: Prediction, compiled: Prediction) -> Baseline:
    """The baseline a compiled candidate implies: predicting that candidate from it gives its
    compiled program (`compiled`: its HBM, host bytes and estimate; `predicted`: the same candidate
    predicted from `baseline`), and predicting another adds what their placements differ by. Where
    the all-on-device program is far over HBM, what a placement frees there is not what it frees
    in a program that fits, since XLA packs the buffers otherwise (at the DeepSeek-V3 reference
    plan the presets' predictions from it missed by gigabytes: docs/results/reference-plans.md);
    from a compiled candidate a few decisions away the prediction rests on a program that fits, or
    nearly."""
    return dataclasses.replace(
        baseline,
        hbm_bytes=baseline.hbm_bytes + compiled.hbm_bytes - predicted.hbm_bytes,
        host_bytes=baseline.host_bytes + compiled.host_bytes - predicted.host_bytes,
        matmul_seconds=baseline.matmul_seconds + compiled.estimate.matmul_seconds - predicted.estimate.matmul_seconds,
        collective_seconds=compiled.estimate.collective_seconds,
    )


def _totals(chosen: list[Option]) -> tuple[float, float, float, dict[str, int], float]:
    copies: dict[str, int] = {}
    for option in chosen:
        for group, size in option.copy_bytes:
            copies[group] = copies.get(group, 0) + size
    return (
        sum((o.freed_bytes for o in chosen), 0.0),
        sum((o.host_bytes for o in chosen), 0.0),
        sum((o.recompute_flops for o in chosen), 0.0),
        copies,
        sum((o.seconds for o in chosen), 0.0),
    )


def exposed_copy_seconds(baseline: Baseline, copies: dict[str, int], target: Target) -> float:
    """A layer's copies out against its forward compute, back against its backward (twice the
    forward), for every layer run of the step."""
    total = 0.0
    for group, size in copies.items():
        link, forward = size / target.host_link_bandwidth, baseline.forward_seconds[group]
        total += baseline.layer_runs[group] * (max(0.0, link - forward) + max(0.0, link - 2 * forward))
    return total


def _prediction(
    baseline: Baseline,
    values: tuple[str, ...],
    freed: float,
    host: float,
    recompute: float,
    copies: dict[str, int],
    seconds: float,
    target: Target,
) -> Prediction:
    compute = baseline.matmul_seconds + recompute / target.matmul_rate
    exposed = exposed_copy_seconds(baseline, copies, target) + seconds
    estimate = StepEstimate(compute, exposed, baseline.collective_seconds, 0.0)
    return Prediction(values, baseline.hbm_bytes - freed, baseline.host_bytes + host, estimate)


def fastest_fitting(
    baseline: Baseline,
    decisions: list[Decision],
    target: Target,
    hbm_limit: float,
    host_limit: float | None,
    exclude: frozenset[tuple[str, ...]] = frozenset(),
    anchors: Sequence[tuple[tuple[str, ...], Baseline]] = (),
    fastest_seconds: float | None = None,
) -> Prediction | None:
    """The candidate of the least predicted step time (`banded_rank` around `fastest_seconds`, the
    fastest compiled candidate's middle estimate) predicted within both
    limits (None if none is), not one of `exclude`: a depth-first branch and bound. Each candidate
    is predicted from the anchor (a compiled candidate's values and `anchored` baseline) the fewest
    decisions away, the one predicting more HBM where two are as near; without anchors, from
    `baseline`. Every option adds time and host bytes and frees HBM, so a partial choice is dropped
    once, from the most favourable anchor, it is no faster than the best found, its host bytes are
    over, or even freeing the most of every decision left leaves HBM over."""
    anchors = list(anchors) or [(tuple(d.options[0].value for d in decisions), baseline)]
    search = _BranchAndBound(decisions, target, hbm_limit, host_limit, exclude, anchors, fastest_seconds)
    search.visit(0, _bound(baseline, anchors))
    return search.best


def _bound(baseline: Baseline, anchors: Sequence[tuple[tuple[str, ...], Baseline]]) -> Baseline:
    """The most favourable of the anchors, field by field: what a partial choice is pruned from."""
    return dataclasses.replace(
        baseline,
        hbm_bytes=min(a.hbm_bytes for _, a in anchors),
        host_bytes=min(a.host_bytes for _, a in anchors),
        matmul_seconds=min(a.matmul_seconds for _, a in anchors),
        collective_seconds=min(a.collective_seconds for _, a in anchors),
    )


class _BranchAndBound:
    """`fastest_fitting`'s depth-first search: the decisions in the order of the most HBM they can
    free, the choice so far, and the best full candidate found."""

    def __init__(
        self,
        decisions: list[Decision],
        target: Target,
        hbm_limit: float,
        host_limit: float | None,
        exclude: frozenset[tuple[str, ...]],
        anchors: Sequence[tuple[tuple[str, ...], Baseline]],
        fastest_seconds: float | None,
    ):
        self.decisions, self.target, self.anchors = decisions, target, anchors
        self.hbm_limit, self.host_limit, self.exclude = hbm_limit, host_limit, exclude
        self.fastest_seconds = fastest_seconds
        self.order = sorted(range(len(decisions)), key=lambda i: -max(o.freed_bytes for o in decisions[i].options))
        self.most_left = [0.0] * (len(self.order) + 1)
        for depth in range(len(self.order) - 1, -1, -1):
            freeing = max(o.freed_bytes for o in decisions[self.order[depth]].options)
            self.most_left[depth] = self.most_left[depth + 1] + freeing
        self.best: Prediction | None = None
        self.chosen: list[Option] = []

    def rank(self, prediction: Prediction) -> tuple[float, float]:
        return banded_rank(prediction.estimate, self.fastest_seconds)

    def nearest(self, values: tuple[str, ...]) -> Baseline:
        """The anchor the fewest decisions away; of two as near, the one predicting more HBM."""

        def apart(anchor: tuple[tuple[str, ...], Baseline]) -> tuple[int, float]:
            return sum(a != v for a, v in zip(anchor[0], values, strict=True)), -anchor[1].hbm_bytes

        return min(self.anchors, key=apart)[1]

    def visit(self, depth: int, bound: Baseline) -> None:
        """Extend the choice at `depth`, dropping it once `bound` shows it cannot win or fit."""
        totals = _totals(self.chosen)
        partial = _prediction(bound, tuple(o.value for o in self.chosen), *totals, self.target)
        if self.best is not None and self.rank(partial) >= self.rank(self.best):
            return
        if self.host_limit is not None and partial.host_bytes > self.host_limit:
            return
        if partial.hbm_bytes - self.most_left[depth] > self.hbm_limit:
            return
        if depth == len(self.order):
            self.leaf(totals)
            return
        for option in self.decisions[self.order[depth]].options:
            self.chosen.append(option)
            self.visit(depth + 1, bound)
            self.chosen.pop()

    def leaf(self, totals: tuple[float, float, float, dict[str, int], float]) -> None:
        """A full candidate: kept where it is not excluded, fits and ranks before the best."""
        values = [""] * len(self.decisions)
        for i, option in zip(self.order, self.chosen, strict=True):
            values[i] = option.value
        if tuple(values) in self.exclude:
            return
        full = _prediction(self.nearest(tuple(values)), tuple(values), *totals, self.target)
        fits = full.hbm_bytes <= self.hbm_limit and (self.host_limit is None or full.host_bytes <= self.host_limit)
        if fits and (self.best is None or self.rank(full) < self.rank(self.best)):
            self.best = full


def banded_rank(estimate: StepEstimate, fastest_seconds: float | None) -> tuple[float, float]:
    """`StepEstimate.rank` (the middle estimate, then the worst) with every middle estimate within
    `MIN_GAIN` of `fastest_seconds` counted as equal to it, so the worst decides between them: the
    estimate cannot tell such steps apart (`MIN_GAIN`).
    Monotone in the middle estimate, so a branch and bound may prune by it."""
    middle = estimate.middle_seconds
    if fastest_seconds is not None and abs(middle - fastest_seconds) <= MIN_GAIN * fastest_seconds:
        middle = fastest_seconds
    return middle, estimate.worst_seconds


def faster(predicted: StepEstimate, fastest: StepEstimate) -> bool:
    """Whether a candidate is predicted faster than the fastest compiled one by more than
    `MIN_GAIN` of its step: in the middle estimate, or, where those tie within it, in the worst."""
    middle, worst = banded_rank(predicted, fastest.middle_seconds)  # the tie band has one definition
    if middle != fastest.middle_seconds:
        return middle < fastest.middle_seconds
    return worst < (1 - MIN_GAIN) * fastest.worst_seconds
