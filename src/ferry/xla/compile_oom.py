"""XLA refusing to compile a program that does not fit HBM, read into numbers.

libtpu checks a program's memory while compiling it and refuses one over HBM with a
`JaxRuntimeError` (RESOURCE_EXHAUSTED) whose text says what the program needs and what the device
gives it, rounded to 0.01 of the unit. Two wordings are known:
- libtpu 0.0.50 (deviceless) and the v5e chip under jax 0.10.2: "E1000: CompileTimeHbmOom: Ran out
  of memory on HBM, the total memory required for HLO temporaries (16.22G) exceeds available HBM
  (15.75G)";
- older libtpu: "XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used
  21.95G of 15.48G hbm. Exceeded hbm capacity by 6.47G" (the program's bytes, arguments apart).
A run refuses such a step in one line (`ferry.run.out_of_memory`) and `mode=plan` reports it as
the preset's OOM row (`ferry.plan.planner`), instead of a traceback. Other memories (a kernel's
VMEM) are not the step's size and are left to propagate.
"""

import dataclasses
import math
import re
from typing import Any

import jax

from ferry.errors import FerryError

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_SIZE = r"\d+(?:\.\d+)?[KMGTP]?i?B?"
_FORMS = (
    re.compile(
        rf"required for (?P<what>[\w ,]+?) \((?P<needed>{_SIZE})\) exceeds available HBM \((?P<available>{_SIZE})\)"
    ),
    re.compile(rf"Ran out of memory in memory space hbm\. Used (?P<needed>{_SIZE}) of (?P<available>{_SIZE}) hbm"),
)


def parse_size(text: str) -> int:
    """XLA's human-readable size ("16.22G", "530.00M", "0B") in bytes; its units are powers of 1024."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTP]?)i?B?", text.strip())
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    return round(float(match.group(1)) * _UNITS[match.group(2)])


@dataclasses.dataclass(frozen=True)
class CompileTimeOom:
    """What XLA said when it refused to compile a program over HBM (per device)."""

    needed_bytes: int  # what the program needs beyond its arguments (XLA rounds to 0.01 of a unit)
    available_bytes: int  # what the device gives one program
    what: str  # what XLA counted: "HLO temporaries", or "the program" (temporaries and scratch)

    @classmethod
    def of(cls, error: BaseException) -> "CompileTimeOom | None":
        """The numbers of a compile-time HBM refusal, or None for any other error."""
        text = str(error)
        if "RESOURCE_EXHAUSTED" not in text:
            return None
        for form in _FORMS:
            match = form.search(text)
            if match is not None:
                what = match.groupdict().get("what") or "the program"
                return cls(parse_size(match["needed"]), parse_size(match["available"]), what.strip())
        return None

    def describe(self) -> str:
        return (
            f"its {self.what} need {gib(self.needed_bytes)} per device, more than the {gib(self.available_bytes)} of "
            "HBM the compiler gives a program"
        )


class StepOverHbm(FerryError, RuntimeError):
    """XLA refused to compile a train step over HBM: what it said, and the per-device bytes of the
    step's arguments (the train state and the batch), which it counts apart."""

    def __init__(self, oom: CompileTimeOom, argument_bytes: int, host_argument_bytes: int, seconds: float, where: str):
        self.oom, self.argument_bytes, self.host_argument_bytes = oom, argument_bytes, host_argument_bytes
        self.seconds = seconds
        super().__init__(
            f"the train step does not fit {where}: XLA refused to compile it, {oom.describe()} (its arguments, "
            f"{gib(argument_bytes)}, come on top)"
        )


def argument_bytes(arguments: Any) -> tuple[int, int]:
    """Bytes one device holds of `arguments` (ShapeDtypeStructs with shardings), in HBM and in
    pinned host memory."""
    device = host = 0
    for leaf in jax.tree.leaves(arguments):
        sharding = leaf.sharding
        size = math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        if getattr(sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
            host += size
        else:
            device += size
    return device, host


def gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
