"""Offload presets side by side on llama_tiny: compiled FLOPs, step time and tokens/s of the real
train step, each as a ratio to save_all, measured in one run.

    python benchmarks/offload_cpu.py [--steps 30] [--batch 8] [--seq-len 128] [--dtype bfloat16]

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

from ferry.config import from_dict
from ferry.models.registry import build_model, model_config
from ferry.sharding import batch_sharded, make_mesh, replicated
from ferry.train.config import OffloadConfig, TrainConfig
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.step import LossSettings, init_state, make_train_step

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def load(group: str, name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONFIGS / group / f"{name}.yaml"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()

    presets = ["save_all"] + sorted(p.stem for p in (CONFIGS / "offload").glob("*.yaml") if p.stem != "save_all")
    config = model_config(load("model", args.model))
    train_config = TrainConfig(steps=args.steps + 1, warmup_steps=0, global_batch_size=args.batch, seq_len=args.seq_len)
    optimizer = make_optimizer(train_config)
    mesh = make_mesh(1)
    batch = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq_len + 1), dtype=np.int32)

    with jax.set_mesh(mesh):
        states, steps, flops = {}, {}, {}
        for name in presets:
            policy = from_dict(OffloadConfig, load("offload", name)).policy()
            step = make_train_step(optimizer, LossSettings(policy, args.dtype), learning_rate_schedule(train_config))
            state = jax.device_put(init_state(build_model(config, jax.random.key(0)), optimizer), replicated(mesh))
            device_batch = jax.device_put(batch, batch_sharded(mesh))
            flops[name] = step.lower(state, device_batch).compile().cost_analysis()["flops"]
            state, metrics = step(state, device_batch)  # compile and warm up
            jax.block_until_ready(metrics)
            states[name], steps[name] = state, step

        times: dict[str, list[float]] = {name: [] for name in presets}
        for _ in range(args.steps):
            for name in presets:
                device_batch = jax.device_put(batch, batch_sharded(mesh))
                start = time.perf_counter()
                states[name], metrics = steps[name](states[name], device_batch)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - start)

    tokens = args.batch * args.seq_len
    table = Table(title=f"{args.model}, batch {args.batch} x seq {args.seq_len}, {args.dtype}, median of {args.steps} steps")
    for column in ("preset", "GFLOPs/step", "FLOPs vs save_all", "step ms", "tokens/s", "tokens/s vs save_all"):
        table.add_column(column, justify="left" if column == "preset" else "right")
    base_time = statistics.median(times["save_all"])
    for name in presets:
        step_time = statistics.median(times[name])
        table.add_row(
            name, f"{flops[name] / 1e9:.4f}", f"{flops[name] / flops['save_all']:.3f}x",
            f"{step_time * 1e3:.2f}", f"{tokens / step_time:,.0f}", f"{base_time / step_time:.3f}x",
        )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
