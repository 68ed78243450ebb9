"""The offload preset of a run whose command names none (no `offload=` override).

The old default, minimal_offloaded, is the preset the measurements show losing: on a TPU v5e
chip `minimal` is fastest, `full_remat` next, and minimal_offloaded far slower than full_remat
with a larger step (docs/results/tpu-v5e.md, "Every preset"). So a run that names no preset
trains with `mode=plan offload=auto`'s choice where a plan of this very step on this accelerator
exists under `run.root` (`ferry.plan.advice`), else with `minimal`, falling back to `full_remat`
when minimal's compiled step does not fit the device (the launcher compiles, and nothing is
written before the step's memory is checked). It says which and why in one start-up line. A
preset the user names is never replaced.
"""

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ferry.config.root import FerryConfig
from ferry.plan.advice import plan_advice

FASTEST = "minimal"  # fastest measured preset (TPU v5e: docs/results/tpu-v5e.md)
SMALLER = "full_remat"  # next fastest, and the smallest step of the measured presets
MEASURED = f"{FASTEST} is the fastest measured preset (TPU v5e), {SMALLER} where its compiled step does not fit"


def override_key(argument: str) -> str:
    """The config key an override sets (`offload`, `offload.tensors.x`), without Hydra's +, ++, ~."""
    return argument.split("=", 1)[0].lstrip("+~")


def names_preset(argv: Sequence[str]) -> bool:
    """The command chooses the offload preset itself (`offload=NAME`)."""
    return any(override_key(argument) == "offload" for argument in argv)


def sets_offload_keys(argv: Sequence[str]) -> bool:
    """The command changes the preset's keys (`offload.tensors.x=...`, `offload.optimizer=...`)."""
    return any(override_key(argument).startswith("offload.") for argument in argv)


@dataclasses.dataclass(frozen=True)
class DefaultChoice:
    """The preset chosen for a run that names none: a preset of configs/offload (`name`), or a
    plan's offload_auto.yaml (`plan_preset`), and why, in words for the start-up line."""

    name: str
    reason: str
    plan_preset: Path | None = None
    gist: str = "the fastest measured preset"  # the reason in a few words, for `brief`

    def line(self) -> str:
        return f"offload: {self.name} (default: {self.reason}; offload=NAME chooses another)"

    def brief(self) -> str:
        """`line` for a quiet terminal: the preset and the gist of why (the whole reason goes to
        the start-up report)."""
        return f"offload: {self.name} (default: {self.gist}; offload=NAME chooses another)"

    def may_fall_back(self) -> bool:
        """Minimal was chosen without knowing its compiled step fits: full_remat if it does not."""
        return self.plan_preset is None and self.name == FASTEST

    def fallback(self, why: str) -> "DefaultChoice":
        return DefaultChoice(
            SMALLER,
            f"{FASTEST}'s compiled step does not fit ({why}); {SMALLER} is the next fastest measured preset",
            gist=f"{FASTEST}'s compiled step does not fit ({why})",
        )

    def offload_node(self) -> dict[str, Any] | None:
        """The plan's preset as the config's `offload` node (None: a preset of configs/offload)."""
        if self.plan_preset is None:
            return None
        node = OmegaConf.to_container(OmegaConf.load(self.plan_preset))
        assert isinstance(node, dict)
        return {str(key): value for key, value in node.items()}


def choose_default(config: FerryConfig, accelerator: str | None, keys_set: bool = False) -> DefaultChoice:
    """The preset for a run of `config` that names none, on `accelerator` (a planner target name,
    None for a machine the planner does not know, such as a CPU). `keys_set`: the command changes
    offload.* keys, which apply to a preset of configs/offload, not to a plan's choice."""
    root = Path(config.run.root)
    advice = plan_advice(root, config, accelerator)
    if advice is not None and advice.auto_preset is not None and not keys_set:
        name = f"auto ({advice.auto_preset})"
        planned = f"mode=plan offload=auto's choice for this step on {accelerator}"
        return DefaultChoice(name, planned, advice.auto_preset, gist=planned)
    if advice is not None and advice.auto_preset is not None:
        why = f"the plan {advice.auto_preset} is not used because the command sets offload.* keys"
    elif advice is not None:
        why = f"the plan {advice.path} has no offload=auto choice that fits"
    elif accelerator is None:
        why = "no plan for this machine (not a mode=plan target)"
    else:
        why = f"no plan of this step for {accelerator} under run.root={root}"
    return DefaultChoice(FASTEST, f"{why}; {MEASURED}")
