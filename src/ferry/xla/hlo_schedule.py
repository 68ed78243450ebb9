"""The instructions XLA's latency-hiding scheduler orders, for the cost profile ferry gives it
(`ferry.xla.scheduler_costs`). Read from the module as the scheduler receives it (XLA's dump
before `latency-hiding-scheduler`), whose text differs from a final program's in two ways: a
tuple's element is an operand written `%name#index` (no get-tuple-element), and every
asynchronous op is a generic `async-start` / `async-done` calling the computation it wraps."""

import dataclasses

from ferry.xla.hlo_flops import parsed
from ferry.xla.hlo_parse import BRANCHES, CALLEE, DEFINITION, operand_names, trip_count

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
        definition = DEFINITION.match(self.wrapped)
        return definition["op"] if definition else ""


def scheduled_instructions(hlo_text: str) -> dict[str, list[ScheduledInstruction]]:
    """Every instruction of every computation the scheduler orders, by computation, in the
    module's order; each loop, branch and call is one instruction of the computation holding it."""
    module = parsed(hlo_text)
    out: dict[str, list[ScheduledInstruction]] = {}
    pending, seen = [module.entry], set()
    while pending:
        computation = pending.pop()
        if computation in seen or computation not in module.bodies:
            continue
        seen.add(computation)
        instructions = out.setdefault(computation, [])
        for line in module.bodies[computation]:
            definition = DEFINITION.match(line)
            if definition is None:
                continue
            op = definition["op"]
            callees = tuple(c["name"] for c in CALLEE.finditer(line))
            branches = BRANCHES.search(line)
            callees += tuple(b.strip().lstrip("%") for b in branches["names"].split(",")) if branches else ()
            if op in ("while", "conditional", "call"):
                pending.extend(callees)
            control = op in ("while", "conditional", "call")
            wrapped = module.roots.get(callees[0], "") if op in ("fusion", "async-start") and callees else ""
            while " fusion(" in wrapped and (inner := CALLEE.search(wrapped)):  # an async op wrapping a fusion
                wrapped = module.roots.get(inner["name"], "")
            instructions.append(
                ScheduledInstruction(
                    computation,
                    definition["name"],
                    op,
                    definition["shape"],
                    tuple(module.shapes.get(name, "") for name in operand_names(definition)),
                    0.0 if control else module.line_flops(line),
                    callees,
                    trip_count(line, module.bodies) if op == "while" else 1,
                    module.loop_share(line) if op == "while" else 1.0,
                    wrapped,
                    operand_names(definition)[0] if op.endswith("-done") and operand_names(definition) else "",
                )
            )
    return out
