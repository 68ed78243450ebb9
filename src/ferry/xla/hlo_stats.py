"""Numbers read from a compiled program's HLO text: what XLA really emits, per device.

A collective inside a `while` body (the layer scan) runs once per iteration, so every count is
weighted by how often its computation runs: the product of the trip counts XLA records
(`known_trip_count`) on the loops around it.
"""

import dataclasses
import functools
import re
from collections import Counter
from collections.abc import Mapping

import numpy as np

from ferry.expected_work import expected_fraction

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


def same_module(a: str, b: str) -> bool:
    """Whether two dumps print the same module: the same computations of the same instructions,
    in whatever order (a scheduled module prints its sequence)."""

    def instructions(text: str) -> dict[str, list[str]]:
        return {name: sorted(lines) for name, lines in _computations(text)[0].items()}

    return instructions(a) == instructions(b)


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
    bodies, entry = _computations(hlo_text)
    counts = _execution_counts(bodies, entry)
    partitions = _NUM_PARTITIONS.search(hlo_text.split("\n", 1)[0])
    num_partitions = int(partitions["n"]) if partitions else 1
    found = []
    for name, lines in bodies.items():
        starts: dict[str, str] = {}
        for line in lines:
            match, definition = _INSTRUCTION.search(line), _DEFINITION.match(line)
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
                    counts.get(name, 0),
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


_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[a-z\-]+)\((?P<args>[^)]*)\)"
)
_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{(?P<dims>[0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(?P<lhs>\w+)_(?P<rhs>\w+)->(?P<out>\w+)")
_FEATURE_GROUPS = re.compile(r"feature_group_count=(?P<n>\d+)")
_WINDOW = re.compile(r"window=\{(?P<window>[^}]*)\}")
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')
_COST_ESTIMATE_FLOPS = re.compile(r'"cost_estimate":\{"flops":"(?P<flops>\d+)"')
_GROUPED_GEMM = "grouped_gemm_backend_config"


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(d) for d in match["dims"].split(",") if d] if match else []


class _Module:
    """A compiled module's computations, parsed once: instruction lines in schedule order (a
    scheduled module prints each computation in the order it runs), every value's shape, and the
    matmul FLOPs of a computation including the computations it calls: as they run where the
    model marked an op's static work as partly skipped (`ferry.expected_work`), or with `bound`
    the static count, an upper bound."""

    def __init__(self, hlo_text: str):
        self.bodies, self.entry = _computations(hlo_text)
        self.shapes: dict[str, str] = {}
        for lines in self.bodies.values():
            for line in lines:
                definition = _DEFINITION.match(line)
                if definition:
                    self.shapes[definition["name"]] = definition["shape"]
        for name, shape in list(self.shapes.items()):  # `%name#index`, as a module before scheduling writes it
            if shape.startswith("("):
                self.shapes |= {f"{name}#{i}": element for i, element in enumerate(tuple_elements(shape))}
        self._flops: dict[tuple[str, bool], float] = {}

    @functools.cached_property
    def roots(self) -> dict[str, str]:
        """Each computation's ROOT line ("" where it has none)."""
        return {name: next((line for line in lines if "ROOT " in line), "") for name, lines in self.bodies.items()}

    def own_flops(self, line: str) -> float:
        """2 x output elements x contracted size of a `dot`, cuBLAS GEMM or `ragged-dot` line; a
        TPU `convolution` by `convolution_flops`; a kernel (custom call) by the FLOPs its backend
        config estimates (Pallas kernels: `cost_estimate`), a grouped GEMM by `grouped_flops`."""
        definition = _DEFINITION.match(line)
        if definition is None:
            return 0.0
        op, dims = definition["op"], None
        lhs = definition["args"].split(",")[0].strip().lstrip("%")
        lhs_dims = _dims(self.shapes.get(lhs, ""))
        if op == "convolution":
            return self.convolution_flops(line, definition["shape"], lhs_dims)
        if op == "custom-call":
            estimate = _COST_ESTIMATE_FLOPS.search(line)
            if estimate:
                return float(estimate["flops"])
            if _GROUPED_GEMM in line:
                operands = [self.shapes.get(name, "") for name in _operands(definition)]
                return grouped_flops(operands, definition["shape"])
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
        features each output reads (the lhs `f` dimension over the feature groups) x the window
        taps that land on an input element. A base-dilated input (`lhs_dilate=N`) has N - 1
        holes between its elements, so of a window of `size` taps at most ceil(size / N) read
        one: a batch-as-spatial convolution (`size=N stride=N-1 lhs_dilate=N`, how XLA:TPU
        writes a product batched over N experts or heads) reads one tap per output, not N."""
        labels = _DIM_LABELS.search(line)
        if labels is None or len(labels["lhs"]) != len(lhs_dims):
            return 0.0
        groups = _FEATURE_GROUPS.search(line)
        reduced = lhs_dims[labels["lhs"].index("f")] // (int(groups["n"]) if groups else 1)
        return 2.0 * float(np.prod(_dims(shape), dtype=np.int64)) * reduced * window_taps(line)

    def line_flops(self, line: str, bound: bool = False) -> float:
        """The line's own FLOPs plus those of what it calls (loop bodies times their trip count,
        `loop_share` of it unless `bound`)."""
        total = self.own_flops(line)
        for callee in _CALLEE.finditer(line):
            share = 1.0 if bound else self.loop_share(line)
            repeat = _trip_count(line, self.bodies) * share if callee["kind"] == "body" else 1
            total += repeat * self.computation_flops(callee["name"], bound)
        branches = _BRANCHES.search(line)
        for branch in branches["names"].split(",") if branches else []:
            total += self.computation_flops(branch.strip().lstrip("%"), bound)
        return total

    def loop_share(self, line: str) -> float:
        """Of a loop's trips, the share that does its work: the model marks a loop sized for the
        worst case (`ferry.expected_work`) on the loop itself, whose instruction is its own where
        XLA may share one body between loops (op names inside it can be another loop's)."""
        name = _OP_NAME.search(line)
        return expected_fraction(name["name"]) if name else 1.0

    def computation_flops(self, name: str, bound: bool = False) -> float:
        if (name, bound) not in self._flops:
            self._flops[name, bound] = sum(self.line_flops(line, bound) for line in self.bodies.get(name, []))
        return self._flops[name, bound]


def window_taps(line: str) -> int:
    """The taps of a convolution's window that read an input element, per output element: per
    spatial dimension ceil(size / lhs_dilate) (padding at the edges is not discounted)."""
    window = _WINDOW.search(line)
    if window is None:
        return 1
    fields = dict(field.split("=", 1) for field in window["window"].split() if "=" in field)
    sizes = [int(n) for n in fields.get("size", "1").split("x")]
    dilations = [int(n) for n in fields.get("lhs_dilate", "x".join("1" * len(sizes))).split("x")]
    return int(np.prod([-(-size // dilation) for size, dilation in zip(sizes, dilations, strict=True)]))


def grouped_flops(operands: list[str], shape: str) -> float:
    """FLOPs of a grouped matmul kernel from its shapes: rows [m, k] x groups' matrices
    [groups, k, n] -> [m, n] (forward, input gradient), or [m, k] and [m, n] -> [groups, k, n]
    (weight gradient), 2 x m x k x n either way. Each of m, k and n indexes two of the three
    matrices and the group axis one, so m x k x n is the square root of their sizes' product
    without the group axis. Integer operands (group sizes) are not matrices."""
    matrices = [s for s in (*operands, shape) if len(_dims(s)) >= 2 and _is_float(s)]
    grouped = [s for s in matrices if len(_dims(s)) == 3]
    if len(matrices) != 3 or len(grouped) != 1:
        return 0.0
    product = np.prod([float(np.prod(_dims(s), dtype=np.int64)) for s in matrices]) / _dims(grouped[0])[0]
    return 2.0 * float(np.sqrt(product))


def _is_float(shape: str) -> bool:
    match = _ARRAY.search(shape)
    return match is not None and match["dtype"][0] in "fb"  # f32, bf16, f8e4m3fn...


@functools.lru_cache(maxsize=2)
def _parsed(hlo_text: str) -> "_Module":
    """The planner reads FLOPs, host copies and their overlap from one program: parse it once."""
    return _Module(hlo_text)


def matmul_flops(hlo_text: str, bound: bool = False) -> float:
    """FLOPs of every matrix product in a compiled module (`dot`, cuBLAS GEMM custom calls,
    `ragged-dot` counted as dense, TPU `convolution`s, and kernels: Pallas custom calls by their
    cost estimate, grouped GEMMs by their shapes), weighted by how often its computation runs:
    what `cost_analysis()` does not report for compile-only GPU devices. 2 x output elements x
    the contracted size; elementwise work is not counted. Of a product the model marked as run
    in part (a MoE's tiles, `ferry.expected_work`), the share that runs; with `bound`, all of it
    (the program's static count, an upper bound)."""
    module = _parsed(hlo_text)
    return module.computation_flops(module.entry, bound)


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
                    _slice_descriptor(lines[begin], module.roots),
                )
            )
    return copies


def _slice_descriptor(start: str, roots: Mapping[str, str]) -> bool | None:
    """Whether the host slice an async start runs carries XLA:GPU's memcpy descriptor
    (`dynamic_slice_config`, on the slice or on a fusion around it); None where it runs no slice."""
    lines, line = [start], start
    while (callee := _CALLEE.search(line)) and (line := roots.get(callee["name"], "")) and len(lines) < 4:
        lines.append(line)
    definition = _DEFINITION.match(lines[-1])
    if definition is None or definition["op"] not in ("dynamic-slice", "dynamic-update-slice"):
        return None
    return any("dynamic_slice_config" in line for line in lines)


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


def computation_flops(hlo_text: str, names: set[str]) -> dict[str, float]:
    """The matmul FLOPs of one run of each named computation, the loops it runs included (their
    bodies times their trip counts)."""
    module = _parsed(hlo_text)
    return {name: module.computation_flops(name) for name in names}


# --------------------------------------------------------------------------------------------
# The instructions XLA's latency-hiding scheduler orders, for the cost profile ferry gives it
# (`ferry.xla.scheduler_costs`). Read from the module as the scheduler receives it (XLA's dump
# before `latency-hiding-scheduler`), whose text differs from a final program's in two ways: a
# tuple's element is an operand written `%name#index` (no get-tuple-element), and every
# asynchronous op is a generic `async-start` / `async-done` calling the computation it wraps.

_NOPS = frozenset(
    {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "partition-id", "replica-id"}
    | {"after-all", "opt-barrier"}
)


@dataclasses.dataclass(frozen=True)
class ScheduledInstruction:
    """One instruction of a computation the scheduler orders (the entry, a loop's body or
    condition, a branch, a called computation; never a fusion's inside)."""

    computation: str
    name: str
    op: str
    shape: str
    operand_shapes: tuple[str, ...]
    flops: float  # its matrix work, a fusion's included (`matmul_flops`'s count); 0 for loops and calls
    callees: tuple[str, ...]  # loop body and condition, branches, called or wrapped computation
    trip_count: int  # a loop's; 1 for everything else
    share: float  # of a loop's trips, the share that does its work (`_Module.loop_share`); 1 for everything else
    wrapped: str  # the root line of what an async-start or fusion runs, inside any fusion it wraps ("" if none)
    start: str  # an async-done's start ("" for anything else)

    @property
    def is_nop(self) -> bool:
        """Costs nothing to run: tuple plumbing, parameters, constants, bitcasts."""
        return self.op in _NOPS

    @property
    def wrapped_op(self) -> str:
        definition = _DEFINITION.match(self.wrapped)
        return definition["op"] if definition else ""


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (`(f32[2], (s32[], bf16[4]))` -> `f32[2]`,
    `(s32[], bf16[4])`); an array shape is its own only element."""
    shape = _COMMENT.sub("", shape).strip()
    if not shape.startswith("("):
        return [shape]
    elements, depth, current = [], 0, ""
    for char in shape[1:-1]:
        if char == "," and depth == 0:
            elements.append(current.strip())
            current = ""
            continue
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        current += char
    if current.strip():
        elements.append(current.strip())
    return elements


def scheduled_instructions(hlo_text: str) -> dict[str, list[ScheduledInstruction]]:
    """Every instruction of every computation the scheduler orders, by computation, in the
    module's order; each loop, branch and call is one instruction of the computation holding it."""
    module = _parsed(hlo_text)
    out: dict[str, list[ScheduledInstruction]] = {}
    pending, seen = [module.entry], set()
    while pending:
        computation = pending.pop()
        if computation in seen or computation not in module.bodies:
            continue
        seen.add(computation)
        instructions = out.setdefault(computation, [])
        for line in module.bodies[computation]:
            definition = _DEFINITION.match(line)
            if definition is None:
                continue
            op = definition["op"]
            callees = tuple(c["name"] for c in _CALLEE.finditer(line))
            branches = _BRANCHES.search(line)
            callees += tuple(b.strip().lstrip("%") for b in branches["names"].split(",")) if branches else ()
            if op in ("while", "conditional", "call"):
                pending.extend(callees)
            control = op in ("while", "conditional", "call")
            wrapped = module.roots.get(callees[0], "") if op in ("fusion", "async-start") and callees else ""
            while " fusion(" in wrapped and (inner := _CALLEE.search(wrapped)):  # an async op wrapping a fusion
                wrapped = module.roots.get(inner["name"], "")
            instructions.append(
                ScheduledInstruction(
                    computation,
                    definition["name"],
                    op,
                    definition["shape"],
                    tuple(module.shapes.get(name, "") for name in _operands(definition)),
                    0.0 if control else module.line_flops(line),
                    callees,
                    _trip_count(line, module.bodies) if op == "while" else 1,
                    module.loop_share(line) if op == "while" else 1.0,
                    wrapped,
                    _operands(definition)[0] if op.endswith("-done") and _operands(definition) else "",
                )
            )
    return out


def num_partitions(hlo_text: str) -> int:
    """The SPMD partitions a module runs on (its header's `num_partitions`, 1 if unset)."""
    partitions = _NUM_PARTITIONS.search(hlo_text.split("\n", 1)[0])
    return int(partitions["n"]) if partitions else 1


def collective_of(line: str, partitions: int) -> Collective | None:
    """The collective an instruction line runs (a plain or `-start` collective op), once."""
    match, definition = _INSTRUCTION.search(line), _DEFINITION.match(line)
    if match is None or definition is None or match["op"].removesuffix("-start") not in COLLECTIVES:
        return None
    op = match["op"].removesuffix("-start")
    shape = tuple_elements(match["shape"])[-1] if match["op"].endswith("-start") else match["shape"]
    return Collective(op, definition["name"], shape_bytes(shape), _replica_groups(line, partitions), 1)


# --------------------------------------------------------------------------------------------
# Reading a program's host-memory slices and metadata, for the plan's verifier
# (`ferry.plan.verify`): which op each instruction came from, how many matrix products run, and
# how each host buffer in a loop is walked.

_OP_NAME = re.compile(r'\bop_name="(?P<name>[^"]*)"')
_COMMENT = re.compile(r"/\*.*?\*/")
_WHILE = re.compile(r"\bwhile\((?P<init>[^)]*)\).*?\bbody=%(?P<body>[\w.\-]+)")
_INDEX = re.compile(r"\bindex=(?P<k>\d+)")
_DIRECTION = re.compile(r"\bdirection=(?P<d>[A-Z]+)")
_BACKEND_CONFIG = "backend_config="
_LAYOUT = re.compile(r"\]\{(?P<minor_to_major>[0-9,]*)")


def op_names(hlo_text: str) -> dict[str, str]:
    """Every instruction's `op_name` metadata (the JAX name stack it was traced under), by
    instruction name (names are unique in a module)."""
    module = _parsed(hlo_text)
    names = {}
    for lines in module.bodies.values():
        for line in lines:
            definition, op_name = _DEFINITION.match(line), _OP_NAME.search(line)
            if definition and op_name:
                names[definition["name"]] = op_name["name"]
    return names


_REMATERIALISED = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]*\.remat(?!erialized)[\w.\-]*\s*=", re.MULTILINE)


def xla_rematerialised(hlo_text: str) -> int:
    """How many instructions XLA's own rematerialisation pass added to the program (it names each
    clone `<original>.remat`; the `.rematerialized` broadcasts another pass clones into loops, a
    few dozen in a DeepSeek-V3 step, are not its). The pass runs, where it is on (gpu.yaml turns it
    off), when its estimate of the program's memory exceeds its limit
    (`xla_gpu_memory_limit_slop_factor` percent of 80% of HBM, less the outputs); its estimate
    counts pinned host buffers as HBM. Its recomputation is in the program's matmul count."""
    return len(_REMATERIALISED.findall(hlo_text))


def matmul_count(hlo_text: str) -> int:
    """How many matrix products (`dot`, cuBLAS GEMM, `ragged-dot`, TPU `convolution`) one call of
    the program runs: each counted once per execution of its computation, fusions included."""
    module = _parsed(hlo_text)  # every product the program holds, run or not
    counts = _execution_counts(module.bodies, module.entry)
    return sum(
        counts.get(name, 0) * sum(1 for line in lines if module.own_flops(line) > 0)
        for name, lines in module.bodies.items()
    )


def backend_config(line: str) -> dict:
    """An instruction's `backend_config` JSON ({} when it has none)."""
    import json

    at = line.find(_BACKEND_CONFIG)
    if at < 0 or line[at + len(_BACKEND_CONFIG)] != "{":
        return {}
    try:
        config, _ = json.JSONDecoder().raw_decode(line[at + len(_BACKEND_CONFIG) :])
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def _operands(definition: re.Match) -> list[str]:
    return [a.strip().lstrip("%") for a in _COMMENT.sub("", definition["args"]).split(",") if a.strip()]


def byte_strides(shape: str) -> list[int]:
    """Bytes between consecutive indices of each dimension of an array shape in its layout
    (`bf16[2,8,64]{2,1,0}`: row-major; no layout: row-major)."""
    match = _ARRAY.search(shape)
    dims = _dims(shape)
    layout = _LAYOUT.search(shape)
    minor_to_major = [int(d) for d in layout["minor_to_major"].split(",") if d] if layout else []
    if sorted(minor_to_major) != list(range(len(dims))):
        minor_to_major = list(range(len(dims)))[::-1]
    strides, step = [0] * len(dims), _DTYPE_BYTES.get(match["dtype"], 0) if match else 0
    for d in minor_to_major:
        strides[d] = step
        step *= dims[d]
    return strides


@dataclasses.dataclass(frozen=True)
class HostSliceWalk:
    """A `dynamic-slice` (host read) or `dynamic-update-slice` (host write) of a pinned-host
    buffer in a loop body, with what its index does and what XLA's descriptor says it does.

    XLA:GPU precomputes the addresses of such slices as `byte_offset + iteration x byte_stride`
    (`dynamic_slice_config`, under `"linear"` since jax 0.12); the walk is right when that is the
    address the index expression gives at every iteration."""

    computation: str  # the loop body
    instruction: str  # the (async) instruction that runs the slice
    kind: str  # "host read" or "host write"
    buffer_shape: str  # the pinned-host buffer
    slice_bytes: int  # bytes moved per iteration
    op_name: str
    trip_count: int
    index_start: int | None  # the index (of the walked dimension) at the first and second iteration
    index_next: int | None
    expected_offset: int | None  # bytes, from the index expression; None where it was not resolved
    expected_stride: int | None
    descriptor_offset: int | None  # bytes, from XLA's descriptor; None where there is none
    descriptor_stride: int | None

    @property
    def checked(self) -> bool:
        return None not in (self.expected_offset, self.expected_stride, self.descriptor_offset, self.descriptor_stride)

    @property
    def agrees(self) -> bool:
        """The descriptor walks where the index goes (True where nothing can be compared). A loop
        of one trip (XLA's pipelining peels a two-layer loop to one) has no second address: only
        its offset counts."""
        if not self.checked:
            return True
        if self.trip_count <= 1:
            return self.descriptor_offset == self.expected_offset
        return (self.descriptor_offset, self.descriptor_stride) == (self.expected_offset, self.expected_stride)


class _ScalarEvaluator:
    """Evaluates integer scalars of a loop body for a given value of its induction variable: the
    index expressions of dynamic slices (`i`, `n - 1 - i`, through fusions). None where a value
    is not an affine-enough scalar this evaluator knows (a loop-carried value, a load...)."""

    _BINARY = {
        "add": lambda a, b: a + b,
        "subtract": lambda a, b: a - b,
        "multiply": lambda a, b: a * b,
        "maximum": max,
        "minimum": min,
    }
    _COMPARE = {
        "LT": lambda a, b: a < b,
        "LE": lambda a, b: a <= b,
        "GT": lambda a, b: a > b,
        "GE": lambda a, b: a >= b,
        "EQ": lambda a, b: a == b,
        "NE": lambda a, b: a != b,
    }

    def __init__(self, module: "_Module"):
        self.lines: dict[str, dict[str, re.Match]] = {}
        self.param_names: dict[str, dict[int, str]] = {}
        self.roots: dict[str, str] = {}
        for computation, lines in module.bodies.items():
            table, params = {}, {}
            for line in lines:
                definition = _DEFINITION.match(line)
                if definition is None:
                    continue
                table[definition["name"]] = definition
                if definition["op"] == "parameter":
                    params[int(definition["args"])] = definition["name"]
                if line.lstrip().startswith("ROOT"):
                    self.roots[computation] = definition["name"]
            self.lines[computation], self.param_names[computation] = table, params

    def value(self, computation: str, name: str, bindings: dict, depth: int = 0) -> int | None:
        """`name` in `computation`, where `bindings` maps parameter numbers to values and the
        loop body's tuple parameter is bound to {"tuple": {index: value}}."""
        definition = self.lines.get(computation, {}).get(name)
        if definition is None or depth > 64:
            return None
        op, operands, line = definition["op"], _operands(definition), definition.string
        if op == "parameter":
            return bindings.get(int(definition["args"]))
        if op == "constant":
            try:
                return int(definition["args"])
            except ValueError:
                return None
        if op == "get-tuple-element":
            tuple_value = self._tuple(computation, operands[0], bindings)
            index = _INDEX.search(line)
            return tuple_value.get(int(index["k"])) if tuple_value is not None and index else None

        def arg(k: int) -> int | None:
            return self.value(computation, operands[k], bindings, depth + 1) if k < len(operands) else None

        if op in ("bitcast", "copy", "convert", "reshape") and operands:
            return arg(0)
        if op == "negate":
            a = arg(0)
            return None if a is None else -a
        if op in self._BINARY:
            a, b = arg(0), arg(1)
            return None if a is None or b is None else self._BINARY[op](a, b)
        if op == "compare":
            a, b, direction = arg(0), arg(1), _DIRECTION.search(line)
            return None if a is None or b is None or not direction else int(self._COMPARE[direction["d"]](a, b))
        if op == "select":
            predicate = arg(0)
            return None if predicate is None else arg(1 if predicate else 2)
        if op == "clamp":
            low, x, high = arg(0), arg(1), arg(2)
            return None if None in (low, x, high) else min(max(x, low), high)
        if op == "fusion":
            callee = _CALLEE.search(line)
            if callee is None:
                return None
            inner = {k: arg(k) for k in range(len(operands))}
            return self.value(callee["name"], self.roots.get(callee["name"], ""), inner, depth + 1)
        return None

    def _tuple(self, computation: str, name: str, bindings: dict) -> dict[int, int | None] | None:
        definition = self.lines.get(computation, {}).get(name)
        if definition is None:
            return None
        if definition["op"] == "parameter":
            bound = bindings.get(int(definition["args"]))
            return bound.get("tuple") if isinstance(bound, dict) else None
        return None


def host_slice_walks(hlo_text: str) -> list[HostSliceWalk]:
    """Every dynamic slice of a pinned-host (`S(5)`) buffer inside a loop body, with the index
    its walked dimension takes at the loop's first two iterations (evaluated from the index
    expression and the loop's counter: its initial value in the `while`'s operand, its step in
    the body's result) and XLA's address descriptor where it has one (GPU)."""
    module = _parsed(hlo_text)
    evaluator = _ScalarEvaluator(module)
    names = op_names(hlo_text)
    walks = []
    for caller, lines in module.bodies.items():
        for line in lines:
            loop = _WHILE.search(line)
            if loop is None or _DEFINITION.match(line) is None:
                continue
            body = loop["body"]
            for site in module.bodies.get(body, []):
                walk = _walk(module, evaluator, caller, line, body, site, names)
                if walk is not None:
                    walks.append(walk)
    return walks


def _slice_root(module: "_Module", evaluator: _ScalarEvaluator, site: re.Match) -> tuple[str, re.Match] | None:
    """The dynamic slice an instruction runs: itself, or the root of the computation it calls."""
    if site["op"] in ("dynamic-slice", "dynamic-update-slice"):
        return "", site
    callee = _CALLEE.search(site.string)
    if site["op"] not in ("fusion", "fusion-start", "async-start") or callee is None:
        return None
    root = evaluator.lines.get(callee["name"], {}).get(evaluator.roots.get(callee["name"], ""))
    if root is None or root["op"] not in ("dynamic-slice", "dynamic-update-slice"):
        return None
    return callee["name"], root


def _walk(
    module: "_Module",
    evaluator: _ScalarEvaluator,
    caller: str,
    while_line: str,
    body: str,
    line: str,
    names: dict[str, str],
) -> HostSliceWalk | None:
    site = _DEFINITION.match(line)
    if site is None:
        return None
    found = _slice_root(module, evaluator, site)
    if found is None:
        return None
    callee, root = found
    root_operands = _operands(root)
    is_write = root["op"] == "dynamic-update-slice"
    buffer_shape = root["shape"] if is_write else _shape_in(evaluator, callee or body, root_operands[0])
    if HOST_MEMORY_SPACE not in buffer_shape:
        return None
    config = backend_config(root.string).get("dynamic_slice_config") or backend_config(line).get("dynamic_slice_config")
    descriptor = (config.get("linear") or config) if config else None
    first_index = 2 if is_write else 1
    site_operands = _operands(site)

    def indices(state: dict[int, int | None] | None) -> list[int | None]:
        if state is None:
            return [None] * (len(root_operands) - first_index)
        loop = {0: {"tuple": state}}
        if callee:  # the root's operands are the callee's parameters, bound to the site's operands
            params = {k: evaluator.value(body, name, loop) for k, name in enumerate(site_operands)}
            return [evaluator.value(callee, name, params) for name in root_operands[first_index:]]
        return [evaluator.value(body, name, loop) for name in root_operands[first_index:]]

    states = _loop_states(evaluator, caller, while_line, body)
    first, second = indices(states[0]), indices(states[1])
    strides = byte_strides(buffer_shape)
    expected_offset = expected_stride = None
    if None not in first and None not in second and len(first) == len(strides):
        expected_offset = sum(i * s for i, s in zip(first, strides, strict=True))
        expected_stride = sum((b - a) * s for a, b, s in zip(first, second, strides, strict=True))
    walked = next((d for d in range(len(first)) if first[d] != second[d]), 0)
    sliced = root["shape"] if not is_write else _shape_in(evaluator, callee or body, root_operands[1])
    return HostSliceWalk(
        computation=body,
        instruction=site["name"],
        kind="host write" if is_write else "host read",
        buffer_shape=buffer_shape.split("{")[0],
        slice_bytes=shape_bytes(sliced),
        op_name=names.get(site["name"], names.get(root["name"], "")),
        trip_count=_trip_count(while_line, module.bodies),
        index_start=first[walked] if first else None,
        index_next=second[walked] if second else None,
        expected_offset=expected_offset,
        expected_stride=expected_stride,
        descriptor_offset=_int(descriptor.get("byte_offset")) if descriptor else None,
        descriptor_stride=_int(descriptor.get("byte_stride")) if descriptor else None,
    )


def _int(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _shape_in(evaluator: _ScalarEvaluator, computation: str, name: str) -> str:
    definition = evaluator.lines.get(computation, {}).get(name)
    return definition["shape"] if definition else ""


_SCALAR = re.compile(r"^[su](8|16|32|64)\[\]")


def _loop_states(
    evaluator: _ScalarEvaluator, caller: str, while_line: str, body: str
) -> tuple[dict[int, int | None] | None, dict[int, int | None] | None]:
    """The loop's integer scalars at its first two iterations: each element's initial value (the
    `while` operand's element, where a constant) and its value after one trip (the body's result
    element evaluated on the first). Besides the counter this resolves indices carried from one
    iteration to the next, as XLA's pipelined host offloading carries them."""
    loop = _WHILE.search(while_line)
    init = evaluator.lines.get(caller, {}).get(loop["init"].strip().lstrip("%") if loop else "")
    root = evaluator.lines.get(body, {}).get(evaluator.roots.get(body, ""))
    if init is None or init["op"] != "tuple" or root is None or root["op"] != "tuple":
        return None, None
    results = _operands(root)
    scalars = [k for k, name in enumerate(results) if _SCALAR.match(_shape_in(evaluator, body, name))]
    elements = _operands(init)
    first = {k: evaluator.value(caller, elements[k], {}) for k in scalars if k < len(elements)}
    second = {k: evaluator.value(body, results[k], {0: {"tuple": first}}) for k in scalars}
    return first, second
