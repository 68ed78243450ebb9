"""What a plan tells a run that does not fit: the presets `mode=plan` found to fit the same step
on the same accelerator, fastest first by its estimate, and `offload=auto`'s choice.

`plan.json` records the step it planned (`step_identity`: the model, the batch, the sequence, the
mesh, the train state's placement); a run over HBM looks for the newest plan of its own step under
`run.root` (where `mode=plan` writes by default) and names what fitted there."""

import dataclasses
import json
from pathlib import Path
from typing import Any, cast

from ferry.config.root import FerryConfig
from ferry.offload.schedule import format_bytes


def step_identity(config: FerryConfig) -> dict[str, Any]:
    """Everything that shapes a step's memory apart from the offload policy, as JSON values."""
    model = json.loads(json.dumps(dataclasses.asdict(cast(Any, config.model)), default=str))
    train = config.train
    return {
        "model_name": config.model_name,
        "model": model,
        "global_batch_size": train.global_batch_size,
        "micro_batch_size": train.micro_batch_size,
        "seq_len": train.seq_len,
        "compute_dtype": str(train.compute_dtype),
        "mesh": config.mesh.describe(),
        "optimizer": config.offload.optimizer,
        "params": config.offload.params,
    }


@dataclasses.dataclass(frozen=True)
class PlanAdvice:
    """What one plan of a step found: the presets that fit (name and HBM per device, fastest
    first) and whether offload=auto's choice fits (its preset file)."""

    path: Path
    target: str
    fitting: tuple[tuple[str, int], ...]
    auto_preset: Path | None  # offload_auto.yaml, where offload=auto was planned and its choice fits
    auto_moves_optimizer: bool  # that choice puts AdamW's moments in pinned host memory

    def describe(self) -> str:
        found = f"mode=plan found for this step on {self.target} ({self.path})"
        if not self.fitting:
            return f"{found}: none of the presets it compiled fits"
        presets = ", ".join(f"offload={name} ({format_bytes(size)})" for name, size in self.fitting)
        text = f"{found}: {presets} fit, fastest first by its estimate"
        if self.auto_preset is not None:
            moved = ", with offload.optimizer=host," if self.auto_moves_optimizer else ""
            text += f"; offload=auto's choice{moved} is {self.auto_preset} (copy it into configs/offload/)"
        return text


def plan_advice(root: Path, config: FerryConfig, accelerator: str | None) -> PlanAdvice | None:
    """The newest plan under `root` of `config`'s step for `accelerator` (a target name), or None."""
    if accelerator is None or not root.is_dir():
        return None
    identity = step_identity(config)
    paths = sorted(root.glob("*/plan.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in paths:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a plan being written, or not ferry's: not advice
        plans = record.get("plans") or []
        if record.get("step") != identity or not plans or plans[0].get("target") != accelerator:
            continue
        return _advice(path, accelerator, plans, record.get("auto") or [])
    return None


def _advice(path: Path, target: str, plans: list[dict], choices: list[dict]) -> PlanAdvice:
    def rank(plan: dict) -> tuple[float, float]:
        estimate = plan["estimate"]
        return estimate["middle_seconds"], estimate["worst_seconds"]

    fitting = sorted((p for p in plans if p.get("fits") and p["policy"] != "auto"), key=rank)
    auto = next((p for p in plans if p["policy"] == "auto" and p.get("fits")), None)
    preset = path.parent / "offload_auto.yaml"
    moves = any(c.get("name") == "offload.optimizer" and c.get("placement") == "host" for c in choices)
    return PlanAdvice(
        path,
        target,
        tuple((p["policy"], int(p["device_bytes"])) for p in fitting),
        preset if auto is not None and preset.exists() else None,
        auto is not None and moves,
    )
