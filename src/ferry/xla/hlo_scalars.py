"""A small interpreter of a loop body's integer scalars: the index expressions of its dynamic
slices evaluated for given values of the loop's counter (`ferry.xla.hlo_slice_walks`)."""

import re
from collections.abc import Callable

from ferry.xla.hlo_parse import CALLEE, DEFINITION, HloModule, operand_names

_INDEX = re.compile(r"\bindex=(?P<k>\d+)")
_DIRECTION = re.compile(r"\bdirection=(?P<d>[A-Z]+)")


class ScalarEvaluator:
    """Evaluates integer scalars of a loop body for a given value of its induction variable: the
    index expressions of dynamic slices (`i`, `n - 1 - i`, through fusions). None where a value
    is not an affine-enough scalar this evaluator knows (a loop-carried value, a load...)."""

    _BINARY: dict[str, Callable[[int, int], int]] = {
        "add": lambda a, b: a + b,
        "subtract": lambda a, b: a - b,
        "multiply": lambda a, b: a * b,
        "maximum": max,
        "minimum": min,
    }
    _COMPARE: dict[str, Callable[[int, int], bool]] = {
        "LT": lambda a, b: a < b,
        "LE": lambda a, b: a <= b,
        "GT": lambda a, b: a > b,
        "GE": lambda a, b: a >= b,
        "EQ": lambda a, b: a == b,
        "NE": lambda a, b: a != b,
    }

    def __init__(self, module: HloModule):
        self.lines: dict[str, dict[str, re.Match]] = {}
        self.param_names: dict[str, dict[int, str]] = {}
        self.roots: dict[str, str] = {}
        for computation, lines in module.bodies.items():
            table, params = {}, {}
            for line in lines:
                definition = DEFINITION.match(line)
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
        op, operands, line = definition["op"], operand_names(definition), definition.string
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
            return None if low is None or x is None or high is None else min(max(x, low), high)
        if op == "fusion":
            callee = CALLEE.search(line)
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
