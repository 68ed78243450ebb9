"""How each pinned-host buffer in a loop is walked, for the plan's verifier (`ferry.plan.verify`):
the index its slices take at the loop's first two iterations against XLA's address descriptor."""

import dataclasses
import re
from typing import Any

from ferry.xla.hlo_flops import FlopModule, parsed
from ferry.xla.hlo_host_copies import HOST_MEMORY_SPACE
from ferry.xla.hlo_parse import (
    CALLEE,
    DEFINITION,
    backend_config,
    byte_strides,
    operand_names,
    shape_bytes,
    trip_count,
)
from ferry.xla.hlo_scalars import ScalarEvaluator

_WHILE = re.compile(r"\bwhile\((?P<init>[^)]*)\).*?\bbody=%(?P<body>[\w.\-]+)")
_SCALAR = re.compile(r"^[su](8|16|32|64)\[\]")


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


def host_slice_walks(hlo_text: str) -> list[HostSliceWalk]:
    """Every dynamic slice of a pinned-host (`S(5)`) buffer inside a loop body, with the index
    its walked dimension takes at the loop's first two iterations (evaluated from the index
    expression and the loop's counter: its initial value in the `while`'s operand, its step in
    the body's result) and XLA's address descriptor where it has one (GPU)."""
    module = parsed(hlo_text)
    evaluator = ScalarEvaluator(module)
    names = module.op_names
    walks = []
    for caller, lines in module.bodies.items():
        for line in lines:
            loop = _WHILE.search(line)
            if loop is None or DEFINITION.match(line) is None:
                continue
            body = loop["body"]
            for site in module.bodies.get(body, []):
                walk = _walk(module, evaluator, caller, line, body, site, names)
                if walk is not None:
                    walks.append(walk)
    return walks


def _slice_root(module: FlopModule, evaluator: ScalarEvaluator, site: re.Match) -> tuple[str, re.Match] | None:
    """The dynamic slice an instruction runs: itself, or the root of the computation it calls."""
    if site["op"] in ("dynamic-slice", "dynamic-update-slice"):
        return "", site
    callee = CALLEE.search(site.string)
    if site["op"] not in ("fusion", "fusion-start", "async-start") or callee is None:
        return None
    root = evaluator.lines.get(callee["name"], {}).get(evaluator.roots.get(callee["name"], ""))
    if root is None or root["op"] not in ("dynamic-slice", "dynamic-update-slice"):
        return None
    return callee["name"], root


def _walk(
    module: FlopModule,
    evaluator: ScalarEvaluator,
    caller: str,
    while_line: str,
    body: str,
    line: str,
    names: dict[str, str],
) -> HostSliceWalk | None:
    site = DEFINITION.match(line)
    if site is None:
        return None
    found = _slice_root(module, evaluator, site)
    if found is None:
        return None
    callee, root = found
    root_operands = operand_names(root)
    is_write = root["op"] == "dynamic-update-slice"
    buffer_shape = root["shape"] if is_write else _shape_in(evaluator, callee or body, root_operands[0])
    if HOST_MEMORY_SPACE not in buffer_shape:
        return None
    config = backend_config(root.string).get("dynamic_slice_config") or backend_config(line).get("dynamic_slice_config")
    descriptor = (config.get("linear") or config) if config else None
    first_index = 2 if is_write else 1
    site_operands = operand_names(site)

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
    known_first, known_second = [i for i in first if i is not None], [i for i in second if i is not None]
    if len(known_first) == len(first) and len(known_second) == len(second) and len(first) == len(strides):
        expected_offset = sum(i * s for i, s in zip(known_first, strides, strict=True))
        expected_stride = sum((b - a) * s for a, b, s in zip(known_first, known_second, strides, strict=True))
    walked = next((d for d in range(len(first)) if first[d] != second[d]), 0)
    sliced = root["shape"] if not is_write else _shape_in(evaluator, callee or body, root_operands[1])
    return HostSliceWalk(
        computation=body,
        instruction=site["name"],
        kind="host write" if is_write else "host read",
        buffer_shape=buffer_shape.split("{")[0],
        slice_bytes=shape_bytes(sliced),
        op_name=names.get(site["name"], names.get(root["name"], "")),
        trip_count=trip_count(while_line, module.bodies),
        index_start=first[walked] if first else None,
        index_next=second[walked] if second else None,
        expected_offset=expected_offset,
        expected_stride=expected_stride,
        descriptor_offset=_int(descriptor.get("byte_offset")) if descriptor else None,
        descriptor_stride=_int(descriptor.get("byte_stride")) if descriptor else None,
    )


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _shape_in(evaluator: ScalarEvaluator, computation: str, name: str) -> str:
    definition = evaluator.lines.get(computation, {}).get(name)
    return definition["shape"] if definition else ""


def _loop_states(
    evaluator: ScalarEvaluator, caller: str, while_line: str, body: str
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
    results = operand_names(root)
    scalars = [k for k, name in enumerate(results) if _SCALAR.match(_shape_in(evaluator, body, name))]
    elements = operand_names(init)
    first = {k: evaluator.value(caller, elements[k], {}) for k in scalars if k < len(elements)}
    second = {k: evaluator.value(body, results[k], {0: {"tuple": first}}) for k in scalars}
    return first, second
