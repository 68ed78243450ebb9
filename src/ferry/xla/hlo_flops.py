"""The matrix work of a compiled program counted from its HLO text: `dot`s, cuBLAS GEMMs,
`ragged-dot`s, TPU `convolution`s and kernels, weighted by how often their computations run
(`ferry.xla.hlo_parse`) and by the share of a loop the model marks as doing work
(`ferry.xla.expected_work`)."""

import functools
import re

import numpy as np

from ferry.xla.expected_work import expected_fraction
from ferry.xla.hlo_parse import (
    BRANCHES,
    CALLEE,
    DEFINITION,
    OP_NAME,
    HloModule,
    array_dims,
    is_float,
    operand_names,
    trip_count,
)

_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{(?P<dims>[0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(?P<lhs>\w+)_(?P<rhs>\w+)->(?P<out>\w+)")
_FEATURE_GROUPS = re.compile(r"feature_group_count=(?P<n>\d+)")
_WINDOW = re.compile(r"window=\{(?P<window>[^}]*)\}")
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')
_COST_ESTIMATE_FLOPS = re.compile(r'"cost_estimate":\{"flops":"(?P<flops>\d+)"')
_GROUPED_GEMM = "grouped_gemm_backend_config"
_PRODUCT_OPS = (" dot(", " ragged-dot(", " convolution(", " custom-call(")  # the only ops with FLOPs of their own
# what a line with FLOPs holds: a product, or a computation it calls (`CALLEE`, `BRANCHES`)
_CALLS = ("body=%", "calls=%", "to_apply=%", "true_computation=%", "false_computation=%", "branch_computations={")
_COUNTED = _PRODUCT_OPS + _CALLS


def _may_have_flops(line: str) -> bool:
    """Can `line_flops` of this line be nonzero (a product, or a call of a computation)?"""
    return any(op in line for op in _COUNTED)


class FlopModule(HloModule):
    """A parsed module with the matmul FLOPs of a computation including the computations it
    calls: as they run where the model marked an op's static work as partly skipped
    (`ferry.xla.expected_work`), or with `bound` the static count, an upper bound."""

    def __init__(self, hlo_text: str):
        super().__init__(hlo_text)
        self._flops: dict[tuple[str, bool], float] = {}

    @functools.cached_property
    def counted(self) -> dict[str, list[str]]:
        """Each computation's lines that hold a product or call a computation: the only ones with
        FLOPs (`line_flops` of any other is 0). Most of a program is neither, and each count (as
        it runs, `bound`, `matmul_count`) read every line again."""
        return {name: [line for line in lines if _may_have_flops(line)] for name, lines in self.bodies.items()}

    def lines_flops(self, lines: list[str]) -> float:
        """The FLOPs of some of a computation's lines (`line_flops` of each): of those that can have any."""
        return sum((self.line_flops(line) for line in lines if _may_have_flops(line)), 0.0)

    def own_flops(self, line: str) -> float:
        """2 x output elements x contracted size of a `dot`, cuBLAS GEMM or `ragged-dot` line; a
        TPU `convolution` by `convolution_flops`; a kernel (custom call) by the FLOPs its backend
        config estimates (Pallas kernels: `cost_estimate`), a grouped GEMM by `grouped_flops`."""
        if not any(op in line for op in _PRODUCT_OPS):  # most lines: no regex for them
            return 0.0
        definition = DEFINITION.match(line)
        if definition is None:
            return 0.0
        op, dims = definition["op"], None
        lhs = definition["args"].split(",")[0].strip().lstrip("%")
        lhs_dims = array_dims(self.shapes.get(lhs, ""))
        if op == "convolution":
            return self.convolution_flops(line, definition["shape"], lhs_dims)
        if op == "custom-call":
            estimate = _COST_ESTIMATE_FLOPS.search(line)
            if estimate:
                return float(estimate["flops"])
            if _GROUPED_GEMM in line:
                operands = [self.shapes.get(name, "") for name in operand_names(definition)]
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
        out = array_dims(definition["shape"])  # a GEMM's (result, workspace) tuple: its first array
        size = int(np.prod([lhs_dims[d] for d in contracted], dtype=np.int64))
        return 2.0 * float(np.prod(out, dtype=np.int64)) * size

    @staticmethod
    def convolution_flops(line: str, shape: str, lhs_dims: list[int]) -> float:
        """TPU programs express matmuls as convolutions: 2 x output elements x the input
        features each output reads (the lhs `f` dimension over the feature groups) x the window
        taps that land on an input element (`window_taps`). XLA:TPU writes a product batched over
        N experts or heads with the batch as a spatial dimension, its taps mostly on holes or
        padding: base-dilated (`size=N stride=N-1 lhs_dilate=N`) or padded (`size=N pad=N-1_N-1`
        over an input of one element); each output reads one tap there, not N."""
        labels = _DIM_LABELS.search(line)
        if labels is None or len(labels["lhs"]) != len(lhs_dims):
            return 0.0
        groups = _FEATURE_GROUPS.search(line)
        reduced = lhs_dims[labels["lhs"].index("f")] // (int(groups["n"]) if groups else 1)
        spatial = [lhs_dims[labels["lhs"].index(str(d))] for d in range(len(labels["lhs"]) - 2)]
        return 2.0 * float(np.prod(array_dims(shape), dtype=np.int64)) * reduced * window_taps(line, spatial)

    def line_flops(self, line: str, bound: bool = False) -> float:
        """The line's own FLOPs plus those of what it calls (loop bodies times their trip count,
        `loop_share` of it unless `bound`)."""
        total = self.own_flops(line)
        for callee in CALLEE.finditer(line):
            share = 1.0 if bound else self.loop_share(line)
            repeat = trip_count(line, self.bodies) * share if callee["kind"] == "body" else 1
            total += repeat * self.computation_flops(callee["name"], bound)
        branches = BRANCHES.search(line)
        for branch in branches["names"].split(",") if branches else []:
            total += self.computation_flops(branch.strip().lstrip("%"), bound)
        return total

    def loop_share(self, line: str) -> float:
        """Of a loop's trips, the share that does its work: the model marks a loop sized for the
        worst case (`ferry.xla.expected_work`) on the loop itself, whose instruction is its own where
        XLA may share one body between loops (op names inside it can be another loop's)."""
        name = OP_NAME.search(line)
        return expected_fraction(name["name"]) if name else 1.0

    def computation_flops(self, name: str, bound: bool = False) -> float:
        if (name, bound) not in self._flops:
            self._flops[name, bound] = sum((self.line_flops(line, bound) for line in self.counted.get(name, [])), 0.0)
        return self._flops[name, bound]


def window_taps(line: str, spatial: list[int]) -> float:
    """The taps of a convolution's window that read an input element, per output element, over
    its spatial dimensions of sizes `spatial` (the lhs's, in dimension order): per dimension the
    (output, tap) pairs that land on an input element rather than on padding or a base-dilation
    hole, over the outputs."""
    window = _WINDOW.search(line)
    if window is None:
        return 1.0
    fields = dict(field.split("=", 1) for field in window["window"].split() if "=" in field)
    sizes = [int(n) for n in fields.get("size", "1").split("x")]
    ones = "x".join("1" * len(sizes))
    read = lambda key: [int(n) for n in fields.get(key, ones).split("x")]
    pads = [
        tuple(int(n) for n in pad.split("_")) for pad in fields.get("pad", "x".join(["0_0"] * len(sizes))).split("x")
    ]
    taps = 1.0
    for n, size, stride, dilation, window_dilation, (low, high) in zip(
        spatial, sizes, read("stride"), read("lhs_dilate"), read("rhs_dilate"), pads, strict=True
    ):
        taps *= _dimension_taps(n, size, stride, dilation, window_dilation, low, high)
    return taps


def _dimension_taps(n: int, size: int, stride: int, dilation: int, window_dilation: int, low: int, high: int) -> float:
    """One spatial dimension's taps per output that read one of its `n` input elements: the
    input's elements sit at `low + i * dilation` of the padded, base-dilated extent; output `o`'s
    taps at `o * stride + k * window_dilation`."""
    extent = (n - 1) * dilation + 1 + low + high
    outputs = (extent - ((size - 1) * window_dilation + 1)) // stride + 1
    if outputs <= 0 or n <= 0:
        return 0.0
    position = np.arange(outputs)[:, None] * stride + np.arange(size)[None, :] * window_dilation - low
    hits = (position >= 0) & (position % dilation == 0) & (position // dilation < n)
    return float(hits.sum()) / outputs


def grouped_flops(operands: list[str], shape: str) -> float:
    """FLOPs of a grouped matmul kernel from its shapes: rows [m, k] x groups' matrices
    [groups, k, n] -> [m, n] (forward, input gradient), or [m, k] and [m, n] -> [groups, k, n]
    (weight gradient), 2 x m x k x n either way. Each of m, k and n indexes two of the three
    matrices and the group axis one, so m x k x n is the square root of their sizes' product
    without the group axis. Integer operands (group sizes) are not matrices."""
    matrices = [s for s in (*operands, shape) if len(array_dims(s)) >= 2 and is_float(s)]
    grouped = [s for s in matrices if len(array_dims(s)) == 3]
    if len(matrices) != 3 or len(grouped) != 1:
        return 0.0
    product = np.prod([float(np.prod(array_dims(s), dtype=np.int64)) for s in matrices]) / array_dims(grouped[0])[0]
    return 2.0 * float(np.sqrt(product))


@functools.lru_cache(maxsize=2)
def parsed(hlo_text: str) -> FlopModule:
    """The planner reads FLOPs, host copies and their overlap from one program: parse it once."""
    return FlopModule(hlo_text)


def matmul_flops(hlo_text: str, bound: bool = False) -> float:
    """FLOPs of every matrix product in a compiled module (`dot`, cuBLAS GEMM custom calls,
    `ragged-dot` counted as dense, TPU `convolution`s, and kernels: Pallas custom calls by their
    cost estimate, grouped GEMMs by their shapes), weighted by how often its computation runs:
    what `cost_analysis()` does not report for compile-only GPU devices. 2 x output elements x
    the contracted size; elementwise work is not counted. Of a product the model marked as run
    in part (a MoE's tiles, `ferry.xla.expected_work`), the share that runs; with `bound`, all of it
    (the program's static count, an upper bound)."""
    module = parsed(hlo_text)
    return module.computation_flops(module.entry, bound)


def computation_flops(hlo_text: str, names: set[str]) -> dict[str, float]:
    """The matmul FLOPs of one run of each named computation, the loops it runs included (their
    bodies times their trip counts)."""
    module = parsed(hlo_text)
    return {name: module.computation_flops(name) for name in names}


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
    module = parsed(hlo_text)  # every product the program holds, run or not
    return sum(
        module.counts.get(name, 0) * sum(1 for line in lines if module.own_flops(line) > 0)
        for name, lines in module.counted.items()
    )
