"""The host memory a run holds, planned before anything is allocated, as HBM is: a state kept in
pinned host memory, the update's new copy of its layer stacks (a stack's update is a loop whose
outputs are new arrays, so pinned host holds that part twice while it runs), and what the process
holds already (the runtime, its libraries, the data read so far). The chip's measured host RSS
beside this plan: docs/results/tpu-v5e.md (run 13)."""

import dataclasses

import jax
import psutil

from ferry.config.train import DEVICE, StatePlacement
from ferry.offload.schedule import format_bytes
from ferry.train.memory import InsufficientMemoryError
from ferry.train.state_layout import StateLayout
from ferry.train.state_memory import state_copies


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """This process's host memory at the update's peak, in bytes."""

    pinned_state: int  # the master weights and moments kept in pinned host, for the local devices
    update_outputs: int  # the update's new stacks beside the old while it runs
    process: int  # the process before the state: runtime, libraries, data

    @property
    def total(self) -> int:
        return self.pinned_state + self.update_outputs + self.process

    def describe(self) -> str:
        return (
            f"host memory planned: {format_bytes(self.total)} ({format_bytes(self.pinned_state)} pinned state, "
            f"{format_bytes(self.update_outputs)} the update's new stacks, {format_bytes(self.process)} this process "
            "before them)"
        )


def host_plan(layout: StateLayout, placement: StatePlacement | None = None, process: int | None = None) -> HostPlan:
    """The plan of `layout`'s state (or of it placed as `placement`), beside `process` bytes (default:
    this process's resident memory now)."""
    placement = layout.placement if placement is None else placement
    copies = state_copies(layout.model, placement, layout.sharding.model)
    devices = len(jax.local_devices())
    pinned = sum(c.bytes_per_layer * c.num_layers for c in copies) * devices
    stacked = sum(c.bytes_per_layer * c.num_layers for c in copies if c.group != "other") * devices
    process = psutil.Process().memory_info().rss if process is None else process
    return HostPlan(pinned, stacked, process)


def check_host_fits(layout: StateLayout) -> HostPlan:
    """Refuse a run whose planned host memory exceeds what this process can reach (the memory
    available plus its own), naming the placements that would fit; the plan where it fits."""
    plan = host_plan(layout)
    have = psutil.virtual_memory().available + plan.process
    if plan.total <= have:
        return plan
    levers = []
    placement = layout.placement
    alternatives = {
        "train.adam_moments_dtype=bfloat16": dataclasses.replace(placement, moments_dtype="bfloat16"),
        "offload.params=device": dataclasses.replace(placement, params=DEVICE),
        "offload.optimizer=device": dataclasses.replace(placement, optimizer=DEVICE),
    }
    for lever, other in alternatives.items():
        if other != placement and host_plan(layout, other, plan.process).total <= have:
            levers.append(f"{lever} ({format_bytes(host_plan(layout, other, plan.process).total)})")
    fix = f"These fit: {', '.join(levers)}." if levers else "No placement of the state fits: shard it over more hosts."
    raise InsufficientMemoryError(
        f"the run's {plan.describe()} is more than the {format_bytes(have)} this machine has for it. {fix}"
    )
