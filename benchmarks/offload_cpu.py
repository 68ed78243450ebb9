"""Offload presets side by side on a tiny model (llama_tiny by default): compiled FLOPs, step
time and tokens/s of the real train step, each as a ratio to save_all, measured in one run.

    python benchmarks/offload_cpu.py [--model llama_tiny] [--steps 30] [--batch 8] [--seq-len 128] [--dtype bfloat16]

On the CPU backend pinned host placement is an identity, so the ratios show the cost of recompute
(and of the engine), not of transfers. Steps are timed round-robin across presets so machine noise
hits every preset alike; the median is reported.
"""

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from ferry.config.overrides import group_presets, hydra_compose, preset_node
from ferry.config.root import load_config
from ferry.config.train import OffloadConfig
from ferry.config_schema import from_dict
from ferry.models.registry import abstract_model, model_config
from ferry.sharding import batch_sharded, make_mesh
from ferry.train.recipe import StepRecipe
from ferry.train.state_layout import initial_state

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def load(group: str, name: str) -> dict:
    return preset_node(CONFIGS, group, name)


def compare_presets(model: str, presets: list[str], steps: int, batch_size: int, seq_len: int, dtype: str) -> Table:
    """Time the real train step of `model` under each preset, round-robin; a table of ratios."""
    overrides = [f"model={model}", f"train.steps={steps + 1}", "train.warmup_steps=0"]
    overrides += [f"train.global_batch_size={batch_size}", f"train.seq_len={seq_len}", f"train.compute_dtype={dtype}"]
    mesh = make_mesh()
    batch = np.random.default_rng(0).integers(0, 256, (batch_size, seq_len + 1), dtype=np.int32)

    with jax.set_mesh(mesh):
        states, step_fns, flops = {}, {}, {}
        for name in presets:
            node = OmegaConf.to_container(
                hydra_compose(CONFIGS, "train", [*overrides, f"offload={name}"]), resolve=True
            )
            config = load_config(node)
            recipe = StepRecipe.of(config, mesh)  # the step a run of this preset trains
            state = initial_state(config, recipe.optimizer, mesh, recipe.layout)[0]
            device_batch = jax.device_put(batch, batch_sharded(mesh))
            compiled = recipe.compile()
            flops[name] = compiled.compiled.cost_analysis()["flops"]
            step = compiled.run
            state, metrics = step(state, device_batch)  # compile and warm up
            jax.block_until_ready(metrics)
            states[name], step_fns[name] = state, step

        times: dict[str, list[float]] = {name: [] for name in presets}
        for _ in range(steps):
            for name in presets:
                device_batch = jax.device_put(batch, batch_sharded(mesh))
                start = time.perf_counter()
                states[name], metrics = step_fns[name](states[name], device_batch)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - start)

    tokens = batch_size * seq_len
    table = Table(title=f"{model}, batch {batch_size} x seq {seq_len}, {dtype}, median of {steps} steps")
    for column in ("preset", "GFLOPs/step", "FLOPs vs save_all", "step ms", "tokens/s", "tokens/s vs save_all"):
        table.add_column(column, justify="left" if column == "preset" else "right")
    base_time = statistics.median(times["save_all"])
    for name in presets:
        step_time = statistics.median(times[name])
        table.add_row(
            name,
            f"{flops[name] / 1e9:.4f}",
            f"{flops[name] / flops['save_all']:.3f}x",
            f"{step_time * 1e3:.2f}",
            f"{tokens / step_time:,.0f}",
            f"{base_time / step_time:.3f}x",
        )
    return table


def preset_names(model: str) -> list[str]:
    """save_all first, then every preset whose tensor names this model tags (not `auto`: the
    planner's choice, which a run refuses to train as a preset)."""
    tagged = abstract_model(model_config(load("model", model))).tagged_names()
    names = []
    for name in group_presets(CONFIGS / "offload"):
        preset = from_dict(OffloadConfig, load("offload", name))
        if set(preset.tensors) <= tagged and name not in ("save_all", "auto"):
            names.append(name)
    return ["save_all", *names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    table = compare_presets(args.model, preset_names(args.model), args.steps, args.batch, args.seq_len, args.dtype)
    Console(width=120).print(table)


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    main()
