"""Mesh layouts side by side on 8 virtual CPU devices: compiled collective bytes per device, FLOPs
per device and step time of the real train step, for the tiny models, measured in one run.

    python benchmarks/scaling_cpu.py [--model llama_tiny] [--steps 10] [--batch 16] [--seq-len 128]

Each layout goes through the same `prepare` and train-state code as `launch/run.py`; collective
bytes are read from the compiled HLO, weighted by the layer loop's trip count; steps are timed
round-robin across layouts and the median is reported. The 8 devices share
this machine's cores, so step times compare layouts' overheads, not scaling: ratios are against
pure data parallelism (data=8), which moves only the gradients.
"""

import argparse
import os
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from ferry.platform import PlatformConfig, apply_platform

DEVICES = 8
LAYOUTS = {
    "llama_tiny": ["data=8", "fsdp=8", "data=2 fsdp=2 tensor=2", "data=4 tensor=2", "fsdp=4 tensor=2"],
    "deepseek_v3_tiny": ["data=8", "fsdp=8", "data=2 fsdp=2 tensor=2", "fsdp=2 expert=4", "expert=8"],
}
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


class Layout:
    """One mesh layout's compiled train step, its state, and what the compiler says about it."""

    def __init__(self, model: str, layout: str, batch: int, seq_len: int, root: Path):
        import jax
        import numpy as np
        from omegaconf import OmegaConf
        from rich.console import Console

        from ferry.config.overrides import hydra_compose
        from ferry.config.root import load_config
        from ferry.data.placement import device_batch
        from ferry.run.preflight import prepare
        from ferry.train.state_layout import initial_state
        from ferry.xla.hlo_collectives import collective_bytes

        overrides = [f"model={model}", f"train.global_batch_size={batch}", f"train.seq_len={seq_len}"]
        overrides += [f"mesh.{axis}" for axis in layout.split()]
        overrides += [f"run.dir={root / layout.replace(' ', '_').replace('=', '')}", "train.warmup_steps=1"]
        cfg = hydra_compose(CONFIGS, "train", [*overrides, f"platform.cpu_devices={DEVICES}"])
        prepared = prepare(load_config(OmegaConf.to_container(cfg, resolve=True)), Console(quiet=True))
        config, self.mesh = prepared.config, prepared.mesh
        recipe = prepared.recipe  # the step the run of this config trains
        tokens = np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1), dtype=np.int32)  # same for all
        self.batch = lambda: device_batch(lambda rows: tokens[rows], tokens.shape, self.mesh)
        with jax.set_mesh(self.mesh):
            self.state = initial_state(config, recipe.optimizer, self.mesh, recipe.layout)[0]
        step = recipe.compile()
        self.step, compiled = step.run, step.compiled
        self.collectives = collective_bytes(compiled.as_text())
        self.flops = compiled.cost_analysis()["flops"]
        self.times: list[float] = []
        self.run_once()  # warm up

    def run_once(self) -> float:
        import jax

        with jax.set_mesh(self.mesh):
            batch = self.batch()  # the step donates its batch
            start = time.perf_counter()
            self.state, metrics = self.step(self.state, batch)
            jax.block_until_ready(metrics)
        return time.perf_counter() - start


def compare_layouts(model: str, steps: int, batch: int, seq_len: int, root: Path) -> dict[str, Layout]:
    """Build every layout, then time their steps round-robin, so machine noise hits all alike."""
    layouts = {layout: Layout(model, layout, batch, seq_len, root) for layout in LAYOUTS[model]}
    for _ in range(steps):
        for layout in layouts.values():
            layout.times.append(layout.run_once())
    return layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="one of the tiny models (default: both)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    apply_platform(PlatformConfig("cpu", cpu_devices=DEVICES))  # before JAX starts
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    for model in [args.model] if args.model else list(LAYOUTS):
        with TemporaryDirectory() as root:
            results = compare_layouts(model, args.steps, args.batch, args.seq_len, Path(root))
        base = results[LAYOUTS[model][0]]
        title = (
            f"{model} on {DEVICES} CPU devices, batch {args.batch} x seq {args.seq_len}, median of {args.steps} steps"
        )
        table = Table(title=title)
        for column in (
            "mesh",
            "all-gather MiB",
            "all-reduce MiB",
            "reduce-scatter MiB",
            "other MiB",
            "total vs data=8",
            "GFLOPs/device",
            "step ms",
            "time vs data=8",
        ):
            table.add_column(column, justify="left" if column == "mesh" else "right")
        base_time = statistics.median(base.times)
        for layout, r in results.items():
            c, step_s = r.collectives, statistics.median(r.times)
            other = sum(v for k, v in c.items() if k not in ("all-gather", "all-reduce", "reduce-scatter"))
            total, base_total = sum(c.values()), sum(base.collectives.values())
            table.add_row(
                layout,
                *(f"{c.get(k, 0) / 2**20:.2f}" for k in ("all-gather", "all-reduce", "reduce-scatter")),
                f"{other / 2**20:.2f}",
                f"{total / base_total:.2f}x",
                f"{r.flops / 1e9:.3f}",
                f"{step_s * 1e3:.1f}",
                f"{step_s / base_time:.2f}x",
            )
        console.print(table)


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    main()
