"""Which copy schedule hides host copies best, compiled side by side for a GPU target:

- per layer: each copy issued inside its layer (`offload.pipelined=false`);
- ferry: copies one layer apart, in Python (`ferry.offload.scan`, the default);
- ferry, peel 1 / peel 2: the same with each stack's first layer and its last one or two outside
  its loop (`offload.peel`): no placeholder copies, and the copies of those layers free of a loop;
- XLA: XLA's pipelined host offloading (`xla_gpu_enable_pipelined_host_offloading`) on the
  per-layer program;
- both: ferry's schedule compiled with XLA's pass on;

each ordered by XLA's latency-hiding scheduler twice: with its own fixed estimates
(`platform.scheduler_costs=xla`) and timing every op with ferry's cost model
(`platform.scheduler_costs=ferry`, the default on GPU; `ferry.xla.scheduler_costs`).

For each preset and schedule it prints the planner's reading of the compiled program: link time,
exposed copy time, the least any order of its computations could expose (floor: a copy cannot
outlive its loop iteration), matmul time, HBM temporaries and total, the goal of the copy schedule
(exposed <= max(0, link - matmul) + 5% of matmul) and the ratios to the first schedule's row (per
layer, with XLA's estimates, unless `--schedules` says otherwise). All numbers come from deviceless
compiles (`mode=plan`), not from a GPU. `--fsdp N` plans N GPUs of one FSDP mesh, a row of the
batch each.

    python benchmarks/offload_schedule.py [--model llama3_1_8b] [--layers 4] [--seq-len 4096]
        [--presets qkv_offload minimal_offloaded decoder_input_offload] [--target h200] [--fsdp 1]
        [--schedules "per layer" ferry "ferry, peel 1" "ferry, peel 2" XLA both]
"""

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ferry.plan.transfers import TransferSummary

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = {  # name: (offload.pipelined, offload.peel, xla_gpu_enable_pipelined_host_offloading)
    "per layer": (False, 0, False),
    "ferry": (True, 0, False),
    "ferry, peel 1": (True, 1, False),
    "ferry, peel 2": (True, 2, False),
    "XLA": (False, 0, True),
    "both": (True, 0, True),
}
COSTS = ("xla", "ferry")  # platform.scheduler_costs: XLA's fixed estimates, ferry's cost model


def plan(args: argparse.Namespace, preset: str, schedule: tuple[bool, int, bool], costs: str, out: Path) -> dict:
    """One `mode=plan` of `preset` under one schedule: its plan.json entry."""
    pipelined, peel, xla = schedule
    run_dir = out / f"{preset}-{int(pipelined)}{int(peel)}{int(xla)}-{costs}"
    command = [
        sys.executable,
        str(ROOT / "launch" / "run.py"),
        "mode=plan",
        f"target={args.target}",
        f"model={args.model}",
        f"model.num_layers={args.layers}",
        f"train.seq_len={args.seq_len}",
        f"train.global_batch_size={args.fsdp}",
        f"mesh.fsdp={args.fsdp}",
        "platform=gpu",
        f"offload={preset}",
        f"plan.presets=[{preset}]",
        f"offload.pipelined={str(pipelined).lower()}",
        f"offload.peel={peel}",
        f"platform.xla_flags.xla_gpu_enable_pipelined_host_offloading={str(xla).lower()}",
        f"platform.scheduler_costs={costs}",
        f"run.dir={run_dir}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return json.loads((run_dir / "plan.json").read_text())["plans"][0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_1_8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--presets", nargs="+", default=["qkv_offload", "minimal_offloaded", "decoder_input_offload"])
    parser.add_argument("--target", default="h200")
    parser.add_argument("--fsdp", type=int, default=1, help="GPUs of one FSDP mesh, one row of the batch each")
    parser.add_argument(
        "--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES), help="the ratios are to the first"
    )
    args = parser.parse_args()
    schedules = {name: SCHEDULES[name] for name in args.schedules}
    table = Table(
        title=f"copy schedules: {args.model}, {args.layers} layers x {args.seq_len} tokens, "
        f"{args.fsdp} x {args.target} (per device and step; deviceless compiles)"
    )
    columns = ("preset", "schedule", "costs", "link", "matmuls", "exposed", "floor", "goal", "meets")
    columns += ("temp GiB", "HBM GiB")
    for column in (*columns, "exposed / per layer", "HBM / per layer"):
        table.add_column(column, justify="left" if column in ("preset", "schedule", "costs", "meets") else "right")
    with tempfile.TemporaryDirectory() as out:
        for preset in args.presets:
            reference = None
            for (name, schedule), costs in itertools.product(schedules.items(), COSTS):
                p = plan(args, preset, schedule, costs, Path(out))
                per_step = p["transfers"]["per_step"]
                summary = TransferSummary(**per_step)
                link, exposed = summary.link_seconds, summary.exposed_seconds
                matmul = p["flops"] / p["matmul_rate"]
                goal = summary.goal_seconds(matmul)
                reference = reference or (exposed, p["device_bytes"])
                table.add_row(
                    preset,
                    name,
                    costs,
                    f"{link * 1e3:.2f} ms",
                    f"{matmul * 1e3:.2f} ms",
                    f"{exposed * 1e3:.2f} ms",
                    f"{summary.floor_seconds * 1e3:.2f} ms",
                    f"{goal * 1e3:.2f} ms",
                    "yes" if exposed <= goal else "no",
                    f"{p['temp_bytes'] / 2**30:.3f}",
                    f"{p['device_bytes'] / 2**30:.3f}",
                    "-" if reference[0] == 0 else f"{exposed / reference[0]:.3f}",
                    f"{p['device_bytes'] / reference[1]:.4f}",
                )
            table.add_section()
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main())
