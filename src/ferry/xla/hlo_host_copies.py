"""The copies between HBM and pinned host memory in a scheduled program, read from its HLO text,
and the matrix work scheduled while they fly (the compute that can hide them)."""

import dataclasses
from collections.abc import Mapping

from ferry.xla.hlo_flops import parsed
from ferry.xla.hlo_parse import CALLEE, DEFINITION, array_dims, shape_bytes

HOST_MEMORY_SPACE = "S(5)"  # the layout annotation of a buffer in pinned host memory


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """One asynchronous copy between HBM and pinned host memory in the scheduled program, and the
    matrix work XLA scheduled between its start and its done: the compute that can hide it."""

    computation: str
    start: str
    direction: str  # "to host" or "to device"
    shape: str  # of the bytes that cross the link
    bytes: int  # per execution
    executions: int  # per call of the program (the loop trip counts around it)
    hiding_flops: float  # per execution
    window: tuple[int, int]  # positions of start and done in the computation's schedule
    # a slice of a host buffer (XLA's pipelined host offloading): whether XLA addressed it with a
    # precomputed memcpy descriptor (`dynamic_slice_config`); None for a `copy-start`
    slice_descriptor: bool | None = None


def host_copies(hlo_text: str) -> list[HostCopy]:
    """Every async start/done pair whose result or operands live in pinned host memory: an
    offload (a `dynamic-update-slice` into a host buffer, a `copy` to host) or a reload."""
    module = parsed(hlo_text)
    copies = []
    for name, lines in module.bodies.items():
        starts: dict[str, tuple[int, str, str]] = {}
        for position, line in enumerate(lines):
            definition = DEFINITION.match(line)
            if definition is None:
                continue
            if definition["op"].endswith("-start") and HOST_MEMORY_SPACE in definition["shape"]:
                starts[definition["name"]] = (position, definition["op"], definition["args"])
                continue
            started = starts.pop(definition["args"].strip().lstrip("%"), None)
            if not definition["op"].endswith("-done") or started is None:
                continue
            begin, _, args = started
            if HOST_MEMORY_SPACE in definition["shape"]:  # the result is in host memory: an offload
                direction = "to host"
                operands = [module.shapes.get(a.strip().lstrip("%"), "") for a in args.split(",")]
                moved = [s for s in operands if HOST_MEMORY_SPACE not in s and array_dims(s)]
                shape = ", ".join(s.split("{")[0] for s in moved)
                size = sum(shape_bytes(s) for s in moved)
            else:
                direction, shape, size = (
                    "to device",
                    definition["shape"].split("{")[0],
                    shape_bytes(definition["shape"]),
                )
            if size == 0:  # host-to-host work (a TPU host call on an offloaded buffer): nothing crosses
                continue
            hiding = module.lines_flops(lines[begin + 1 : position])
            copies.append(
                HostCopy(
                    name,
                    lines[begin].split("=")[0].strip().lstrip("%"),
                    direction,
                    shape,
                    size,
                    module.counts.get(name, 0),
                    hiding,
                    (begin, position),
                    _slice_descriptor(lines[begin], module.roots),
                )
            )
    return copies


def _slice_descriptor(start: str, roots: Mapping[str, str]) -> bool | None:
    """Whether the host slice an async start runs carries XLA:GPU's memcpy descriptor
    (`dynamic_slice_config`, on the slice or on a fusion around it); None where it runs no slice."""
    lines, line = [start], start
    while (callee := CALLEE.search(line)) and (line := roots.get(callee["name"], "")) and len(lines) < 4:
        lines.append(line)
    definition = DEFINITION.match(lines[-1])
    if definition is None or definition["op"] not in ("dynamic-slice", "dynamic-update-slice"):
        return None
    return any("dynamic_slice_config" in line for line in lines)


def overlapped_flops(hlo_text: str, copies: list[HostCopy]) -> dict[str, float]:
    """Per computation, the FLOPs scheduled while at least one host copy is in flight: the copies
    share one host link, so together they are hidden by this much compute, not by the sum of
    their windows."""
    module = parsed(hlo_text)
    covered: dict[str, set[int]] = {}
    for copy in copies:
        covered.setdefault(copy.computation, set()).update(range(copy.window[0] + 1, copy.window[1]))
    return {
        name: module.lines_flops([module.bodies[name][i] for i in positions]) for name, positions in covered.items()
    }
