"""Numbers read from a compiled program's HLO text: what XLA really emits, per device.

A collective inside a `while` body (the layer scan) runs once per iteration, so every count is
weighted by how often its computation runs: the product of the trip counts XLA records
(`known_trip_count`) on the loops around it.
"""

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
_CALLEE = re.compile(r"\b(?P<kind>body|condition|calls|to_apply)=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


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


def _execution_counts(bodies: dict[str, list[str]], entry: str) -> dict[str, int]:
    counts: Counter = Counter()

    def visit(name: str, times: int) -> None:
        counts[name] += times
        for line in bodies.get(name, []):
            trip = _TRIP_COUNT.search(line)
            for callee in _CALLEE.finditer(line):
                repeat = int(trip["n"]) if trip and callee["kind"] == "body" else 1
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
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(d) for d in match["dims"].split(",") if d] if match else []


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of every matrix product in a compiled module (`dot`, cuBLAS GEMM custom calls and
    `ragged-dot`, counted as dense), weighted by how often its computation runs: what
    `cost_analysis()` does not report for compile-only GPU devices. 2 x output elements x the
    contracted size; elementwise work is not counted."""
    bodies, entry = _computations(hlo_text)
    counts = _execution_counts(bodies, entry)
    shapes: dict[str, str] = {}
    for lines in bodies.values():
        for line in lines:
            definition = _DEFINITION.match(line)
            if definition:
                shapes[definition["name"]] = definition["shape"]
    total = 0.0
    for name, lines in bodies.items():
        for line in lines:
            definition = _DEFINITION.match(line)
            if definition is None:
                continue
            op, dims = definition["op"], None
            if op == "dot":
                dims = _DOT_DIMS.search(line)
            elif op == "custom-call" and "cublas" in line:
                dims = _GEMM_DIMS.search(line)
            elif op == "ragged-dot":
                dims = _DOT_DIMS.search(line)
            if dims is None:
                continue
            lhs = definition["args"].split(",")[0].strip().lstrip("%")
            lhs_dims = _dims(shapes.get(lhs, ""))
            contracted = [int(d.strip().strip('"')) for d in dims["dims"].split(",") if d.strip()]
            if not lhs_dims or any(d >= len(lhs_dims) for d in contracted):
                continue
            out = _dims(definition["shape"])  # a GEMM's (result, workspace) tuple: its first array
            size = int(np.prod([lhs_dims[d] for d in contracted], dtype=np.int64))
            total += 2.0 * float(np.prod(out, dtype=np.int64)) * size * counts.get(name, 0)
    return total
