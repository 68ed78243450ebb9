"""Numbers read from a compiled program's HLO text: what XLA really emits, per device.

A collective inside a `while` body (the layer scan) runs once per iteration, so every count is
weighted by how often its computation runs: the product of the trip counts XLA records
(`known_trip_count`) on the loops around it.
"""

import dataclasses
import functools
import re
from collections import Counter

import numpy as np

COLLECTIVES: tuple[str, ...] = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_DTYPE_BYTES |= {"f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s")
_INSTRUCTION = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[a-z\-]+)\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*[a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_CALLEE = re.compile(
    r"\b(?P<kind>body|condition|calls|to_apply|true_computation|false_computation)=%(?P<name>[\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%(?P<name>[\w.\-]+)")
_CONSTANT = re.compile(r"s32\[\]\S*\s+constant\((?P<n>\d+)\)")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as `f32[8,64]{1,0}` or a tuple `(f32[8], bf16[2,2])`."""
    total = 0
    for match in _ARRAY.finditer(shape):
        dims = [int(d) for d in match["dims"].split(",") if d]
        total += _DTYPE_BYTES.get(match["dtype"], 0) * int(np.prod(dims, dtype=np.int64))
    return total


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's instruction lines, and the name of the entry computation."""
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = header["name"]
            bodies[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and line.startswith(" "):
            bodies[current].append(line)
    return bodies, entry


def execution_counts(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry computation."""
    return _execution_counts(*_computations(hlo_text))


def _trip_count(line: str, bodies: dict[str, list[str]]) -> int:
    """A `while` line's trip count: XLA's `known_trip_count` (GPU, CPU), else the bound its
    condition compares the counter with (TPU, which prints no trip count; an upper bound where
    XLA peeled an iteration out of the loop)."""
    known = _TRIP_COUNT.search(line)
    if known:
        return int(known["n"])
    condition = _CONDITION.search(line)
    for cond_line in bodies.get(condition["name"], []) if condition else []:
        bound = _CONSTANT.search(cond_line)
        if bound:
            return int(bound["n"])
    return 1


def _execution_counts(bodies: dict[str, list[str]], entry: str) -> dict[str, int]:
    counts: Counter = Counter()

    def visit(name: str, times: int) -> None:
        counts[name] += times
        for line in bodies.get(name, []):
            for callee in _CALLEE.finditer(line):
                repeat = _trip_count(line, bodies) if callee["kind"] == "body" else 1
                visit(callee["name"], times * repeat)
            branches = _BRANCHES.search(line)
            for branch in branches["names"].split(",") if branches else []:
                visit(branch.strip().lstrip("%"), times)

    visit(entry, 1)
    return dict(counts)


def collective_bytes(hlo_text: str) -> Counter:
    """Bytes every kind of collective moves per device per call of a compiled (SPMD-partitioned)
    module: each collective's output size times how often its computation runs. An async pair
    (`-start` / `-done`) counts once, by the last array of the start's shape (its result)."""
    bodies, entry = _computations(hlo_text)
    counts = _execution_counts(bodies, entry)
    totals: Counter = Counter()
    for name, lines in bodies.items():
        for line in lines:
            match = _INSTRUCTION.search(line)
            if match is None or match["op"].endswith("-done"):
                continue
            op = match["op"].removesuffix("-start")
            if op in COLLECTIVES:
                shape = match["shape"]
                if match["op"].endswith("-start") and shape.startswith("("):
                    shape = list(_ARRAY.finditer(shape))[-1].group(0)
                totals[op] += shape_bytes(shape) * counts.get(name, 0)
    return totals


_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[a-z\-]+)\((?P<args>[^)]*)\)"
)
_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{(?P<dims>[0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(?P<lhs>\w+)_(?P<rhs>\w+)->(?P<out>\w+)")
_FEATURE_GROUPS = re.compile(r"feature_group_count=(?P<n>\d+)")
_WINDOW = re.compile(r"window=\{size=(?P<size>[0-9x]+)")
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(d) for d in match["dims"].split(",") if d] if match else []


class _Module:
    """A compiled module's computations, parsed once: instruction lines in schedule order (a
    scheduled module prints each computation in the order it runs), every value's shape, and the
    matmul FLOPs of a computation including the computations it calls."""

    def __init__(self, hlo_text: str):
        self.bodies, self.entry = _computations(hlo_text)
        self.shapes: dict[str, str] = {}
        for lines in self.bodies.values():
            for line in lines:
                definition = _DEFINITION.match(line)
                if definition:
                    self.shapes[definition["name"]] = definition["shape"]
        self._flops: dict[str, float] = {}

    def own_flops(self, line: str) -> float:
        """2 x output elements x contracted size of a `dot`, cuBLAS GEMM or `ragged-dot` line."""
        definition = _DEFINITION.match(line)
        if definition is None:
            return 0.0
        op, dims = definition["op"], None
        lhs = definition["args"].split(",")[0].strip().lstrip("%")
        lhs_dims = _dims(self.shapes.get(lhs, ""))
        if op == "convolution":
            return self.convolution_flops(line, definition["shape"], lhs_dims)
        if op in ("dot", "ragged-dot"):
            dims = _DOT_DIMS.search(line)
        elif op == "custom-call" and "cublas" in line:
            dims = _GEMM_DIMS.search(line)
        if dims is None:
            return 0.0
        contracted = [int(d.strip().strip('"')) for d in dims["dims"].split(",") if d.strip()]
        if not lhs_dims or any(d >= len(lhs_dims) for d in contracted):
            return 0.0
        out = _dims(definition["shape"])  # a GEMM's (result, workspace) tuple: its first array
        size = int(np.prod([lhs_dims[d] for d in contracted], dtype=np.int64))
        return 2.0 * float(np.prod(out, dtype=np.int64)) * size

    @staticmethod
    def convolution_flops(line: str, shape: str, lhs_dims: list[int]) -> float:
        """TPU programs express matmuls as convolutions: 2 x output elements x the input
        features each output reads (the lhs `f` dimension over the feature groups, times the
        window)."""
        labels = _DIM_LABELS.search(line)
        if labels is None or len(labels["lhs"]) != len(lhs_dims):
            return 0.0
        groups = _FEATURE_GROUPS.search(line)
        window = _WINDOW.search(line)
        reduced = lhs_dims[labels["lhs"].index("f")] // (int(groups["n"]) if groups else 1)
        reduced *= int(np.prod([int(w) for w in window["size"].split("x")])) if window else 1
        return 2.0 * float(np.prod(_dims(shape), dtype=np.int64)) * reduced

    def line_flops(self, line: str) -> float:
        """The line's own FLOPs plus those of what it calls (loop bodies times their trip count)."""
        total = self.own_flops(line)
        for callee in _CALLEE.finditer(line):
            repeat = _trip_count(line, self.bodies) if callee["kind"] == "body" else 1
            total += repeat * self.computation_flops(callee["name"])
        branches = _BRANCHES.search(line)
        for branch in branches["names"].split(",") if branches else []:
            total += self.computation_flops(branch.strip().lstrip("%"))
        return total

    def computation_flops(self, name: str) -> float:
        if name not in self._flops:
            self._flops[name] = sum(self.line_flops(line) for line in self.bodies.get(name, []))
        return self._flops[name]


@functools.lru_cache(maxsize=2)
def _parsed(hlo_text: str) -> "_Module":
    """The planner reads FLOPs, host copies and their overlap from one program: parse it once."""
    return _Module(hlo_text)


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of every matrix product in a compiled module (`dot`, cuBLAS GEMM custom calls,
    `ragged-dot` counted as dense, and TPU `convolution`s), weighted by how often its computation runs: what
    `cost_analysis()` does not report for compile-only GPU devices. 2 x output elements x the
    contracted size; elementwise work is not counted."""
    module = _parsed(hlo_text)
    return module.computation_flops(module.entry)


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


def host_copies(hlo_text: str) -> list[HostCopy]:
    """Every async start/done pair whose result or operands live in pinned host memory: an
    offload (a `dynamic-update-slice` into a host buffer, a `copy` to host) or a reload."""
    module = _parsed(hlo_text)
    counts = _execution_counts(module.bodies, module.entry)
    copies = []
    for name, lines in module.bodies.items():
        starts: dict[str, tuple[int, str, str]] = {}
        for position, line in enumerate(lines):
            definition = _DEFINITION.match(line)
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
                moved = [s for s in operands if HOST_MEMORY_SPACE not in s and _dims(s)]
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
            hiding = sum((module.line_flops(between) for between in lines[begin + 1 : position]), 0.0)
            copies.append(
                HostCopy(
                    name,
                    lines[begin].split("=")[0].strip().lstrip("%"),
                    direction,
                    shape,
                    size,
                    counts.get(name, 0),
                    hiding,
                    (begin, position),
                )
            )
    return copies


def overlapped_flops(hlo_text: str, copies: list[HostCopy]) -> dict[str, float]:
    """Per computation, the FLOPs scheduled while at least one host copy is in flight: the copies
    share one host link, so together they are hidden by this much compute, not by the sum of
    their windows."""
    module = _parsed(hlo_text)
    covered: dict[str, set[int]] = {}
    for copy in copies:
        covered.setdefault(copy.computation, set()).update(range(copy.window[0] + 1, copy.window[1]))
    return {
        name: sum((module.line_flops(module.bodies[name][i]) for i in positions), 0.0)
        for name, positions in covered.items()
    }
