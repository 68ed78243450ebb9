"""Parsing a compiled program's HLO text: its computations, the shapes of its values, how often
each computation runs, and the regexes every reader of the text shares.

A collective inside a `while` body (the layer scan) runs once per iteration, so every count is
weighted by how often its computation runs: the product of the trip counts XLA records
(`known_trip_count`) on the loops around it.
"""

import functools
import json
import re
from collections import Counter

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
DTYPE_BYTES |= {"f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s")
ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*[a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
CALLEE = re.compile(r"\b(?P<kind>body|condition|calls|to_apply|true_computation|false_computation)=%(?P<name>[\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%(?P<name>[\w.\-]+)")
_CONSTANT = re.compile(r"s32\[\]\S*\s+constant\((?P<n>\d+)\)")
DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[a-z\-]+)\((?P<args>[^)]*)\)"
)
COMMENT = re.compile(r"/\*.*?\*/")
OP_NAME = re.compile(r'\bop_name="(?P<name>[^"]*)"')
_BACKEND_CONFIG = "backend_config="
_LAYOUT = re.compile(r"\]\{(?P<minor_to_major>[0-9,]*)")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as `f32[8,64]{1,0}` or a tuple `(f32[8], bf16[2,2])`."""
    total = 0
    for match in ARRAY.finditer(shape):
        dims = [int(d) for d in match["dims"].split(",") if d]
        total += DTYPE_BYTES.get(match["dtype"], 0) * int(np.prod(dims, dtype=np.int64))
    return total


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
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
        return {name: sorted(lines) for name, lines in computations(text)[0].items()}

    return instructions(a) == instructions(b)


def execution_counts(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry computation."""
    return counts_from(*computations(hlo_text))


def trip_count(line: str, bodies: dict[str, list[str]]) -> int:
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


def counts_from(bodies: dict[str, list[str]], entry: str) -> dict[str, int]:
    counts: Counter = Counter()

    def visit(name: str, times: int) -> None:
        counts[name] += times
        for line in bodies.get(name, []):
            for callee in CALLEE.finditer(line):
                repeat = trip_count(line, bodies) if callee["kind"] == "body" else 1
                visit(callee["name"], times * repeat)
            branches = BRANCHES.search(line)
            for branch in branches["names"].split(",") if branches else []:
                visit(branch.strip().lstrip("%"), times)

    visit(entry, 1)
    return dict(counts)


def array_dims(shape: str) -> list[int]:
    """The dimensions of the first array in an HLO shape ([] where it has none)."""
    match = ARRAY.search(shape)
    return [int(d) for d in match["dims"].split(",") if d] if match else []


def is_float(shape: str) -> bool:
    match = ARRAY.search(shape)
    return match is not None and match["dtype"][0] in "fb"  # f32, bf16, f8e4m3fn...


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (`(f32[2], (s32[], bf16[4]))` -> `f32[2]`,
    `(s32[], bf16[4])`); an array shape is its own only element."""
    shape = COMMENT.sub("", shape).strip()
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


def operand_names(definition: re.Match) -> list[str]:
    """The operand names of a parsed instruction (`DEFINITION`'s match)."""
    return [a.strip().lstrip("%") for a in COMMENT.sub("", definition["args"]).split(",") if a.strip()]


def backend_config(line: str) -> dict:
    """An instruction's `backend_config` JSON ({} when it has none)."""

    at = line.find(_BACKEND_CONFIG)
    if at < 0 or line[at + len(_BACKEND_CONFIG)] != "{":
        return {}
    try:
        config, _ = json.JSONDecoder().raw_decode(line[at + len(_BACKEND_CONFIG) :])
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def byte_strides(shape: str) -> list[int]:
    """Bytes between consecutive indices of each dimension of an array shape in its layout
    (`bf16[2,8,64]{2,1,0}`: row-major; no layout: row-major)."""
    match = ARRAY.search(shape)
    dims = array_dims(shape)
    layout = _LAYOUT.search(shape)
    minor_to_major = [int(d) for d in layout["minor_to_major"].split(",") if d] if layout else []
    if sorted(minor_to_major) != list(range(len(dims))):
        minor_to_major = list(range(len(dims)))[::-1]
    strides, step = [0] * len(dims), DTYPE_BYTES.get(match["dtype"], 0) if match else 0
    for d in minor_to_major:
        strides[d] = step
        step *= dims[d]
    return strides


class HloModule:
    """A compiled module's computations, parsed once: instruction lines in schedule order (a
    scheduled module prints each computation in the order it runs) and every value's shape."""

    def __init__(self, hlo_text: str):
        self.bodies, self.entry = computations(hlo_text)
        self.shapes: dict[str, str] = {}
        for lines in self.bodies.values():
            for line in lines:
                definition = DEFINITION.match(line)
                if definition:
                    self.shapes[definition["name"]] = definition["shape"]
        for name, shape in list(self.shapes.items()):  # `%name#index`, as a module before scheduling writes it
            if shape.startswith("("):
                self.shapes |= {f"{name}#{i}": element for i, element in enumerate(tuple_elements(shape))}

    @functools.cached_property
    def counts(self) -> dict[str, int]:
        """How many times each computation runs per call of the entry computation (`counts_from`),
        which the FLOP count, the host copies and the collectives each asked for."""
        return counts_from(self.bodies, self.entry)

    @functools.cached_property
    def op_names(self) -> dict[str, str]:
        """Every instruction's `op_name` metadata (the JAX name stack it was traced under), by
        instruction name (names are unique in a module)."""
        names: dict[str, str] = {}
        for lines in self.bodies.values():
            for line in lines:
                definition, op_name = DEFINITION.match(line), OP_NAME.search(line)
                if definition and op_name:
                    names[definition["name"]] = op_name["name"]
        return names

    @functools.cached_property
    def roots(self) -> dict[str, str]:
        """Each computation's ROOT line ("" where it has none)."""
        return {name: next((line for line in lines if "ROOT " in line), "") for name, lines in self.bodies.items()}
