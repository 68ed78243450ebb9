"""`PlanConfig`: the `plan` group, read by `mode=plan` (`ferry.plan.report`)."""

import dataclasses
import math

from ferry.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """`mode=plan`: the target to compile for, and the presets to compare (default: save_all,
    full_remat and the run's own `offload`). `capacity_gib` overrides the target's HBM.
    `extrapolate` plans a deep model from shallow compiles (`ferry.plan.extrapolate`) instead of
    compiling it whole: off by default, since a whole scanned stack compiles as fast as one probe
    and the probes' line under-estimated DeepSeek-V3's temporaries (docs/results/reference-plans.md,
    "How fast it plans")."""

    presets: tuple[str, ...] | None = None  # offload presets to compare; null: save_all, full_remat and `offload`
    capacity_gib: float | None = None  # HBM per device (GiB) to plan for; null: the target's
    extrapolate: bool = False  # plan from shallow compiles extended to the full depth (ferry.plan.extrapolate)

    def __post_init__(self) -> None:
        if self.presets is not None:
            object.__setattr__(self, "presets", tuple(str(p) for p in self.presets))
            if not self.presets:
                raise ConfigError(
                    "plan.presets=[] names no preset to plan; list one or more (plan.presets=[save_all,full_remat]) "
                    "or drop the key for save_all, full_remat and offload="
                )
        if self.capacity_gib is not None and not (math.isfinite(self.capacity_gib) and self.capacity_gib > 0):
            raise ConfigError(f"plan.capacity_gib must be positive, got {self.capacity_gib}")
