"""A step-time ESTIMATE from the compiled program, not a measurement: its matrix products at the
target's matmul rate (`Target.matmul_rate`), the host-copy time the compute scheduled under the
copies cannot hide (`ferry.plan.transfers`), and its collectives' bytes over the target's
interconnect. Collectives may overlap compute (best: the longer of the two) or not (worst: the
sum); the middle of the two is what presets and auto's candidates are ranked by. Where a chip was
measured (v5e), the rate carries its elementwise work, kernels and overheads as a fraction of the
peak; elsewhere it is the peak, so a real step is slower than the best."""

import dataclasses
from typing import Any

from ferry.xla.hlo_collectives import collectives
from ferry.xla.targets import Target

REFERENCE = "full_remat"  # the preset every estimate is compared with


@dataclasses.dataclass(frozen=True)
class CollectiveTraffic:
    """What the collectives of one step send per device, by kind, and the time that takes on
    the target's links (each collective at the bandwidth of the links its groups span)."""

    bytes: dict[str, float]  # algorithmic bytes sent per device per step, by collective kind
    seconds: float

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values(), 0.0)


def collective_traffic(hlo_text: str, target: Target) -> CollectiveTraffic:
    """Every collective of a compiled program, its algorithmic bytes (`Collective.algorithmic_bytes`)
    times how often it runs, over `target.collective_bandwidth` of its groups."""
    sent: dict[str, float] = {}
    seconds = 0.0
    for c in collectives(hlo_text):
        moved = c.algorithmic_bytes * c.executions
        if moved == 0:
            continue
        sent[c.op] = sent.get(c.op, 0) + moved
        bandwidth = target.collective_bandwidth(c.groups)
        if bandwidth <= 0:
            raise ValueError(f"target {target.name} has no bandwidth for a {c.op} over {len(c.groups[0])} devices")
        seconds += moved / bandwidth
    return CollectiveTraffic(dict(sent), seconds)


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """One step's time on one device, estimated from its compiled program (see the module)."""

    matmul_seconds: float  # the program's matmul FLOPs (recompute included) at the target's matmul rate
    exposed_copy_seconds: float  # host copies the compute scheduled under them does not hide
    collective_seconds: float
    model_flops: float  # per device per step, MaxText's convention (`ferry.train.step_flops`): no recompute

    @property
    def best_seconds(self) -> float:
        """Collectives hidden behind compute and copies."""
        return max(self.matmul_seconds + self.exposed_copy_seconds, self.collective_seconds)

    @property
    def worst_seconds(self) -> float:
        """Nothing overlaps the collectives."""
        return self.matmul_seconds + self.exposed_copy_seconds + self.collective_seconds

    @property
    def middle_seconds(self) -> float:
        """Halfway between the best and the worst: half of the shorter of compute and collectives
        overlapped. The compiled program does not say how much of them overlaps; by the best alone
        a slightly shorter collective outranks many more matmuls where collectives outlast compute
        (the Llama 3.1 405B reference plan with the train state on host:
        docs/results/reference-plans.md), by the worst alone the reverse."""
        return (self.best_seconds + self.worst_seconds) / 2

    @property
    def rank(self) -> tuple[float, float]:
        """Faster first: the middle estimate, then the worst."""
        return self.middle_seconds, self.worst_seconds

    @property
    def best_tflops(self) -> float:
        """Model TFLOPs/s/device the best estimate implies."""
        return self.model_flops / self.best_seconds / 1e12 if self.best_seconds > 0 else 0.0

    @property
    def worst_tflops(self) -> float:
        return self.model_flops / self.worst_seconds / 1e12 if self.worst_seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "kind": "estimate",
            "best_seconds": self.best_seconds,
            "middle_seconds": self.middle_seconds,
            "worst_seconds": self.worst_seconds,
            "best_tflops_per_device": self.best_tflops,
            "worst_tflops_per_device": self.worst_tflops,
        }


def ranked(estimates: dict[str, StepEstimate]) -> list[tuple[str, StepEstimate, float | None]]:
    """Presets fastest first by the middle estimate (the worst breaks ties), each with its middle
    estimate's speed-up over `full_remat` (its time / theirs; None without full_remat)."""
    reference = estimates.get(REFERENCE)
    order = sorted(estimates.items(), key=lambda item: item[1].rank)
    return [
        (name, estimate, None if reference is None else reference.middle_seconds / estimate.middle_seconds)
        for name, estimate in order
    ]
