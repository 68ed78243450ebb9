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
from rich.console import Console
from rich.table import Table

from ferry.config.overrides import group_presets, preset_node
from ferry.config.train import OffloadConfig, TrainConfig
from ferry.config_schema import from_dict
from ferry.models.registry import abstract_model, build_model, model_config
from ferry.sharding import batch_sharded, make_mesh, replicated
from ferry.train.compiled_step import batch_spec_of, compile_from_layout, layout_of
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.step import LossSettings, train_step_body
from ferry.train.train_state import init_state

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def load(group: str, name: str) -> dict:
    return preset_node(CONFIGS, group, name)


def compare_presets(model: str, presets: list[str], steps: int, batch_size: int, seq_len: int, dtype: str) -> Table:
    """Time the real train step of `model` under each preset, round-robin; a table of ratios."""
    config = model_config(load("model", model))
    abstract = abstract_model(config)
    train_config = TrainConfig(steps=steps + 1, warmup_steps=0, global_batch_size=batch_size, seq_len=seq_len)
    optimizer = make_optimizer(train_config)
    mesh = make_mesh()
    batch = np.random.default_rng(0).integers(0, config.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)

    with jax.set_mesh(mesh):
        states, step_fns, flops = {}, {}, {}
        for name in presets:
            policy = from_dict(OffloadConfig, load("offload", name)).policy(abstract.tagged_names())
            body = train_step_body(optimizer, LossSettings(policy, dtype), learning_rate_schedule(train_config))
            state = jax.device_put(init_state(build_model(config, jax.random.key(0)), optimizer), replicated(mesh))
            device_batch = jax.device_put(batch, batch_sharded(mesh))
            compiled = compile_from_layout(body, layout_of(state), batch_spec_of(device_batch))
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
    """save_all first, then every preset whose tensor names this model tags."""
    tagged = abstract_model(model_config(load("model", model))).tagged_names()
    names = []
    for name in group_presets(CONFIGS / "offload"):
        preset = from_dict(OffloadConfig, load("offload", name))
        if set(preset.tensors) <= tagged and name != "save_all":
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
