"""Matching a compiled program's host copies to the plan's offloaded tensors (the verifier's
copies check, `ferry.plan.verify`): by the copy scope where the metadata kept it, else by bytes
and by how often each copy runs."""

import dataclasses
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType

from ferry.offload.schedule import TransferSchedule
from ferry.train.state_memory import StateWrite
from ferry.xla.hlo_flops import parsed
from ferry.xla.hlo_host_copies import HostCopy, host_copies

DEAD = "dead: never read by the backward pass"
PARTLY = "fewer copies than the update writes"  # the train state's: not an error, its host bytes are the check
STATE_GROUP = "train state"
SCOPE = re.compile(r"ferry_offload/(?P<group>[^/]+)/(?P<tensor>[^/]+)/(?P<direction>to_host|to_device)")
_DIRECTIONS = {"to_host": "to host", "to_device": "to device"}


@dataclasses.dataclass(frozen=True)
class CopyCheck:
    """One offloaded tensor of one layer group, one direction: copies per step, listed and found."""

    group: str
    tensor: str
    direction: str  # "to host" or "to device"
    bytes: int  # per copy, per device
    expected: int  # copies per step: layers x micro steps
    found: int
    named_by: str  # "op_name" where the copy's metadata named it, "size" where its bytes did
    status: str  # "copied", DEAD or "missing"; the train state's write-backs: "copied" or PARTLY


@dataclasses.dataclass
class _Slot:
    group: str
    tensor: str
    direction: str
    bytes: int
    expected: int
    layers: int  # how often one copy of this slot runs per step where the group is one loop
    required: int  # at least this many: an unpeeled pipelined stack's first store and last reload
    # move a placeholder (`ferry.offload.scan`), which a compiler that unrolls the loop drops as dead
    found: int = 0
    named: bool = False
    state: bool = False  # a write-back of the train state's update (`state_writes`), not a residual


def _scope(op_name: str, groups: list[str]) -> tuple[str, str, str] | None:
    """(group, tensor, direction) from a copy's op_name, None where it carries no copy scope. A
    one-group model's scope may name its stack differently from the schedule's group."""
    match = SCOPE.search(op_name)
    if match is None:
        return None
    group = match["group"] if match["group"] in groups or len(groups) != 1 else groups[0]
    return group, match["tensor"], _DIRECTIONS[match["direction"]]


def check_copies(
    hlo_text: str,
    schedule: TransferSchedule,
    micro_steps: int,
    read_by_backward: Callable[[str, str], bool],
    state: Mapping[str, StateWrite] = MappingProxyType({}),
) -> tuple[tuple[CopyCheck, ...], tuple[str, ...], dict[tuple[str, str], tuple[str, str]]]:
    """Match the program's host copies to the schedule's offloaded tensors: by their copy scope
    where the metadata kept it, else by bytes (and by how often they run, to tell a group of
    `n` scanned layers from one of a single layer). The train state's write-backs (`state`:
    `ferry.train.state_memory.state_writes`) are matched too, so that one of a residual's size is
    not taken for it; they are counted, never refused (the state's placement is in the host
    bytes). Returns the checks, the copies matching no tensor, and which (group, tensor) each
    copy instruction moves (a copy named by its size: every tensor of the group with that size,
    "a/b")."""
    slots = _slots(schedule, micro_steps, state)
    read = _SlotReads(read_by_backward)
    moved: dict[tuple[str, str], tuple[str, str]] = {}
    groups = [g.name for g in schedule.groups]
    unnamed = _match_by_scope(host_copies(hlo_text), parsed(hlo_text).op_names, groups, slots, moved)
    unmatched = _match_by_size(unnamed, slots, read, moved)
    return tuple(_copy_check(s, read) for s in slots), tuple(unmatched), moved


def _slots(schedule: TransferSchedule, micro_steps: int, state: Mapping[str, StateWrite]) -> list[_Slot]:
    """One slot per offloaded tensor and direction, and one per write-back of the train state."""
    return [
        _Slot(
            g.name,
            r.name,
            direction,
            r.bytes_per_device,
            (g.num_layers - bool(g.peeled)) * micro_steps,  # a peeled stack's last layer stays in HBM
            (g.num_layers - (1 + g.peeled if g.peeled else 0)) * micro_steps,  # a peeled stack's loop runs the rest
            (g.num_layers - g.pipelined) * micro_steps,
        )
        for g in schedule.groups
        for r in g.residuals
        if r.placement == "offload"
        for direction in ("to host", "to device")
    ] + [
        _Slot(STATE_GROUP, name, "to host", write.bytes, write.copies, write.layers, write.copies, state=True)
        for name, write in state.items()
    ]


class _SlotReads:
    """Whether the backward pass reads a slot's tensor (the state's write-backs: always), asked of
    `read_by_backward` once per tensor and only where it matters (it traces the layer)."""

    def __init__(self, read_by_backward: Callable[[str, str], bool]):
        self.read_by_backward = read_by_backward
        self.reads: dict[tuple[str, str], bool] = {}

    def __call__(self, slot: _Slot) -> bool:
        if slot.state:
            return True
        key = (slot.group, slot.tensor)
        if key not in self.reads:
            self.reads[key] = self.read_by_backward(*key)
        return self.reads[key]


def _match_by_scope(
    copies: list[HostCopy],
    names: Mapping[str, str],
    groups: list[str],
    slots: list[_Slot],
    moved: dict[tuple[str, str], tuple[str, str]],
) -> list[HostCopy]:
    """Count each copy whose op_name carries a copy scope into its slot (recorded in `moved`);
    the copies left without one."""
    unnamed = []
    for copy in copies:
        scope = _scope(names.get(copy.start, ""), groups)
        slot = next(
            (s for s in slots if scope and (s.group, s.tensor, s.direction) == scope and s.found < s.expected), None
        )
        if slot is None:
            unnamed.append(copy)
            continue
        slot.found += copy.executions
        slot.named = True
        moved[(copy.computation, copy.start)] = (slot.group, slot.tensor)
    return unnamed


def _match_by_size(
    unnamed: list[HostCopy],
    slots: list[_Slot],
    read: _SlotReads,
    moved: dict[tuple[str, str], tuple[str, str]],
) -> list[str]:
    """Count each copy without a scope into a slot of its size and direction (recorded in
    `moved`); the copies that fit none, described."""
    uneven = {  # sizes of which the program has more or fewer copies than listed
        (s.direction, s.bytes)
        for s in slots
        if sum(t.expected - t.found for t in slots if (t.direction, t.bytes) == (s.direction, s.bytes))
        != sum(c.executions for c in unnamed if (c.direction, c.bytes) == (s.direction, s.bytes))
    }
    unmatched = []
    for copy in unnamed:
        candidates = [
            s
            for s in slots
            if (s.direction, s.bytes) == (copy.direction, copy.bytes) and s.expected - s.found >= copy.executions
        ]

        def preference(s: _Slot, copy: HostCopy = copy) -> tuple[bool, bool, bool]:
            # where copies of this size are missing (or extra), the tensors the backward pass reads
            # come first, and those that still lack copies
            dead = (s.direction, s.bytes) in uneven and not read(s)
            mismatched = s.expected - s.found != copy.executions and s.layers != copy.executions
            return dead, s.found >= s.required, mismatched

        if not candidates:
            unmatched.append(f"{copy.direction} {copy.shape} x{copy.executions}")
            continue
        slot = min(candidates, key=preference)
        slot.found += copy.executions
        alike = [s.tensor for s in slots if (s.group, s.direction, s.bytes) == (slot.group, slot.direction, slot.bytes)]
        moved[(copy.computation, copy.start)] = (slot.group, "/".join(dict.fromkeys(alike)))
    return unmatched


def _copy_check(s: _Slot, read: _SlotReads) -> CopyCheck:
    """A slot's verdict: copied, partly (the state's), dead (the backward pass never reads it) or missing."""
    if s.state:
        status = "copied" if s.found >= s.expected else PARTLY
    elif s.found >= s.required:
        status = "copied"
    elif not read(s):  # XLA may drop all or some of them (libtpu keeps one of two unrolled layers')
        status = DEAD
    else:
        status = "missing"
    return CopyCheck(
        s.group, s.tensor, s.direction, s.bytes, s.expected, s.found, "op_name" if s.named else "size", status
    )
