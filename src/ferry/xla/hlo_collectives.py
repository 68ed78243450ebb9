"""The collectives of a compiled SPMD program read from its HLO text: each one's bytes per device,
the device groups it spans and how often it runs."""

import dataclasses
import re
from collections import Counter

import numpy as np

from ferry.xla.hlo_flops import parsed
from ferry.xla.hlo_parse import DEFINITION, shape_bytes, tuple_elements

COLLECTIVES: tuple[str, ...] = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_INSTRUCTION = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[a-z\-]+)\(")
_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(?P<n>\d+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{(?P<groups>(?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<over>[^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>(?:\{[0-9,]*\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled SPMD program: its result bytes per device, the device groups
    it runs over (partition ids; for a `collective-permute` its source-target pairs), and how
    often it runs per call of the program."""

    op: str  # all-gather, all-reduce, reduce-scatter, all-to-all, ragged-all-to-all, collective-permute
    name: str
    bytes: int  # the result on one device, per execution
    groups: tuple[tuple[int, ...], ...]
    executions: int

    @property
    def group_size(self) -> int:
        return max((len(g) for g in self.groups), default=1) if self.op != "collective-permute" else 2

    @property
    def algorithmic_bytes(self) -> float:
        """Bytes one device sends per execution by a ring over its group of n (NCCL's bus-bandwidth
        convention, nccl-tests' PERFORMANCE.md): an all-gather or all-to-all sends (n-1)/n of its
        result, a reduce-scatter n-1 results (its input is n of them), an all-reduce a
        reduce-scatter plus an all-gather, 2 (n-1)/n of it; a permute sends its buffer once."""
        n = self.group_size
        if self.op == "collective-permute":
            return float(self.bytes) if self.groups else 0.0
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1}.get(self.op, (n - 1) / n)
        return float(self.bytes * factor)


def _replica_groups(line: str, num_partitions: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective's line, in any of XLA's three spellings: listed
    (`{{0,1},{2,3}}`), iota (`[2,2]<=[4]`, `[2,2]<=[2,2]T(1,0)`) or mesh axes
    (`mesh['a'=2,'b'=8] {'b'}`: the devices that differ only along `b`). No groups, or an empty
    list, is one group of every partition."""
    pairs = _PAIRS.search(line)
    if pairs:
        return tuple(tuple(int(d) for d in p.split(",") if d) for p in re.findall(r"\{([0-9,]*)\}", pairs["pairs"]))
    listed = _GROUPS_LIST.search(line)
    if listed and listed["groups"]:
        return tuple(tuple(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([0-9,]*)\}", listed["groups"]))
    iota = _GROUPS_IOTA.search(line)
    if iota:
        dims = [int(d) for d in iota["dims"].split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota["perm"]:
            ids = ids.transpose([int(d) for d in iota["perm"].split(",")])
        shape = [int(d) for d in iota["shape"].split(",")]
        return tuple(tuple(int(d) for d in g) for g in ids.reshape(shape[0], -1))
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        axes = [(name.strip().strip("'"), int(size)) for name, size in re.findall(r"([^,=]+)=(\d+)", mesh["axes"])]
        over = {name.strip().strip("'") for name in mesh["over"].split(",") if name.strip()}
        order = [i for i, (name, _) in enumerate(axes) if name not in over] + [
            i for i, (name, _) in enumerate(axes) if name in over
        ]
        ids = np.arange(int(np.prod([size for _, size in axes]))).reshape([size for _, size in axes])
        size = int(np.prod([s for name, s in axes if name in over]))
        return tuple(tuple(int(d) for d in g) for g in ids.transpose(order).reshape(-1, size))
    return (tuple(range(num_partitions)),)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled (SPMD-partitioned) module, with how often it runs per call
    of the module. An async pair (`-start` / `-done`) is one collective, its bytes the done's
    result, its groups the start's."""
    module = parsed(hlo_text)
    partitions = _NUM_PARTITIONS.search(hlo_text.split("\n", 1)[0])
    num_partitions = int(partitions["n"]) if partitions else 1
    found = []
    for name, lines in module.bodies.items():
        starts: dict[str, str] = {}
        for line in lines:
            match, definition = _INSTRUCTION.search(line), DEFINITION.match(line)
            if match is None or definition is None:
                continue
            op = match["op"]
            if op.endswith("-start") and op.removesuffix("-start") in COLLECTIVES:
                starts[definition["name"]] = line
                continue
            if op.endswith("-done") and op.removesuffix("-done") in COLLECTIVES:
                line = starts.get(definition["args"].strip().lstrip("%"), line)
            elif op not in COLLECTIVES:
                continue
            found.append(
                Collective(
                    op.removesuffix("-done"),
                    definition["name"],
                    shape_bytes(match["shape"]),
                    _replica_groups(line, num_partitions),
                    module.counts.get(name, 0),
                )
            )
    return found


def collective_bytes(hlo_text: str) -> Counter:
    """Result bytes of every kind of collective per device per call of a compiled module: each
    collective's result size times how often its computation runs."""
    totals: Counter = Counter()
    for c in collectives(hlo_text):
        totals[c.op] += c.bytes * c.executions
    return totals


def num_partitions(hlo_text: str) -> int:
    """The SPMD partitions a module runs on (its header's `num_partitions`, 1 if unset)."""
    partitions = _NUM_PARTITIONS.search(hlo_text.split("\n", 1)[0])
    return int(partitions["n"]) if partitions else 1


def collective_of(line: str, partitions: int) -> Collective | None:
    """The collective an instruction line runs (a plain or `-start` collective op), once."""
    match, definition = _INSTRUCTION.search(line), DEFINITION.match(line)
    if match is None or definition is None or match["op"].removesuffix("-start") not in COLLECTIVES:
        return None
    op = match["op"].removesuffix("-start")
    shape = tuple_elements(match["shape"])[-1] if match["op"].endswith("-start") else match["shape"]
    return Collective(op, definition["name"], shape_bytes(shape), _replica_groups(line, partitions), 1)


# --------------------------------------------------------------------------------------------
# Reading a program's host-memory slices and metadata, for the plan's verifier
# (`ferry.plan.verify`): which op each instruction came from, how many matrix products run, and
