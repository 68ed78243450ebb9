"""Reading a `jax.profiler` trace of train steps on a TPU: how long each step took, which host
copies it ran, and how long the TensorCore waited for them.

A TPU trace (`jax.profiler.ProfileData`, public since jax 0.4) has, per chip, a plane
`/device:TPU:N` whose lines are `Steps` (one event per program run), `XLA Ops` (every executed
HLO instruction, named by its text; a `while` holds its body's ops) and `Async XLA Ops` (each
asynchronous start, lasting until its done). A host copy is an async start whose operand or result
lives in pinned host memory (`S(5)`): `dynamic-update-slice-start` into a host buffer or
`copy-start` to host (device->host), `dynamic-slice-start` of a host buffer or `copy-start` from
host (host->device). The core runs the copy's `...-done` instruction when it needs the bytes; the
time it spends there is the copy's exposed time (the transfer had not finished under the compute
scheduled between start and done). Everything else the core runs is compute.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ferry.xla.hlo_host_copies import HOST_MEMORY_SPACE
from ferry.xla.hlo_parse import shape_bytes, tuple_elements

_NAME = re.compile(r"^%(?P<name>[\w.\-]+)\s*=\s*")
_OP = re.compile(r"\s(?P<op>[a-z][a-z\-]*)\(")


@dataclasses.dataclass(frozen=True)
class TracedCopy:
    """One host copy in one step: when it started and finished (ns from the step's start), the
    bytes it moved, the core's wait in its done, and the compute the core ran while it flew."""

    name: str  # the start instruction's name
    direction: str  # "to host" or "to device"
    bytes: int
    start_ns: float
    end_ns: float
    wait_ns: float  # time in the done instruction: exposed
    compute_under_ns: float  # core busy with other work between start and done


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """One traced step."""

    step_ns: float
    compute_ns: float  # core busy, host-copy waits excluded
    copies: tuple[TracedCopy, ...]
    # compute before the first reload starts (the forward pass and the loss head, when the step
    # offloads): all the stores have, once reloads need the link back
    compute_before_reload_ns: float = 0.0

    def exposed_floor_ns(self, to_host_gbps: float, to_device_gbps: float) -> float:
        """The least exposed copy time the link allows: stores that take longer than the compute
        before the reloads start, and reloads longer than the compute after, at these rates (GB/s
        = bytes per ns)."""
        stores = self.bytes("to host") / to_host_gbps
        reloads = self.bytes("to device") / to_device_gbps
        before = self.compute_before_reload_ns
        return max(0.0, stores - before) + max(0.0, reloads - (self.compute_ns - before))

    @property
    def exposed_copy_ns(self) -> float:
        return sum(copy.wait_ns for copy in self.copies)

    def bytes(self, direction: str) -> int:
        return sum(copy.bytes for copy in self.copies if copy.direction == direction)

    def link_busy_ns(self, direction: str | None = None) -> float:
        """How long any host copy (of `direction`) was in flight."""
        return busy_ns([(c.start_ns, c.end_ns) for c in self.copies if direction in (None, c.direction)])


Interval = tuple[int | float, int | float]  # [start, end) in ns: a trace's integers or floats


def busy_ns(intervals: Iterable[Interval]) -> float:
    """The length of the union of [start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def uncovered_ns(intervals: list[Interval], cover: list[Interval]) -> float:
    """How much of the union of `intervals` no interval of `cover` overlaps."""
    return busy_ns(intervals + cover) - busy_ns(cover)


def newest_xplane(directory: Path) -> Path:
    """The newest `*.xplane.pb` a `jax.profiler.trace(directory)` wrote."""
    found = sorted(Path(directory).rglob("*.xplane.pb"), key=lambda path: path.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {directory}: was a profiler trace written there?")
    return found[-1]


def host_copy_direction(instruction: str) -> tuple[str, int] | None:
    """(direction, bytes moved) of an async start instruction between HBM and pinned host memory,
    from its text; None for any other instruction (a prefetch into VMEM, a collective...)."""
    match = _NAME.match(instruction)
    if match is None or HOST_MEMORY_SPACE not in instruction:
        return None
    shape_text = instruction[match.end() :]
    op = _OP.search(shape_text)
    if op is None or not op["op"].endswith("start"):
        return None
    shape = shape_text[: op.start()].strip()
    elements = tuple_elements(shape)
    if op["op"] == "copy-start":  # (destination, source, context)
        destination, source = elements[0], elements[1]
        if HOST_MEMORY_SPACE in destination and HOST_MEMORY_SPACE not in source:
            return "to host", shape_bytes(destination)
        if HOST_MEMORY_SPACE in source and HOST_MEMORY_SPACE not in destination:
            return "to device", shape_bytes(destination)
        return None
    # async-start of a computation: ((operands...), result, context)
    operands, result = tuple_elements(elements[0]), elements[1]
    if HOST_MEMORY_SPACE in result:  # written into a host buffer: the non-host array operands cross
        moved = [s for s in operands if HOST_MEMORY_SPACE not in s and shape_bytes(s) > 4]
        return ("to host", sum(shape_bytes(s) for s in moved)) if moved else None
    if any(HOST_MEMORY_SPACE in s for s in operands):  # read out of a host buffer: the result crosses
        return "to device", shape_bytes(result)
    return None


def _instruction_name(text: str) -> str:
    match = _NAME.match(text)
    return match["name"] if match else text.split(" ", 1)[0].lstrip("%")


def step_profiles(xplane: Path, device: int = 0) -> list[StepProfile]:
    """Each traced step of `device`'s TensorCore: its length, compute and host copies."""
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(str(xplane))
    plane = next((p for p in profile.planes if p.name == f"/device:TPU:{device}"), None)
    if plane is None:
        names = [p.name for p in profile.planes]
        raise ValueError(f"{xplane} holds no /device:TPU:{device} plane (planes: {names}); is it a TPU trace?")
    return profiles_of_lines({line.name: list(line.events) for line in plane.lines})


def profiles_of_lines(lines: Mapping[str, Sequence]) -> list[StepProfile]:
    """`step_profiles` of a TPU plane's lines, by name; each event has `name`, `start_ns`,
    `end_ns`, `duration_ns` and `stats` ((name, value) pairs)."""
    steps = lines.get("Steps") or lines.get("XLA Modules") or []
    ops = _leaves(lines.get("XLA Ops", []))
    asyncs = [(event, host_copy_direction(event.name)) for event in lines.get("Async XLA Ops", [])]
    copies_all = [(event, found) for event, found in asyncs if found is not None]
    return [_step_profile(step, ops, copies_all) for step in steps]


def _leaves(events: Sequence) -> list[tuple[float, float, str]]:
    """(start, end, instruction name) of every op that holds no other op (a `while` holds its
    body's ops, a fusion none): what the core itself spent its time on."""
    ordered = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
    holds: set[int] = set()
    open_: list[int] = []
    for index, event in enumerate(ordered):
        while open_ and ordered[open_[-1]].end_ns <= event.start_ns:
            open_.pop()
        if open_:
            holds.add(open_[-1])
        open_.append(index)
    return [
        (float(e.start_ns), float(e.end_ns), _instruction_name(e.name)) for i, e in enumerate(ordered) if i not in holds
    ]


def _step_profile(step, ops: list[tuple[float, float, str]], copies_all: list) -> StepProfile:
    begin, end = step.start_ns, step.end_ns
    in_step = [op for op in ops if begin <= op[0] < end]
    copies = []
    waits: set[int] = set()
    for event, (direction, size) in copies_all:
        if not begin <= event.start_ns < end:
            continue
        done = dict(event.stats).get("hlo_op", "")
        wait_index = next(
            (
                i
                for i, op in enumerate(in_step)
                if op[2] == done and event.start_ns <= op[0] <= event.end_ns + 1 and i not in waits
            ),
            None,
        )
        wait = 0.0
        if wait_index is not None:
            waits.add(wait_index)
            wait = in_step[wait_index][1] - in_step[wait_index][0]
        under = sum(
            max(0.0, min(op[1], event.end_ns) - max(op[0], event.start_ns))
            for i, op in enumerate(in_step)
            if i != wait_index and op[1] > event.start_ns and op[0] < event.end_ns
        )
        copies.append(
            TracedCopy(
                _instruction_name(event.name),
                direction,
                size,
                event.start_ns - begin,
                event.end_ns - begin,
                wait,
                under,
            )
        )
    # compute: the core's busy time, waits for host copies excluded (overlapping waits counted once)
    working = [(op[0], op[1]) for i, op in enumerate(in_step) if i not in waits]
    reloads = [begin + c.start_ns for c in copies if c.direction == "to device"]
    first_reload = min(reloads, default=end)
    before = busy_ns((start, min(stop, first_reload)) for start, stop in working if start < first_reload)
    return StepProfile(end - begin, busy_ns(working), tuple(copies), before)
