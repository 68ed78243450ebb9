"""`mode=plan`: compile the step for a target once per offload preset and report them side by
side, as a table and as `plan.json`."""

import json
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ferry.config import ConfigError
from ferry.models.registry import abstract_model
from ferry.plan.planner import MemoryPlan, plan_memory
from ferry.plan.targets import GPU_TARGETS
from ferry.schedule import format_bytes
from ferry.train.config import FerryConfig, OffloadConfig
from ferry.train.run import check_mesh_shape


def plan_presets(config: FerryConfig) -> tuple[str, ...]:
    if config.plan.presets is not None:
        return config.plan.presets
    return tuple(dict.fromkeys(("save_all", "full_remat", config.offload.name)))


def run_plan(config: FerryConfig, load_preset: Callable[[str], OffloadConfig], console: Console) -> list[MemoryPlan]:
    """One memory plan per preset; every check first (target, mesh, presets), then the compiles."""
    if config.target not in GPU_TARGETS:
        raise ConfigError(f"target is {config.target!r}; the planner knows {', '.join(GPU_TARGETS)}")
    target = GPU_TARGETS[config.target]
    target.topology(config.mesh.num_devices)  # whole hosts
    check_mesh_shape(config)
    tagged = abstract_model(config.model).tagged_names()
    policies = {}
    for name in plan_presets(config):
        preset = config.offload if name == config.offload.name else load_preset(name)
        policies[name] = preset.policy(tagged)
        policies[name].validate(tagged)
    capacity = None if config.plan.capacity_gib is None else int(config.plan.capacity_gib * 2**30)
    plans = []
    for name, policy in policies.items():
        console.print(f"compiling the train step for {config.mesh.num_devices} x {target.description}: {name}")
        plans.append(plan_memory(config, target, policy, name, capacity))
    console.print(plan_table(plans, config))
    return plans


def plan_table(plans: list[MemoryPlan], config: FerryConfig) -> Table:
    first = plans[0]
    table = Table(
        title=f"{config.model_name} on {first.target} x {config.mesh.num_devices} ({first.mesh}), "
        f"batch {config.train.global_batch_size} x {config.train.seq_len}: per device",
        caption="compile options: " + ", ".join(f"{k}={v}" for k, v in first.compile_options),
    )
    for column in (
        "preset",
        "arguments",
        "outputs",
        "temp",
        "HBM total",
        "capacity",
        "verdict",
        "pinned host",
        "matmul TFLOP",
    ):
        table.add_column(column, justify="left" if column in ("preset", "verdict") else "right")
    for plan in plans:
        table.add_row(
            plan.policy,
            format_bytes(plan.argument_bytes),
            format_bytes(plan.output_bytes - plan.alias_bytes),
            format_bytes(plan.temp_bytes),
            format_bytes(plan.device_bytes),
            format_bytes(plan.capacity_bytes),
            "FITS" if plan.fits else "OOM",
            format_bytes(plan.host_bytes),
            f"{plan.flops / 1e12:.4f}",
        )
    return table


def write_plan(plans: list[MemoryPlan], run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "plan.json"
    path.write_text(json.dumps([plan.to_json() for plan in plans], indent=2))
    return path
