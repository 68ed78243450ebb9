"""`offload=auto` that measures: on a machine with the accelerator, the deviceless search's
fastest-estimated candidates that fit (`offload.auto.candidates` of them, and the all-on-device
program's peeled twin beside its loop: `ranked_candidates`) are each run on the real train step
(`ferry.plan.measure`), and the fastest measured step that fits the device is chosen. The
estimate does not time the chip's own scheduler: on a TPU v5e it held the copies of
`minimal_offloaded` hidden while the chip ran that preset well below full_remat; nor does it tell
a loop from its peeled twin, which ran faster on the v5e chip with both fitting
(docs/results/tpu-v5e.md, "The planner against the chip" and run 8).

A candidate is dropped, with the reason recorded, where it runs out of memory (at compile time
or while running) or its compiled program exceeds the device. Where none is left, the search's
own pick stands and the record says why. Every timed candidate, its predicted and measured step,
its memory and the reason for the pick go into `offload_auto.yaml` (`measured:`) and `plan.json`.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ferry.config.root import FerryConfig
from ferry.config.train import AutoMeasureConfig, OffloadConfig
from ferry.errors import ConfigError
from ferry.plan.auto import PEEL, STATE_DECISIONS, Tried, departures, is_peeled_twin, state_of
from ferry.plan.auto_search import banded_rank
from ferry.plan.measure import MeasureError, Measurement, StepTimer, measure_in_subprocess
from ferry.platform import PlatformConfig


@dataclasses.dataclass(frozen=True)
class MeasuredCandidate:
    """A compiled candidate of the search, as timed on this machine."""

    number: int  # its row in the candidate table (`report.candidate_table`), from 1
    source: str  # the preset it is, or `auto` for the search's own
    values: Mapping[str, str]  # each decision's value
    predicted_seconds: float  # its compiled program's middle estimate on the target
    predicted_bytes: int  # its compiled program's HBM per device on the target
    measurement: Measurement

    def to_json(self) -> dict[str, Any]:
        m = self.measurement
        return {
            "candidate": self.number,
            "from": self.source,
            "off_device": departures(self.values),
            "predicted_step_s": self.predicted_seconds,
            "measured_step_s": m.step_seconds,
            "step_times_s": list(m.step_times),
            "predicted_hbm_bytes": self.predicted_bytes,
            "device_bytes": m.device_bytes,
            "peak_bytes": m.peak_bytes,
            "capacity_bytes": m.capacity_bytes,
            "fits": m.fits,
            "reason": m.reason,
        }


@dataclasses.dataclass(frozen=True)
class MeasuredPick:
    """Every candidate timed, the one chosen (None: none fits; the search's pick stands) and why."""

    candidates: tuple[MeasuredCandidate, ...]
    pick: MeasuredCandidate | None
    reason: str

    def record(self) -> dict[str, Any]:
        """What `offload_auto.yaml` keeps under `measured:` and `plan.json` under `measured`."""
        kinds = {c.measurement.device_kind for c in self.candidates if c.measurement.device_kind}
        return {
            "device": ", ".join(sorted(kinds)) or "unknown",
            "pick": None if self.pick is None else self.pick.number,
            "reason": self.reason,
            "candidates": [c.to_json() for c in self.candidates],
        }


def ranked_candidates(tried: Sequence[Tried], count: int) -> list[tuple[int, Tried]]:
    """The `count` compiled candidates that fit with headroom, fastest estimate first (as the
    search ranks them: `banded_rank`), each with its number in the candidate table; then, beyond
    the count, the peeled twin (`ferry.plan.auto`) of one of them where it fits but ranks below
    them. The twin rides along with its loop: its estimate is about the loop's (the same FLOPs and
    copies), so it falls out of the count by a hair as often as not, and only the chip tells the
    two apart (`ferry.plan.auto`)."""
    fitting = [(number, t) for number, t in enumerate(tried, 1) if t.fits]
    least = min((t.plan.estimate.middle_seconds for _, t in fitting), default=None)
    ranked = sorted(fitting, key=lambda item: banded_rank(item[1].plan.estimate, least))
    best = ranked[:count]
    return best + [item for item in ranked[count:] if any(is_peeled_twin(item[1], loop) for _, loop in best)]


def measure_candidates(
    tried: Sequence[Tried],
    count: int,
    measure_one: Callable[[int, Tried], Measurement],
    say: Callable[[str], None] = lambda line: None,
    strict: bool = False,
    compile_ahead: Callable[[Sequence[tuple[int, Tried]]], list[str]] | None = None,
) -> MeasuredPick:
    """Time the search's `count` best candidates that fit, and the peeled twin of one of them
    (`ranked_candidates`), each by `measure_one(number, candidate)`, and pick the fastest median
    step of those that fit the device. Where this machine cannot run
    them at all (`MeasureError`: the mesh is not its devices, say), the search's pick stands and
    the record says why; `strict` (offload.auto.measure=true) refuses instead. `compile_ahead`
    first compiles them all at once (`ferry.run.compile_ahead.subprocess_compiler`), each saying how it went."""
    measured = []
    ranked = ranked_candidates(tried, count)
    if compile_ahead is not None and ranked:
        say(f"offload=auto: compiling {len(ranked)} candidates ahead on this machine's CPU, side by side")
        for (number, _), line in zip(ranked, compile_ahead(ranked), strict=True):
            say(f"offload=auto: candidate #{number}: {line}")
    for number, candidate in ranked:
        say(f"offload=auto: timing candidate #{number} ({describe(candidate)}) on this machine")
        try:
            measurement = measure_one(number, candidate)
        except MeasureError as error:
            if strict:
                raise MeasureError(f"offload.auto.measure=true, but this machine cannot run it: {error}") from error
            say(f"offload=auto: not measured: {error}")
            return MeasuredPick((), None, f"not measured (this machine cannot run the step: {error}); the search's")
        estimate = candidate.plan.estimate.middle_seconds
        entry = MeasuredCandidate(
            number, candidate.plan.policy, dict(candidate.values), estimate, candidate.plan.device_bytes, measurement
        )
        measured.append(entry)
        seconds = measurement.step_seconds
        shown = "dropped" if not measurement.fits or seconds is None else f"{seconds * 1e3:.2f} ms"
        say(f"offload=auto: candidate #{number}: {shown} ({measurement.reason})")
    timed = [c for c in measured if c.measurement.fits and c.measurement.step_seconds is not None]
    if not measured:
        return MeasuredPick((), None, "no compiled candidate fits the target with headroom: nothing to time")
    if not timed:
        return MeasuredPick(
            tuple(measured), None, f"none of the {len(measured)} candidates timed fits this device: the search's pick"
        )
    pick = min(timed, key=lambda c: c.measurement.step_seconds or 0.0)  # all timed
    ranks = [c.number for c in measured]
    reason = (
        f"the fastest measured step ({(pick.measurement.step_seconds or 0.0) * 1e3:.2f} ms, estimated "
        f"{pick.predicted_seconds * 1e3:.2f} ms) of {len(timed)} candidates timed that fit this device; "
        f"the estimate ranked it {ranks.index(pick.number) + 1} of {len(measured)}"
    )
    return MeasuredPick(tuple(measured), pick, reason)


def describe(candidate: Tried) -> str:
    moved = [f"{name}={value}" for name, value in departures(candidate.values).items()]
    return f"{candidate.plan.policy}: " + (", ".join(moved) or "all on device")


def candidate_offload(
    number: int, candidate: Tried, config: FerryConfig, load_preset: Callable[[str], OffloadConfig]
) -> dict[str, Any]:
    """The `offload` config node that trains `candidate`: the preset it is (with the state
    placement it was compiled with), or, for the search's own, its values as a preset compiled
    as `auto_plan` compiles them (no other key set)."""
    state = state_of(candidate.values, config.state_placement)
    source = candidate.plan.policy
    if source != "auto":
        preset = config.offload if source == config.offload.name else load_preset(source)
        node = dataclasses.asdict(preset)
    else:
        others = (*STATE_DECISIONS, PEEL)
        tensors = {name: value for name, value in candidate.values.items() if name not in others}
        offload = config.offload
        node = {"name": f"auto_candidate_{number}", "tensors": tensors, "pipelined": offload.pipelined}
        node |= {"peel": int(candidate.values.get(PEEL, offload.peel)), "engine": offload.engine}
    placed = {"optimizer": state.optimizer, "params": state.params, "stream_mib": state.stream_mib}
    placed["stream_prefetch"] = state.prefetch
    return node | placed | {"auto": {}, "measured": {}}


def resolve_measure(settings: AutoMeasureConfig, target_platform: str, present: str | None) -> tuple[bool, str]:
    """Whether to measure, and the line saying why. `present`: the accelerator on this machine
    (`accelerator_present`). Asked for explicitly on a machine without the target's accelerator,
    it is refused: a CPU's or another chip's step times say nothing of the target's."""
    if settings.measure is False:
        return False, "offload.auto.measure=false: the search's estimated pick, not timed"
    if present == target_platform:
        return True, f"offload.auto.measure: timing the best candidates on this machine's {present.upper()}"
    where = "no accelerator" if present is None else f"a {present.upper()}, not the target's {target_platform.upper()}"
    if settings.measure is None:
        return False, f"offload.auto.measure: off (this machine has {where}); the search's estimated pick"
    raise ConfigError(
        f"offload.auto.measure=true times the candidates on this machine's {target_platform.upper()}, and it has "
        f"{where}: run the plan on the machine you train on, or set offload.auto.measure=false"
    )


def subprocess_measurer(
    run_node: Callable[[int, Tried], dict[str, Any]], settings: AutoMeasureConfig
) -> Callable[[int, Tried], Measurement]:
    """`measure_one` for `measure_candidates`: each candidate in its own process
    (`measure_in_subprocess`) as the run `run_node` makes of it (`candidate_run`)."""
    timer = StepTimer(settings.warmup_steps, settings.steps)
    return lambda number, candidate: measure_in_subprocess(run_node(number, candidate), timer)


def candidate_run(
    config: FerryConfig,
    node: Mapping[str, Any],
    platform: PlatformConfig,
    load_preset: Callable[[str], OffloadConfig],
) -> Callable[[int, Tried], dict[str, Any]]:
    """The run config node that trains a candidate: the resolved config `node` with the
    candidate's offload and the target's `platform`."""
    mappings = {"xla_flags": platform.xla_flags, "env": platform.env, "host_offload_flags": platform.host_offload_flags}
    platform_node = dataclasses.asdict(platform) | {key: dict(value) for key, value in mappings.items()}

    def run_node(number: int, candidate: Tried) -> dict[str, Any]:
        offload = candidate_offload(number, candidate, config, load_preset)
        # a training run of the candidate: no target, no plan.* keys (a run refuses both)
        run = {**node, "offload": offload, "platform": platform_node, "mode": "train", "target": None}
        run.pop("plan", None)
        return run

    return run_node
