"""The plan's types: what one device of a target holds for one train step (`MemoryPlan`), and
the error a compiled program that contradicts the plan raises. Kept apart from the planner so
that the verifier, auto and the report read them without importing the planner."""

import dataclasses
from typing import Any

from ferry.errors import FerryError
from ferry.plan.estimate import CollectiveTraffic, StepEstimate
from ferry.plan.transfers import Transfer, TransferSummary, transfers_json


class PlanError(FerryError, RuntimeError):
    """The compiled program contradicts the plan (e.g. an offload the compiler dropped)."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What one device of the target holds for one train step, from `memory_analysis()`."""

    target: str
    mesh: str
    policy: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    host_bytes: int  # pinned host: temporaries, arguments and outputs
    flops: float  # matrix products per device per step as they run, from the compiled HLO (`matmul_flops`)
    matmuls: int  # how many matrix products run per device per step (`matmul_count`)
    capacity_bytes: int
    host_capacity_bytes: int | None  # the pinned host pool a run sets up, where the platform sizes one
    compile_options: tuple[tuple[str, object], ...]
    transfers: tuple[Transfer, ...]
    transfer_summary: TransferSummary
    compile_seconds: float  # lowering and compiling on this machine
    verification: Any = None  # `ferry.plan.verify.Verification`: the compiled program checked against the plan
    collectives: CollectiveTraffic = CollectiveTraffic({}, 0.0)
    model_flops: float = 0.0  # per device per step, MaxText's convention (`ferry.train.step_flops`)
    matmul_rate: float = 0.0  # FLOP/s per device the estimate runs matmuls at (`Target.matmul_rate`)
    extrapolated: str | None = None  # how `ferry.plan.extrapolate` made it from shallow compiles; None: compiled whole
    pipeline_bytes: int = 0  # offloaded values a pipelined schedule keeps in HBM (`TransferSchedule.pipeline_bytes`)
    scheduler_costs: str = "xla"  # who timed the ops for XLA's scheduler: ferry's cost model or XLA's estimates
    # the program's static count of them, an upper bound: a MoE's tiles as if every slot of a device
    # routed to one device's experts (`ferry.xla.expected_work`); None: no work is marked, `flops`
    flops_bound: float | None = None
    xla_rematerialised: int = 0  # instructions XLA's own rematerialisation added (`hlo_flops.xla_rematerialised`)
    profile_cached: bool = False  # ferry's cost profile came from its cache: one compile, not two
    # XLA refused to compile the program over HBM (`ferry.xla.compile_oom`): what it said, in words. Then
    # `temp_bytes` is what it said the program needs, the arguments are the state's and the batch's
    # bytes, and `flops` the model FLOPs (no program to count them in); nothing else is known
    compile_oom: str | None = None

    @property
    def device_bytes(self) -> int:
        """Peak HBM the program needs: arguments + outputs - donated aliases + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        """HBM holds the step, and so does the pinned host pool where its size is known."""
        host_fits = self.host_capacity_bytes is None or self.host_bytes <= self.host_capacity_bytes
        return self.compile_oom is None and self.device_bytes <= self.capacity_bytes and host_fits

    @property
    def estimate(self) -> StepEstimate:
        """The step time this program implies on the target: an estimate (`ferry.plan.estimate`)."""
        exposed = self.transfer_summary.exposed_seconds
        return StepEstimate(self.flops / self.matmul_rate, exposed, self.collectives.seconds, self.model_flops)

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["transfers"], fields["transfer_summary"], fields["verification"], fields["collectives"]
        return fields | {
            "device_bytes": self.device_bytes,
            "fits": self.fits,
            "collectives": dataclasses.asdict(self.collectives),
            "estimate": self.estimate.to_json(),
            "transfers": transfers_json(self.transfers, self.transfer_summary),
            "verification": None if self.verification is None else self.verification.to_json(),
        }
