"""Work a program's static shape overstates, marked where it is written so the planner counts
what runs.

A dropless MoE sizes its expert products for the worst case of the routing (every slot a device
sees routed to its own experts), then skips at run time the tiles no slot reached. The compiled
program's shapes and loop trip counts are that worst case; the work that runs depends on the
routing. The model marks such an op with a name scope, `expected_work(runs, of)`: of the `of`
executions (tiles) or rows its static shape stands for, `runs` run when the router spreads the
slots evenly over the experts (the balance DeepSeek-V3's bias update and balance loss steer to).
The scope survives into the compiled program's op names and the jaxpr's name stacks, where the
planner (`ferry.xla.hlo_flops`, `ferry.plan.replay`) counts that share of the op's matmul FLOPs
and keeps the static count as an upper bound.
"""

import contextlib
import re

import jax

_SCOPE = re.compile(r"ferry_runs_(?P<runs>\d+)_of_(?P<of>\d+)")


def expected_work(runs: int, of: int) -> contextlib.AbstractContextManager[None]:
    """A name scope saying that `runs` of the `of` units of work of the ops inside it run."""
    if not 0 <= runs <= of or of < 1:
        raise ValueError(f"expected_work(runs={runs}, of={of}): need 0 <= runs <= of and of >= 1")
    return jax.named_scope(f"ferry_runs_{runs}_of_{of}")


def expected_fraction(name: str) -> float:
    """The share of its static work that an op named `name` (an HLO op name or a jaxpr name
    stack) runs: the product of the scopes it is inside, 1 outside any."""
    fraction = 1.0
    for scope in _SCOPE.finditer(name):
        fraction *= int(scope["runs"]) / int(scope["of"])
    return fraction
