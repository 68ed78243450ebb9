"""Host copies on a real GPU, beside the planner's reading of the same compiled program.

Each configuration (an offload preset, its copy schedule, where the train state lives) is compiled
on the device's mesh with the planner's own code (`ferry.plan.planner.compile_config_step`, XLA's
scheduler timed by ferry's costs, the planner's per-compile options: no autotuning, so the program
is the one a deviceless plan reads) and read by it (`read_plan`: HBM, pinned host, link time,
exposed copy time and its floor, matmul time at the target's peak; the compiled-program
verifier), then run: seconds per step, the device's peak HBM (`memory_stats()`) and, from a
profiler trace, how long the copy engines moved bytes between host and device with no kernel
running beside them (the exposed copy time, measured).

Schedules (issue 14): `ferry` (copies one layer apart, `offload.pipelined=true`, the default),
`per-layer` (`offload.pipelined=false`), `xla` (the per-layer program with XLA's pipelined host
offloading), `both`. A configuration is `PRESET[@SCHEDULE][+state-on-host]`.

    python benchmarks/gpu_copies.py [--configs save_all qkv_offload minimal_offloaded@xla ...]
        [--model llama3_1_8b --layers 4 --seq-len 4096] [--steps 10] [--out DIR]

All configurations run in one process: they are compiled first, then run in the order of their
predicted HBM, so the device's running peak after each is its own (a peak an earlier, larger
configuration set would show as equal to it). `--out` gets `results.json` (rewritten after each
configuration), the profiler traces and, with `--hlo`, each optimized program. Without a GPU it
runs on the CPU with `--model llama_tiny`, which has no device memory statistics, no copy engines
and no host memory: the offloading presets are refused there (the planner sees no pinned host
bytes).
"""

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax

if __package__ in (None, ""):  # run as a script: benchmarks.* from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_check import compose_run, has_gpu, initial_arrays, random_batches, run_steps  # noqa: E402
from ferry.platform import apply_platform  # noqa: E402
from ferry.xla.profile_trace import busy_ns, uncovered_ns  # noqa: E402

SCHEDULES = {  # name: (offload.pipelined, xla_gpu_enable_pipelined_host_offloading)
    "ferry": (True, False),
    "per-layer": (False, False),
    "xla": (False, True),
    "both": (True, True),
}
STATE_ON_HOST = "+state-on-host"
DEFAULT_CONFIGS = (
    "save_all",
    "full_remat",
    "qkv_offload",
    "minimal_offloaded",
    "decoder_input_offload",
    "minimal_offloaded@xla",
    "decoder_input_offload" + STATE_ON_HOST,
    "minimal_offloaded@per-layer",
    "qkv_offload@xla",
    "decoder_input_offload@xla",
)
# kernels that do the matrix products, by their names in a GPU trace (cuBLAS, cuBLASLt, CUTLASS, Triton)
MATMUL_KERNEL = re.compile(r"gemm|cutlass|nvjet|xmma|wgmma|cublas|_dot|matmul", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Configuration:
    preset: str
    schedule: str = "ferry"
    state_on_host: bool = False

    @classmethod
    def parse(cls, text: str) -> "Configuration":
        state_on_host = text.endswith(STATE_ON_HOST)
        preset, _, schedule = text.removesuffix(STATE_ON_HOST).partition("@")
        if (schedule or "ferry") not in SCHEDULES:
            raise SystemExit(f"{text}: the schedule after @ is one of {', '.join(SCHEDULES)}")
        return cls(preset, schedule or "ferry", state_on_host)

    @property
    def name(self) -> str:
        schedule = "" if self.schedule == "ferry" else f"@{self.schedule}"
        return f"{self.preset}{schedule}{STATE_ON_HOST if self.state_on_host else ''}"

    def overrides(self) -> list[str]:
        pipelined, _ = SCHEDULES[self.schedule]
        placed = ["offload.optimizer=host", "offload.params=host"] if self.state_on_host else []
        return [f"offload={self.preset}", f"offload.pipelined={str(pipelined).lower()}", *placed]

    def xla_options(self) -> dict[str, object]:
        return {"xla_gpu_enable_pipelined_host_offloading": SCHEDULES[self.schedule][1]}


def trace_exposure(xplane: Path, steps: int) -> dict[str, Any] | None:
    """From a profiler trace of `steps` steps on one GPU: per step, how long host<->device copies
    ran, how much of that no kernel (no matmul kernel) ran beside, and the kernels' busy time. None
    where the trace has no GPU plane (the CPU)."""
    from jax.profiler import ProfileData

    profile = ProfileData.from_file(str(xplane))
    plane = next((p for p in profile.planes if p.name.startswith("/device:GPU:")), None)
    if plane is None:
        return None
    copies: dict[str, list[tuple[int, int]]] = {"H2D": [], "D2H": []}
    kernels: list[tuple[int, int]] = []
    matmuls: list[tuple[int, int]] = []
    names: dict[str, float] = {}
    for line in plane.lines:
        if not line.name.startswith("Stream #"):  # the derived lines (XLA ops, modules) repeat the streams
            continue
        for event in line.events:
            span = (event.start_ns, event.end_ns)
            direction = next((d for d in copies if d in event.name), None)
            if event.name.startswith("Memcpy") and direction:
                copies[direction].append(span)
            elif not event.name.startswith(("Memcpy", "Memset")):
                kernels.append(span)
                if MATMUL_KERNEL.search(event.name):
                    matmuls.append(span)
            names[event.name[:60]] = names.get(event.name[:60], 0.0) + (span[1] - span[0]) / 1e6
    both = copies["H2D"] + copies["D2H"]
    per_step = lambda ns: ns / steps / 1e9
    return {
        "copy_seconds": per_step(busy_ns(both)),
        "to_host_seconds": per_step(busy_ns(copies["D2H"])),
        "to_device_seconds": per_step(busy_ns(copies["H2D"])),
        "exposed_seconds": per_step(uncovered_ns(both, kernels)),
        "exposed_to_matmuls_seconds": per_step(uncovered_ns(both, matmuls)),
        "kernel_seconds": per_step(busy_ns(kernels)),
        "matmul_kernel_seconds": per_step(busy_ns(matmuls)),
        "copies": len(both) / steps,
        "lines": sorted({line.name for line in plane.lines}),
        "top_events_ms": dict(sorted(names.items(), key=lambda kv: -kv[1])[:25]),
    }


def file_name(configuration: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", configuration)


def compile_configuration(configuration: Configuration, args: argparse.Namespace) -> tuple[Any, Any, dict]:
    """The configuration's step compiled on this machine's first device and the planner's reading of it."""
    from ferry.models.registry import abstract_model
    from ferry.plan.planner import compile_config_step, read_plan
    from ferry.sharding import make_mesh
    from ferry.xla.targets import TARGETS

    model = [f"model={args.model}"] + ([f"model.num_layers={args.layers}"] if args.layers else [])
    config = compose_run(
        *model,
        *configuration.overrides(),
        f"platform={'gpu' if has_gpu() else 'cpu'}",
        f"train.global_batch_size={args.batch}",
        f"train.seq_len={args.seq_len}",
        "train.warmup_steps=0",
    )
    policy = config.offload.policy(abstract_model(config.model).tagged_names())
    target = TARGETS[args.target]
    mesh = make_mesh(config.mesh)
    costs = config.platform.scheduler_costs == "ferry"
    # the planner's per-compile options (no autotuning): the program the deviceless plan reads
    options = target.compile_options(configuration.xla_options()) if has_gpu() else {}
    step = compile_config_step(config, target, policy, mesh, options, costs)
    plan = read_plan(step, config, target, policy, configuration.name)
    summary = plan.transfer_summary
    matmul = plan.flops / plan.matmul_rate
    reading = {
        "config": configuration.name,
        "compile_seconds": step.seconds,
        "predicted_bytes": plan.device_bytes,
        "argument_bytes": plan.argument_bytes,
        "temp_bytes": plan.temp_bytes,
        "host_bytes": plan.host_bytes,
        "matmul_tflop": plan.flops / 1e12,
        "planned": {
            "link_seconds": summary.link_seconds,
            "matmul_seconds": matmul,
            "exposed_seconds": summary.exposed_seconds,
            "floor_seconds": summary.floor_seconds,
            "goal_seconds": summary.goal_seconds(matmul),
            # copies that run as kernels through the SMs (XLA's peeled host slices): the trace
            # below sees them as kernels, not memcpys, so its exposure leaves them out
            "kernel_copies": summary.kernel_copies,
            "kernel_bytes": summary.kernel_bytes,
        },
        "verified": plan.verification is not None,
    }
    return step, config, reading


def run_configuration(step: Any, config: Any, args: argparse.Namespace, trace_dir: Path | None) -> dict:
    """Warm up, time `args.steps` steps, trace `args.trace_steps` more; the losses of the first steps."""
    mesh = step.mesh
    batches = random_batches(config, mesh, 2 + args.steps + args.trace_steps)
    with jax.set_mesh(mesh):
        arrays, warm_up = run_steps(step, initial_arrays(step), batches[:2])
        started = time.perf_counter()
        arrays, _ = run_steps(step, arrays, batches[2 : 2 + args.steps])
        seconds = (time.perf_counter() - started) / args.steps
        exposure, trace_error = None, None
        if trace_dir is not None and args.trace_steps:
            try:
                with jax.profiler.trace(str(trace_dir)):
                    arrays, _ = run_steps(step, arrays, batches[2 + args.steps :])
                xplane = max(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
                exposure = trace_exposure(xplane, args.trace_steps)
            except Exception as error:  # a profiler that cannot start here loses the trace, not the timing
                trace_error = f"{type(error).__name__}: {error}"[:500]
    del arrays
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "step_seconds": seconds,
        "losses": [float(m["loss"]) for m in warm_up],
        "running_peak_bytes": stats.get("peak_bytes_in_use"),
        "measured": exposure,
        "trace_error": trace_error,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = has_gpu()
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--model", default="llama3_1_8b" if gpu else "llama_tiny")
    parser.add_argument("--layers", type=int, default=4 if gpu else 0, help="model.num_layers (0: the model's)")
    parser.add_argument("--seq-len", type=int, default=4096 if gpu else 64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trace-steps", type=int, default=3)
    parser.add_argument("--target", default="h200", help="the target the planner times copies and matmuls on")
    parser.add_argument("--budget-s", type=float, default=1e9, help="compile no more configurations after this")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_copies"))
    parser.add_argument("--hlo", action="store_true", help="also write each optimized program to OUT/hlo/")
    args = parser.parse_args()
    apply_platform(compose_run(f"platform={'gpu' if gpu else 'cpu'}").platform)  # the flags and pool a run uses
    configurations = [Configuration.parse(text) for text in args.configs]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    compiled = {}
    device = jax.devices()[0]
    header = {"device": device.device_kind, "jax": jax.__version__, "model": args.model, "layers": args.layers}
    header |= {"seq_len": args.seq_len, "batch": args.batch, "steps": args.steps}

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(header | {"results": results}, indent=1))

    for configuration in configurations:
        if time.perf_counter() - started > args.budget_s:
            print(f"{configuration.name}: not compiled, --budget-s spent", flush=True)
            continue
        try:
            step, config, reading = compile_configuration(configuration, args)
        except Exception as error:  # one configuration XLA or the verifier refuses; the others still run
            results[configuration.name] = {"config": configuration.name, "error": f"{type(error).__name__}: {error}"}
            print(f"{configuration.name}: {results[configuration.name]['error'][:2000]}", flush=True)
            save()
            continue
        compiled[configuration.name] = (step, config)
        results[configuration.name] = reading
        if args.hlo:  # the optimized program, to read where a number surprises (`memory_analysis` does not say why)
            (args.out / "hlo").mkdir(exist_ok=True)
            (args.out / "hlo" / f"{file_name(configuration.name)}.txt").write_text(step.compiled.as_text())
        print(json.dumps(reading), flush=True)
        save()
    for name in sorted(compiled, key=lambda n: results[n]["predicted_bytes"]):
        step, config = compiled.pop(name)
        trace_dir = args.out / "traces" / file_name(name)
        results[name] |= run_configuration(step, config, args, trace_dir)
        del step
        print(json.dumps({k: v for k, v in results[name].items() if k != "measured"}), flush=True)
        print(json.dumps({"config": name, "measured": results[name]["measured"]}), flush=True)
        save()
    print(f"{time.perf_counter() - started:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main())
