"""Whether the compiled program hides its host copies: each copy XLA scheduled, the time it needs
on the target's host link, and the time the matrix work scheduled between its start and its done
needs at the target's peak."""

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ferry.xla.hlo_flops import computation_flops
from ferry.xla.hlo_host_copies import HostCopy, host_copies, overlapped_flops
from ferry.xla.targets import Target

DMA, KERNEL = "DMA", "kernel"  # what moves a host copy's bytes (`engine`)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One host copy of the compiled program, timed on the target."""

    tensor: str  # the offloaded residual(s) of exactly this size per device, "?" if none is
    direction: str  # "to host" or "to device"
    computation: str  # the HLO computation it runs in (a layer loop's body runs once per layer)
    shape: str
    bytes: int  # per execution
    executions: int  # per step
    hiding_flops: float  # per execution: matmul FLOPs scheduled between its start and its done
    transfer_seconds: float  # per execution, at the host link bandwidth
    compute_seconds: float  # per execution, the hiding FLOPs at the bf16 peak
    # "DMA" (a copy engine) or, on GPU, "kernel": a host slice without XLA's memcpy descriptor
    # runs as a kernel that reads or writes pinned host memory through the SMs
    engine: str = DMA

    @property
    def hidden(self) -> bool:
        return self.compute_seconds >= self.transfer_seconds


@dataclasses.dataclass(frozen=True)
class TransferSummary:
    """One step's copies together. Copies in flight at once share the host link, so within each
    computation the link time of all its copies is set against the compute that overlaps any of
    them; what that compute cannot cover is exposed.

    `floor_seconds` is the least any order of the same computations could leave exposed: a copy
    cannot outlive the computation that issues it (a loop body: its iteration), so where a
    computation's copies outlast all its matrix work, the difference is exposed however it is
    scheduled."""

    bytes_to_host: int
    bytes_to_device: int
    link_seconds: float
    overlapped_compute_seconds: float
    exposed_seconds: float
    floor_seconds: float = 0.0
    kernel_copies: int = 0  # of the step's copies, those that run as kernels (`Transfer.engine`)
    kernel_bytes: int = 0

    def goal_seconds(self, matmul_seconds: float) -> float:
        """What a copy schedule should leave exposed at most: the link time the step's matmuls
        cannot cover, plus 5% of them (issue 14's goal; it assumes a copy may overlap any compute
        of the step, which `floor_seconds` may not allow)."""
        return max(0.0, self.link_seconds - matmul_seconds) + 0.05 * matmul_seconds


def time_transfers(
    hlo_text: str, target: Target, residual_bytes: Mapping[str, int]
) -> tuple[tuple[Transfer, ...], TransferSummary]:
    """Read the host copies out of a compiled program and time them on `target`.
    `residual_bytes` (offloaded residual -> bytes per device per layer) names each copy by size."""
    copies = host_copies(hlo_text)
    names = defaultdict(list)
    for name, size in residual_bytes.items():
        names[size].append(name)
    transfers = tuple(_timed(copy, target, _name(names.get(copy.bytes, ["?"]))) for copy in copies)
    overlapped = overlapped_flops(hlo_text, copies)
    work = computation_flops(hlo_text, {copy.computation for copy in copies})
    link: dict[str, float] = defaultdict(float)
    executions: dict[str, int] = {}
    for transfer in transfers:
        link[transfer.computation] += transfer.transfer_seconds
        executions[transfer.computation] = transfer.executions
    compute = {name: overlapped[name] / target.matmul_rate for name in link}
    all_compute = {name: work[name] / target.matmul_rate for name in link}
    return transfers, TransferSummary(
        bytes_to_host=sum(t.bytes * t.executions for t in transfers if t.direction == "to host"),
        bytes_to_device=sum(t.bytes * t.executions for t in transfers if t.direction == "to device"),
        link_seconds=sum((link[name] * executions[name] for name in link), 0.0),
        overlapped_compute_seconds=sum((compute[name] * executions[name] for name in link), 0.0),
        exposed_seconds=sum((max(0.0, link[name] - compute[name]) * executions[name] for name in link), 0.0),
        floor_seconds=sum((max(0.0, link[name] - all_compute[name]) * executions[name] for name in link), 0.0),
        kernel_copies=sum(t.executions for t in transfers if t.engine == KERNEL),
        kernel_bytes=sum(t.bytes * t.executions for t in transfers if t.engine == KERNEL),
    )


def _name(candidates: list[str]) -> str:
    """The tensors a copy of one size may be: both of two, or the first and how many more."""
    return "/".join(candidates) if len(candidates) <= 2 else f"{candidates[0]} (+{len(candidates) - 1} of its size)"


def engine(copy: HostCopy, target: Target) -> str:
    """What moves a copy's bytes. XLA:GPU runs a host slice as a memcpy only where it precomputed
    the slice's addresses (`dynamic_slice_config`, given to slices in loops whose index follows
    the loop counter); any other slice of a host buffer (XLA's pipelining peels a loop's first or
    last iteration out of it) is a loop kernel that reads or writes pinned host memory through the
    SMs. A TPU addresses every host slice by its index, with DMAs."""
    return KERNEL if target.platform == "gpu" and copy.slice_descriptor is False else DMA


def _timed(copy: HostCopy, target: Target, tensor: str) -> Transfer:
    return Transfer(
        tensor=tensor,
        direction=copy.direction,
        computation=copy.computation,
        shape=copy.shape,
        bytes=copy.bytes,
        executions=copy.executions,
        hiding_flops=copy.hiding_flops,
        transfer_seconds=copy.bytes / target.host_link_bandwidth,
        compute_seconds=copy.hiding_flops / target.matmul_rate,
        engine=engine(copy, target),
    )


def transfers_json(transfers: tuple[Transfer, ...], summary: TransferSummary) -> dict[str, Any]:
    return {
        "copies": [dataclasses.asdict(t) | {"hidden": t.hidden} for t in transfers],
        "per_step": dataclasses.asdict(summary),
    }
