"""The memory traffic of a compiled program: bytes its kernels read and write in HBM per call,
loop bodies counted once per trip.

Why not XLA's `cost_analysis()["bytes accessed"]`: it counts a `while` body once whatever its trip
count, so a program that walks a tensor in chunks (the chunked loss head) reads as if it made one
chunk. Here each kernel of a computation the program runs (the entry, loop bodies, branches; a
fusion is one kernel, its fused computation not walked) reads its operands and writes its result,
weighted by how often its computation runs (`ferry.xla.hlo_parse.counts_from`). Two in-place
patterns count what moves, not the buffer they touch: an operand a kernel only `dynamic-slice`s
is read as the slices, and a `dynamic-update-slice` (alone, or the root of a fusion) writes its
update into a buffer it does not read. A kernel whose backend config carries a cost estimate (a
Pallas kernel's `cost_estimate`) counts that estimate's bytes. Shape bookkeeping (parameters,
constants, tuples, bitcasts) moves nothing.
"""

import functools
import re

from ferry.xla.hlo_parse import DEFINITION, HloModule, backend_config, operand_names, shape_bytes

# ops that move no bytes of their own: bookkeeping, and control flow whose computations are walked
_FREE = frozenset(
    {
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
        "bitcast",
        "while",
        "conditional",
        "call",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
    }
)
_CALLS = re.compile(r"\bcalls=%(?P<name>[\w.\-]+)")
_PARAMETER = re.compile(r"parameter\((?P<index>\d+)\)")


class TrafficModule(HloModule):
    """A parsed module whose kernels' bytes are counted (see the module)."""

    @functools.cached_property
    def definitions(self) -> dict[str, list[re.Match]]:
        """Each computation's parsed instruction lines."""
        return {
            name: [match for line in lines if (match := DEFINITION.match(line)) is not None]
            for name, lines in self.bodies.items()
        }

    def kernel_bytes(self, line: str, definition: re.Match) -> float:
        op = definition["op"]
        if op in _FREE:
            return 0.0
        estimate = backend_config(line).get("cost_estimate")  # a Pallas kernel's own estimate
        if isinstance(estimate, dict) and "bytes_accessed" in estimate:
            return float(estimate["bytes_accessed"])
        operands = operand_names(definition)
        written = float(shape_bytes(definition["shape"]))
        if op == "dynamic-slice":
            return 2 * written
        if op == "dynamic-update-slice":
            return 2.0 * shape_bytes(self.shapes.get(operands[1], ""))
        called = _CALLS.search(line) if op == "fusion" else None
        reads = self.fused_reads(called["name"]) if called else {}
        if called and self.fused_update(called["name"]) is not None:
            written = self.fused_update(called["name"]) or 0.0
        read = sum(reads.get(i, float(shape_bytes(self.shapes.get(name, "")))) for i, name in enumerate(operands))
        return read + written

    @functools.cache  # noqa: B019  (one module, parsed once; the cache lives as long as it)
    def fused_reads(self, computation: str) -> dict[int, float]:
        """Of a fused computation's parameters, those it only slices (`dynamic-slice` of the
        parameter), by parameter index: the bytes of its slices; a parameter that is the buffer of
        a `dynamic-update-slice`: 0 (written in place, not read)."""
        definitions = self.definitions.get(computation, [])
        parameters = {d["name"]: int(m["index"]) for d in definitions if (m := _PARAMETER.search(d.group(0)))}
        uses: dict[str, list[tuple[str, int, str]]] = {name: [] for name in parameters}  # (op, position, shape)
        for d in definitions:
            for position, operand in enumerate(operand_names(d)):
                if operand in uses:
                    uses[operand].append((d["op"], position, d["shape"]))
        reads: dict[int, float] = {}
        for name, index in parameters.items():
            found = uses[name]
            if found and all(op == "dynamic-slice" and position == 0 for op, position, _ in found):
                reads[index] = float(sum(shape_bytes(shape) for _, _, shape in found))
            elif found and all(op == "dynamic-update-slice" and position == 0 for op, position, _ in found):
                reads[index] = 0.0
        return reads

    @functools.cache  # noqa: B019
    def fused_update(self, computation: str) -> float | None:
        """The bytes a fused computation whose root is a `dynamic-update-slice` writes (its update,
        read and written); None for any other root."""
        root = DEFINITION.match(self.roots.get(computation, ""))
        if root is None or root["op"] != "dynamic-update-slice":
            return None
        return 2.0 * shape_bytes(self.shapes.get(operand_names(root)[1], ""))

    def traffic(self) -> float:
        total = 0.0
        for computation, times in self.counts.items():
            if computation not in self.fusion_bodies:
                lines = self.bodies.get(computation, [])
                total += times * sum(
                    self.kernel_bytes(line, d) for line in lines if (d := DEFINITION.match(line)) is not None
                )
        return total

    @functools.cached_property
    def fusion_bodies(self) -> set[str]:
        """Computations that are fused into a kernel or applied by one (a reduction's `to_apply`):
        no kernels of their own."""
        names: set[str] = set()
        for lines in self.bodies.values():
            for line in lines:
                names.update(m["name"] for m in _CALLS.finditer(line) if " call(" not in line)
                names.update(re.findall(r"\bto_apply=%([\w.\-]+)", line))
        return names


def memory_traffic(hlo_text: str) -> float:
    """Bytes a compiled program's kernels read and write per call (see the module)."""
    return TrafficModule(hlo_text).traffic()
