"""ferry on a real GPU in one run (at most about 8 minutes on one H200):

1. correctness: the gradient self-check (`ferry.run.policy_check`, what `train.check_policy`
   runs before training) for every offload preset on `llama_tiny` and `deepseek_v3_tiny`;
2. memory: on a DeepSeek-V3-shaped slice (full width: dim 7168, 128 MLA heads, expert FFN 2048,
   vocabulary 129,280; 1 dense + 2 MoE layers, 16 routed experts so that a layer's parameters
   and AdamW moments fit one device, no MTP, sequence 4096) the largest micro batch that fits
   the device is found from the compiled step's memory analysis, and the peak the device reports
   (`memory_stats()["peak_bytes_in_use"]`) after running it is set beside that prediction;
3. speed: `full_remat` against the offload presets at their own largest micro batch, tokens/s
   side by side, with the ratios.

    python benchmarks/gpu_check.py                      # everything a GPU allows; on CPU part 1
    python benchmarks/gpu_check.py --plan-target h200   # also part 2 for an H200, compiled without one

Without a GPU, parts 2 and 3 need one and are skipped, saying so; `--plan-target h200` then
plans the slice's micro batch for an H200 deviceless with `ferry.plan.planner.plan_memory` (slow
on a small CPU: minutes per compile). Each preset of parts 2 and 3 runs in its own process, so
its memory peak is its own.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from ferry.config.overrides import group_presets, hydra_compose
from ferry.config.root import FerryConfig, load_config
from ferry.models.registry import abstract_model
from ferry.offload.schedule import format_bytes
from ferry.platform import apply_platform
from ferry.run.policy_check import TOLERANCE, PolicyCheckError, check_policy, one_device_mesh

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PRESETS = [name for name in group_presets(CONFIGS / "offload") if name != "auto"]
TINY_MODELS = ("llama_tiny", "deepseek_v3_tiny")
SLICE_PRESETS = ("full_remat", "moe_offload", "decoder_input_offload")
# a few layers of DeepSeek-V3 at full width; 16 experts (top-8 of 4 kept groups of 2) instead of
# 256, whose 11.3B parameters per layer would need 180 GB of float32 weights and AdamW moments
SLICE = (
    "model=deepseek_v3",
    "model.num_layers=3",
    "model.num_dense_layers=1",
    "model.num_experts=16",
    "model.num_groups=8",
    "model.groups_per_token=4",
    "model.experts_per_token=8",
    "model.mtp_depth=0",
)
MAX_MICRO_BATCH = 64


def compose_run(*overrides: str) -> FerryConfig:
    """The validated config `python launch/run.py OVERRIDES...` would run."""
    cfg = hydra_compose(CONFIGS, "train", list(overrides))
    return load_config(OmegaConf.to_container(cfg, resolve=True))


def slice_config(preset: str, micro_batch: int, seq_len: int, model: tuple[str, ...] = SLICE) -> FerryConfig:
    """The DeepSeek-V3 slice (or the `model` overrides) as a run: one device, `micro_batch` rows of
    `seq_len` per step."""
    return compose_run(
        *model,
        f"offload={preset}",
        "platform=gpu",
        f"train.global_batch_size={micro_batch}",
        f"train.seq_len={seq_len}",
        "train.warmup_steps=0",
    )


# ---------------------------------------------------------------------------------------------
# 1. correctness


def self_checks(models: tuple[str, ...], presets: list[str], console: Console) -> bool:
    """The gradient self-check of every preset on every model; a table; True when all agree."""
    table = Table(title=f"gradient self-check on {jax.devices()[0].device_kind}: policy vs save_all, float32")
    for column in ("model", "preset", "layer groups", "largest difference (of scale)", "seconds", "verdict"):
        table.add_column(column)
    all_ok = True
    for model_name in models:
        config = compose_run(f"model={model_name}")
        tagged = abstract_model(config.model).tagged_names()
        for preset in presets:
            offload = compose_run(f"model={model_name}", f"offload={preset}").offload
            if preset == "save_all" or not offload.tensors.keys() <= tagged:
                continue  # the reference itself; a preset naming tensors the model lacks (moe_offload on Llama)
            start = time.perf_counter()
            try:
                results = check_policy(config.model, offload.policy(tagged), policy_name=preset)
                groups = ", ".join("/".join(r.groups) for r in results)
                worst = max(r.worst.relative for r in results)
                verdict = "ok"
            except PolicyCheckError as error:
                groups, worst, verdict, all_ok = "-", float("nan"), str(error).splitlines()[0], False
            table.add_row(model_name, preset, groups, f"{worst:.1e}", f"{time.perf_counter() - start:.1f}", verdict)
    table.caption = f"float32 allows {TOLERANCE:.1e} of each array's largest magnitude"
    console.print(table)
    return all_ok


# ---------------------------------------------------------------------------------------------
# 2. the largest micro batch that fits


def largest_fitting(bytes_of: Callable[[int], int], capacity: int, limit: int = MAX_MICRO_BATCH) -> tuple[int, int]:
    """The largest micro batch b <= `limit` with `bytes_of(b) <= capacity`, and its bytes ((0,
    bytes_of(1)) when none fits). Memory grows about linearly with the batch, so each next
    compile is where the line through the two nearest known points meets the capacity, kept
    between the largest batch known to fit and the smallest known not to: 3 to 4 compiles for a
    line."""
    known = {1: bytes_of(1)}
    if known[1] > capacity:
        return 0, known[1]
    fits, too_big, point = 1, limit + 1, 2
    while fits + 1 < too_big:
        known[point] = bytes_of(point)
        if known[point] <= capacity:
            fits = point
        else:
            too_big = point
        # extrapolate from the two largest that fit until one does not, then interpolate
        low, high = (fits, too_big) if too_big in known else sorted(known)[-2:]
        slope = max((known[high] - known[low]) / (high - low), 1.0)
        guess = low + int((capacity - known[low]) // slope)
        point = max(fits + 1, min(too_big - 1, guess))
    return fits, known[fits]


def plan_slice_deviceless(
    target_name: str, seq_len: int, presets: tuple[str, ...], console: Console, model: tuple[str, ...] = SLICE
) -> dict[str, tuple[int, int]]:
    """Part 2 without a GPU: the largest micro batch of the slice per preset for `target_name`,
    from the planner's deviceless compile of the real train step (`plan_memory`), and its HBM
    bytes, by preset (presets the planner refuses are printed with the reason and left out)."""
    from ferry.plan.memory_plan import PlanError
    from ferry.plan.planner import plan_memory
    from ferry.xla.targets import TARGETS

    target = TARGETS[target_name]
    gpu = compose_run("platform=gpu").platform
    table = Table(title=f"DeepSeek-V3 slice on one {target.description}, sequence {seq_len}: planned")
    for column in ("preset", "largest micro batch", "HBM", "pinned host", "compiles"):
        table.add_column(column)
    chosen = {}
    for preset in presets:
        plans = {}

        def bytes_of(batch: int, preset: str = preset, plans: dict = plans) -> int:
            if batch not in plans:
                config = slice_config(preset, batch, seq_len, model)
                policy = config.offload.policy(abstract_model(config.model).tagged_names())
                costs = gpu.scheduler_costs == "ferry"
                plans[batch] = plan_memory(
                    config, target, policy, preset, xla_flags=dict(gpu.xla_flags), scheduler_costs=costs
                )
            return plans[batch].device_bytes

        start = time.perf_counter()
        try:
            batch, used = largest_fitting(bytes_of, target.hbm_bytes)
        except (PlanError, jax.errors.JaxRuntimeError) as error:  # refused by the planner, or XLA failed
            reason = str(error).splitlines()[0][:300]
            console.print(f"{preset}: no plan after {len(plans)} compiles: {reason}", highlight=False)
            table.add_row(preset, "no plan", reason, "-", str(len(plans)))
            continue
        host = plans[batch].host_bytes if batch else 0
        console.print(
            f"{preset}: micro batch {batch}, {format_bytes(used)} HBM, {len(plans)} compiles in "
            f"{time.perf_counter() - start:.0f} s",
            highlight=False,
        )
        table.add_row(preset, str(batch), format_bytes(used), format_bytes(host), str(len(plans)))
        chosen[preset] = (batch, used)
    console.print(table)
    return chosen


# ---------------------------------------------------------------------------------------------
# 3. on the GPU: one process per preset


def measure_slice(
    preset: str,
    seq_len: int,
    steps: int,
    model: tuple[str, ...] = SLICE,
    capacity: int | None = None,
    limit: int = MAX_MICRO_BATCH,
) -> dict:
    """In this process: find the slice's (or `model`'s) largest micro batch on this device from the
    compiled step's memory analysis (fitting `capacity`, default the device's `bytes_limit`), run
    `steps` timed steps after two warm-up steps, and report the predicted bytes, the device's
    peak (None where the backend reports none: the CPU) and tokens/s."""
    from ferry.plan.planner import compile_config_step
    from ferry.xla.scheduler_costs import scheduler_target

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    capacity = int(stats["bytes_limit"]) if capacity is None else capacity
    mesh = one_device_mesh(device)  # one device, whatever the machine has
    compiled: dict[int, tuple] = {}

    def compile_for(batch: int) -> tuple:
        if batch not in compiled:
            config = slice_config(preset, batch, seq_len, model)
            policy = config.offload.policy(abstract_model(config.model).tagged_names())
            # on a GPU, XLA's scheduler times the ops with ferry's costs, as training's compile does
            scheduler = scheduler_target(config.platform, device.device_kind) if device.platform == "gpu" else None
            step = compile_config_step(config, scheduler, policy, mesh, {}, scheduler_costs=scheduler is not None)
            memory = step.compiled.memory_analysis()
            used = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            compiled[batch] = (step, config, used + memory.temp_size_in_bytes)
        return compiled[batch]

    batch, predicted = largest_fitting(lambda b: compile_for(b)[2], capacity, limit)
    if batch == 0:
        return {"preset": preset, "micro_batch": 0, "predicted_bytes": predicted, "capacity_bytes": capacity}
    step, config, _ = compile_for(batch)
    with jax.set_mesh(mesh):
        batches = random_batches(config, mesh, steps + 2)
        arrays, _ = run_steps(step, initial_arrays(step), batches[:2])  # warm-up
        start = time.perf_counter()
        arrays, metrics = run_steps(step, arrays, batches[2:])
        seconds = (time.perf_counter() - start) / steps
    return {
        "preset": preset,
        "micro_batch": batch,
        "predicted_bytes": predicted,
        "peak_bytes": (device.memory_stats() or {}).get("peak_bytes_in_use"),
        "capacity_bytes": capacity,
        "step_seconds": seconds,
        "tokens_per_s": batch * seq_len / seconds,
        "loss": float(metrics[-1]["loss"]),
        "compiles": len(compiled),
    }


def initial_arrays(step: Any) -> Any:
    """A fresh random init of a compiled step's state (`ferry.plan.planner.CompiledTrainStep`),
    built on the devices in its layout."""
    import equinox as eqx

    layout = step.layout
    return jax.jit(lambda: eqx.partition(layout.make(), eqx.is_array)[0], out_shardings=layout.sharding)()


def random_batches(config: FerryConfig, mesh: Any, count: int) -> list[jax.Array]:
    """`count` batches of random tokens of the run's shape, seeded, placed as training places them."""
    import numpy as np

    from ferry.sharding import batch_sharded

    rng = np.random.default_rng(0)
    shape = (config.train.global_batch_size, config.train.seq_len + 1)
    return [
        jax.device_put(rng.integers(0, config.model.vocab_size, shape, np.int32), batch_sharded(mesh))
        for _ in range(count)
    ]


def run_steps(step: Any, arrays: Any, batches: list[jax.Array]) -> tuple[Any, list[dict]]:
    """One step per batch, the state's arrays donated from each to the next; waits for the last.
    Returns the arrays and each step's metrics."""
    metrics = []
    for tokens in batches:
        arrays, step_metrics = step.run(arrays, tokens)
        metrics.append(step_metrics)
    jax.block_until_ready((arrays, metrics))
    return arrays, metrics


def measure_all(presets: tuple[str, ...], seq_len: int, steps: int, deadline: float, console: Console) -> None:
    """Parts 2 and 3 on this GPU, each preset in a fresh process, in order, while time is left
    before `deadline` (a `time.perf_counter()` value); one table, ratios to full_remat."""
    results = []
    for preset in presets:
        left = deadline - time.perf_counter()
        if left < 30:
            console.print(f"[yellow]{preset} skipped[/]: the run's time budget is spent (--budget-s)")
            continue
        command = [sys.executable, __file__, "--measure", preset, "--seq-len", str(seq_len), "--steps", str(steps)]
        env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}  # the whole device, not JAX's 75%
        try:
            out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=left)
        except subprocess.TimeoutExpired:
            console.print(f"[yellow]{preset} stopped[/]: the run's time budget ran out while it ran (--budget-s)")
            continue
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or not lines:
            console.print(f"[red]{preset} failed[/]:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
            continue
        results.append(json.loads(lines[-1]))
    console.print(slice_table(results, seq_len, jax.devices()[0].device_kind))


def slice_table(results: list[dict], seq_len: int, device: str) -> Table:
    """The measured presets side by side, tokens/s as ratios to full_remat's."""
    table = Table(title=f"DeepSeek-V3 slice (1 dense + 2 MoE layers at full width, 16 experts) on one {device}")
    for column in (
        "preset",
        "micro batch",
        "predicted HBM",
        "peak HBM",
        "peak / predicted",
        "tokens/s",
        "vs full_remat",
    ):
        table.add_column(column)
    base = next((r["tokens_per_s"] for r in results if r["preset"] == "full_remat" and r["micro_batch"]), None)
    for r in results:
        if not r["micro_batch"]:
            table.add_row(r["preset"], "none fits", format_bytes(r["predicted_bytes"]), "-", "-", "-", "-")
            continue
        peak = r["peak_bytes"]
        table.add_row(
            r["preset"],
            str(r["micro_batch"]),
            format_bytes(r["predicted_bytes"]),
            "-" if peak is None else format_bytes(peak),
            "-" if peak is None else f"{peak / r['predicted_bytes']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base:.3f}x" if base else "-",
        )
    table.caption = f"sequence {seq_len}; capacity {format_bytes(results[0]['capacity_bytes'])}" if results else ""
    return table


def has_gpu() -> bool:
    """An NVIDIA GPU on this machine (asked before JAX starts a backend, which would otherwise
    try the CUDA plugin and fail where there is none)."""
    return Path("/dev/nvidiactl").exists()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(TINY_MODELS))
    parser.add_argument("--presets", nargs="+", default=PRESETS, help="presets of the self-check")
    parser.add_argument(
        "--slice-presets", nargs="*", default=list(SLICE_PRESETS), help="parts 2 and 3; none: the self-check alone"
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=480, help="stop starting slice presets after this")
    parser.add_argument("--plan-target", default=None, help="without a GPU: plan the slice for this target")
    parser.add_argument(
        "--xla-flag",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an XLA flag over the platform's, e.g. xla_gpu_enable_pipelined_host_offloading=true",
    )
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # one preset, in a child process
    args = parser.parse_args()
    gpu = has_gpu() and not args.plan_target
    flags = [f"platform.xla_flags.{flag}" for flag in args.xla_flag]
    apply_platform(compose_run(f"platform={'gpu' if gpu else 'cpu'}", *flags).platform)  # the flags a run uses
    if args.measure:
        print(json.dumps(measure_slice(args.measure, args.seq_len, args.steps)))
        return 0
    console = Console(width=max(Console().width, 140))
    started = time.perf_counter()
    if args.plan_target:
        plan_slice_deviceless(args.plan_target, args.seq_len, tuple(args.slice_presets), console)
    ok = self_checks(tuple(args.models), args.presets, console)
    if gpu and args.slice_presets:
        measure_all(tuple(args.slice_presets), args.seq_len, args.steps, started + args.budget_s, console)
    elif not gpu:
        console.print(
            "no GPU here: the memory peaks and the full_remat vs offload timing need one "
            f"(found {jax.devices()[0].platform}); the self-check above ran on this backend"
        )
    console.print(f"{time.perf_counter() - started:.0f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main())
