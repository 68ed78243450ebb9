"""ferry on one TPU chip in one command (within `--budget-s`, 530 s by default; every case at
every batch takes longer on a v5e VM: a preset's case 22 to 30 s with its step compiled ahead, 40 to
65 s without, and `offload=auto` 2 to 4 minutes a batch, its plan and timed candidates):

1. the gradient self-check (`train.check_policy`) at the benchmark's shape, and what it cost;
2. the host link inside a compiled program: device->host, host->device and both at once;
3. a Llama-shaped 386M model (dim 2048, 16/8 heads of 128, FFN 8192, 4 layers, vocabulary
   32,768, sequence 2048) at global batches 4, 8 and 16 for every offload preset, `offload=auto`
   and JAX's own offload of `minimal_offloaded`'s tensors (`offload.engine=jax`, recorded as
   `preset: "jax_offload"`), each case `python launch/run.py ...` in a process of its own:
   tokens/s and MFU (median of the steps after the first; causal attention's FLOPs halved, as MaxText
   counts since its PR #1988, `mfu_full_attention` beside it with the whole T x T), the measured HBM peak against the
   compiled arguments + temporaries, the host bytes, and the host copies' exposed time from a
   `jax.profiler` trace of two steps, which ferry reads itself (`ferry.xla.profile_trace`), beside
   the floor the measured link sets: max(0, link time - compute time).

    python benchmarks/tpu_check.py                               # writes benchmarks/results/tpu_v5e.json
    python benchmarks/tpu_check.py --batches 8 --presets full_remat minimal_offloaded
    python benchmarks/tpu_check.py --plot benchmarks/results/tpu_v5e.json --run "run 4:"   # the README's PNG

A case that does not fit is ferry's one-line refusal, recorded as `oom` with the bytes it
needed. Cases run batch 16 first, then 8, then 4, and in each full_remat, then auto, then the other
presets, while the time budget (`--budget-s`) lasts;
those left are recorded as skipped. The parent process never opens the chip, so each child can.

Each preset's step is compiled ahead on the CPU (`mode=compile`, `--compile-workers` at a time),
into the compilation cache its run then loads: a case takes about 20 s on the chip instead of 40 to
65. A step the compile finds over HBM is recorded as `oom` from that refusal, and its case does not
run. Every compile ends before the link or any case is timed: a case timed beside them ran slow
(run 10 on the v5e chip, 2026-12-07: full_remat at batch 8, first while six compiles ran at a
lower CPU priority, took 0.402 s a step against 0.326 s alone; run 8's first case, 46,532 tokens/s
against 50,227, was the same).
"""

import argparse
import concurrent.futures
import datetime
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python benchmarks/tpu_check.py` from anywhere: benchmarks.* importable

MODEL = (
    "model=llama3_1_8b",
    "model.dim=2048",
    "model.num_heads=16",
    "model.num_kv_heads=8",
    "model.head_dim=128",
    "model.mlp_dim=8192",
    "model.num_layers=4",
    "model.vocab_size=32768",
    "data=synthetic",
)
SEQ = 2048  # the benchmark's sequence; --seq 8192 --batches 2 is the long-context column
PLATFORM = "tpu"
PRESETS = ("save_all", "minimal", "full_remat", "decoder_input_offload", "qkv_offload", "minimal_offloaded")
JAX_OFFLOAD = "jax_offload"  # JAX's own offload of JAX_OFFLOAD_TENSORS' tensors
JAX_OFFLOAD_TENSORS = "minimal_offloaded"
CASES = (*PRESETS, JAX_OFFLOAD, "auto")
# the cases whose steps copy to host: only their trace says something (exposed copy time); the
# others skip the profiler's seconds
TRACED_CASES = ("decoder_input_offload", "qkv_offload", "minimal_offloaded", JAX_OFFLOAD, "auto")
BATCH_ORDER = (16, 8, 4)  # what matters most first, should the budget run out: 16, where minimal does not fit
STEPS = 7  # step 1 compiles; steps 2-5 timed; 6-7 traced
TIMED = range(2, 6)
TRACED = (6, 7)
OUT = ROOT / "benchmarks" / "results" / "tpu_v5e.json"
COMMAND = "python benchmarks/tpu_check.py"


TARGET = "v5e"  # the planner's name for the chip offload=auto plans for
# placements of your own, `--case LABEL=override,override,...`: LABEL -> its offload overrides
CUSTOM: dict[str, list[str]] = {}
# `--extra override ...`: added to every case and to auto's plan (e.g. `platform.xla_flags.*`)
EXTRA: list[str] = []


# seconds a case needs at the least once started: auto plans first (110 to 190 s on the v5e chip at
# this shape, run 5), then times its candidates (about 40 s each) and runs its pick; started with
# less, its plan was killed unfinished (run 5: 68 s in, with 60 s of budget left)
AUTO_LEAST_S = 300
CASE_LEAST_S = 20
# `mode=compile` processes side by side on the chip machine's CPU (13 cores on the v5e VM; XLA
# compiles on one core), all done before anything is timed (module docstring)
COMPILE_WORKERS = 12
COMPILE_TIMEOUT_S = 300


def least_time(case: str) -> float:
    """The budget a case must still have to be started."""
    return AUTO_LEAST_S if case == "auto" else CASE_LEAST_S


def case_overrides(
    case: str, batch: int, run_dir: Path, check_policy: bool, offload: list[str] | None = None, seq: int = SEQ
) -> list[str]:
    """The `launch/run.py` overrides of one case (`offload`: its placement, where not its name's)."""
    if offload is not None:
        pass
    elif case in CUSTOM:
        offload = CUSTOM[case]
    elif case == JAX_OFFLOAD:
        offload = [f"offload={JAX_OFFLOAD_TENSORS}", "offload.engine=jax"]
    else:
        offload = [f"offload={case}"]
    return [
        *MODEL,
        *offload,
        f"platform={PLATFORM}",
        f"train.global_batch_size={batch}",
        f"train.seq_len={seq}",
        f"train.steps={STEPS}",
        "train.log_every=1",
        "train.eval_batches=0",
        f"train.check_policy={str(check_policy).lower()}",
        *([f"profile.start_step={TRACED[0]}", f"profile.steps={len(TRACED)}"] if traced(case) else []),
        "checkpoint.final=false",
        "log.tensorboard=false",
        f"run.dir={run_dir}",
        *EXTRA,
    ]


def traced(case: str) -> bool:
    return case in TRACED_CASES or case in CUSTOM


def scratch_root() -> Path:
    """Where the cases' run directories go: RAM (/dev/shm) where there is one, so the final
    checkpoint of a 4 GiB state costs seconds, not the disk's minute."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="ferry-tpu-check-", dir=shm if shm.is_dir() else None))


def run_case(
    case: str,
    batch: int,
    link: dict | None,
    timeout: float,
    check_policy: bool = False,
    keep: Path | None = None,
    seq: int = SEQ,
) -> dict:
    """One case in its own process; its record. `keep`: a folder to copy its trace and log into."""
    root = scratch_root()
    run_dir = root / (f"{case}-b{batch}" + ("" if seq == SEQ else f"-s{seq}"))
    overrides = case_overrides(case, batch, run_dir, check_policy, seq=seq)
    command = [sys.executable, str(ROOT / "launch" / "run.py"), *overrides]
    record: dict = {"preset": case, "global_batch": batch, "seq_len": seq, "date": datetime.date.today().isoformat()}
    if case == JAX_OFFLOAD:
        record["tensors_of"] = JAX_OFFLOAD_TENSORS
    if case in CUSTOM:
        record["overrides"] = CUSTOM[case]
    if EXTRA:
        record["extra"] = list(EXTRA)
    started = time.perf_counter()
    if case == "auto":  # the planner chooses (timing its best candidates on the chip), then the pick runs
        plan_dir = root / "plan"
        returncode, output = timed_output(plan_command(batch, plan_dir, seq), timeout)
        record["plan_s"] = round(time.perf_counter() - started, 1)
        if keep is not None:
            (keep / f"plan-b{batch}").mkdir(parents=True, exist_ok=True)
            (keep / f"plan-b{batch}" / "output.txt").write_text(output)
        if returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            return record | {"status": "plan failed", "message": output[-4000:]}
        pick = preset_overrides(plan_dir / "offload_auto.yaml")
        record["auto_pick"] = [o.split("offload.tensors.", 1)[1] for o in pick if o.startswith("offload.tensors.")]
        record["auto_measured"] = auto_measured(plan_dir / "offload_auto.yaml")
        says = (line for line in output.splitlines() if "offload.auto.measure" in line)
        record["auto_measure_says"] = next(says, None)  # whether it timed its candidates, and why
        overrides = case_overrides(case, batch, run_dir, check_policy, pick, seq)
        command = [sys.executable, str(ROOT / "launch" / "run.py"), *overrides]
    returncode, output = timed_output(command, max(timeout - (time.perf_counter() - started), 30))
    record["process_s"] = round(time.perf_counter() - started, 1)
    if returncode is None:
        shutil.rmtree(root, ignore_errors=True)
        return record | {"status": "timeout"}
    if keep is not None:
        kept = keep / run_dir.name
        kept.mkdir(parents=True, exist_ok=True)
        (kept / "output.txt").write_text(output)
        for xplane in (run_dir / "profile").rglob("*.xplane.pb"):
            shutil.copy(xplane, kept / xplane.name)
        if (run_dir / "metrics.jsonl").exists():
            shutil.copy(run_dir / "metrics.jsonl", kept / "metrics.jsonl")
    try:
        if returncode != 0:
            return record | refusal(output, returncode)
        record |= read_metrics(run_dir / "metrics.jsonl")
        if traced(case):
            record |= read_trace(run_dir / "profile", link)
        if check_policy:
            record["self_check_s"] = self_check_seconds(output)
        record["status"] = "ok"
        return record
    finally:
        shutil.rmtree(root, ignore_errors=True)


def compile_command(case: str, batch: int, seq: int = SEQ) -> list[str]:
    """`mode=compile` of a case: its run's step compiled for the chip on the CPU (`ferry.run.precompile`),
    into the compilation cache its run loads; the run's own overrides, so the program is the same."""
    overrides = case_overrides(case, batch, Path(tempfile.gettempdir()) / "ferry-compile-only", False, seq=seq)
    return [sys.executable, str(ROOT / "launch" / "run.py"), *overrides, "mode=compile", f"target={TARGET}"]


class Compiles:
    """Each (case, batch)'s `mode=compile`, in the order given, `workers` at a time; `stop` kills
    those still compiling when the cases are done."""

    def __init__(self, keys: list[tuple[str, int]], seq: int, workers: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(workers, 1))
        self.children: list[subprocess.Popen] = []
        self.futures = {
            key: self.pool.submit(timed_output, compile_command(*key, seq), COMPILE_TIMEOUT_S, self.children)
            for key in keys
        }

    def get(self, key: tuple[str, int]) -> concurrent.futures.Future | None:
        return self.futures.get(key)

    def wait(self) -> float:
        """Seconds until every compile has ended (each within `COMPILE_TIMEOUT_S`)."""
        started = time.perf_counter()
        concurrent.futures.wait(list(self.futures.values()))
        return time.perf_counter() - started

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for child in self.children:
            child.kill()


def compiled_ahead(future: concurrent.futures.Future | None, timeout: float) -> dict:
    """What a case's compile ahead said, for its record: its seconds, and a refusal where its step
    is over HBM (the case then does not run); nothing where it was not asked for or not done in time
    (the run compiles for itself)."""
    if future is None:
        return {}
    try:
        returncode, output = future.result(timeout=max(timeout, 1.0))
    except concurrent.futures.TimeoutError:
        return {"compiled_ahead": "not done in time"}
    found = re.search(r"compiled the train step for .* in ([\d.]+) s", output)
    if returncode == 0 and found:
        return {"compiled_ahead_s": float(found[1])}
    if returncode == 2:
        refused = refusal(output, returncode)
        if refused["status"] == "oom":
            return refused | {"refused_by": "mode=compile (the step compiled for the chip on the CPU)"}
    return {"compiled_ahead": f"failed (exit {returncode}): " + output[-600:]}


def plan_command(batch: int, plan_dir: Path, seq: int = SEQ) -> list[str]:
    """`mode=plan offload=auto` for this chip at `batch`: what a user runs before training."""
    return [
        sys.executable,
        str(ROOT / "launch" / "run.py"),
        *MODEL,
        "mode=plan",
        f"target={TARGET}",
        "offload=auto",
        f"train.global_batch_size={batch}",
        f"train.seq_len={seq}",
        f"run.dir={plan_dir}",
        *EXTRA,
    ]


def preset_overrides(path: Path) -> list[str]:
    """A preset file (the planner's offload_auto.yaml) as `offload.*` overrides of full_remat."""
    import yaml

    preset = yaml.safe_load(path.read_text())
    overrides = ["offload=full_remat"]
    for key in ("name", "keep_all", "default", "optimizer", "params", "stream_mib", "pipelined", "peel", "engine"):
        if key in preset:
            value = (
                "null"
                if preset[key] is None
                else str(preset[key]).lower()
                if isinstance(preset[key], bool)
                else preset[key]
            )
            overrides.append(f"offload.{key}={value}")
    overrides += [f"offload.tensors.{name}={place}" for name, place in (preset.get("tensors") or {}).items()]
    return overrides


def auto_measured(path: Path) -> dict | None:
    """What auto timed on the chip and why it picked (offload_auto.yaml's `measured:`); None where
    it timed nothing."""
    import yaml

    return yaml.safe_load(path.read_text()).get("measured")


def timed_output(
    command: list[str], timeout: float, children: list[subprocess.Popen] | None = None
) -> tuple[int | None, str]:
    """Run `command`; (its exit status, None if it ran past `timeout`, and its output, each line
    prefixed with the seconds since it started: where a case's time goes). `children`: where the
    process is listed, for whoever may stop it early."""
    started = time.perf_counter()
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) as child:
        if children is not None:
            children.append(child)
        for line in child.stdout:
            lines.append(f"[{time.perf_counter() - started:6.1f}s] {line}")
            if time.perf_counter() - started > timeout:
                child.kill()
                return None, "".join(lines)
        try:
            returncode = child.wait(timeout=max(1.0, timeout - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            child.kill()
            return None, "".join(lines)
    lines.append(f"[{time.perf_counter() - started:6.1f}s] exit {returncode}\n")
    return returncode, "".join(lines)


def refusal(output: str, returncode: int) -> dict:
    """A case that did not run: out of memory (ferry's one-line refusal, `error: ...`, naming the
    bytes the step needs) or a failure."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line or "RESOURCE_EXHAUSTED" in line]
    oom = next(
        (line for line in errors if re.search(r"does not fit|needs? [\d.,]+ GiB|RESOURCE_EXHAUSTED", line)), None
    )
    if returncode == 2 and oom is not None:
        found = re.search(r"needs? ([\d.,]+) GiB", oom)
        needed = int(float(found[1].replace(",", "")) * 2**30) if found else None
        return {"status": "oom", "compiled_bytes": needed, "message": oom.split("error:", 1)[-1].strip()[:600]}
    return {"status": "failed", "returncode": returncode, "message": "\n".join(lines[-30:])[-4000:]}


def read_metrics(path: Path) -> dict:
    """Medians of the timed steps' records; the memory figures of the last record."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step") in TIMED and "tokens_per_s" in r]
    if not steps:
        raise RuntimeError(f"{path} holds no records of steps {list(TIMED)}")
    last = steps[-1]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "step_s": statistics.median(r["step_time_s"] for r in steps),
        "mfu": statistics.median(r["mfu"] for r in steps) if "mfu" in last else None,
        # `mfu` counts causal attention halved (MaxText since its PR #1988); runs before the field say nothing
        "mfu_convention": last.get("mfu_convention"),
        "mfu_full_attention": (
            statistics.median(r["mfu_full_attention"] for r in steps) if "mfu_full_attention" in last else None
        ),
        "hbm_peak_bytes": last.get("device_memory_peak_bytes"),
        "hbm_runtime_peak_bytes": last.get("device_memory_runtime_peak_bytes"),
        "compiled_bytes": last.get("device_memory_compiled_bytes"),
        "host_bytes": last.get("pinned_host_bytes_compiled"),
        "host_bytes_planned": last.get("pinned_host_bytes_planned"),
        "host_rss_peak_bytes": last.get("host_rss_peak_bytes"),
        "loss": last.get("loss"),
    }


def read_trace(directory: Path, link: dict | None) -> dict:
    """Exposed copy time and compute per traced step, and the floor the link sets."""
    from ferry.xla.profile_trace import newest_xplane, step_profiles

    try:
        profiles = step_profiles(newest_xplane(directory))
    except (FileNotFoundError, ValueError) as error:
        return {"trace": f"unreadable: {error}"}
    profiles = [p for p in profiles if p.step_ns > 0][-len(TRACED) :]
    if not profiles:
        return {"trace": "no steps in the trace"}
    mean = lambda values: sum(values) / len(values)
    record = {
        "exposed_copy_s": mean([p.exposed_copy_ns for p in profiles]) / 1e9,
        "traced_step_s": mean([p.step_ns for p in profiles]) / 1e9,
        "compute_s": mean([p.compute_ns for p in profiles]) / 1e9,
        "bytes_to_host": profiles[-1].bytes("to host"),
        "bytes_to_device": profiles[-1].bytes("to device"),
        "copies_per_step": len(profiles[-1].copies),
    }
    # how fast the copies ran inside the step: bytes over the time any copy of that direction was
    # in flight (against the link probe's rates, a copy slowed by the step's own traffic shows)
    for direction, key in (("to host", "to_host"), ("to device", "to_device")):
        busy = mean([p.link_busy_ns(direction) for p in profiles]) / 1e9
        record[f"link_busy_{key}_s"] = busy
        record[f"in_step_{key}_gbps"] = record[f"bytes_{key}"] / busy / 1e9 if busy > 0 else None
    if link:
        link_s = record["bytes_to_host"] / (link["to_host_gbps"] * 1e9) + record["bytes_to_device"] / (
            link["to_device_gbps"] * 1e9
        )
        record["link_s"] = link_s
        record["exposed_floor_step_s"] = max(0.0, link_s - record["compute_s"])  # the link against all compute
        # stores against the compute before the reloads start, reloads against the rest
        record["exposed_floor_s"] = (
            mean([p.exposed_floor_ns(link["to_host_gbps"], link["to_device_gbps"]) for p in profiles]) / 1e9
        )
        record["compute_before_reload_s"] = mean([p.compute_before_reload_ns for p in profiles]) / 1e9
    return record


def self_check_seconds(stdout: str) -> float | None:
    """What the start-up line says the self-check cost."""
    found = re.search(r"self-check[^\n]*?([\d.]+) ?s\b", stdout)
    return float(found[1]) if found else None


def measure_link_child(out: Path) -> None:
    """In a child: the link probe, both ways of reading it."""
    import jax

    from benchmarks.host_link import measure_traced, measure_wall_clock

    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    try:
        result["trace"] = vars(measure_traced())
    except Exception as error:  # a trace this reader cannot parse: the wall clock still answers
        result["trace_error"] = f"{type(error).__name__}: {error}"
    result["wall_clock"] = vars(measure_wall_clock())
    out.write_text(json.dumps(result))


def measure_link(timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "link.json"
        command = [sys.executable, __file__, "--link-child", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if done.returncode or not out.exists():
            return {"status": "failed", "message": (done.stdout + done.stderr)[-3000:]}
        return json.loads(out.read_text()) | {"status": "ok"}


def link_rates(link: dict) -> dict | None:
    """The rates the floor uses: the trace's where it read, else the wall clock's."""
    return link.get("trace") or link.get("wall_clock")


# what full_remat took before auto at the benchmark's shape on the chip (link probe included),
# 2026-12-07: 30 to 40 s
AUTO_AFTER_S = 40


def auto_budget_note(presets: list[str], budget_s: float) -> str | None:
    """A warning, before anything runs, where `--budget-s` cannot reach auto: it starts after
    full_remat and only with `AUTO_LEAST_S` left (twice on the chip, --budget-s 300 and 330
    skipped it after the cases before it had run)."""
    if "auto" not in presets or budget_s >= AUTO_LEAST_S + AUTO_AFTER_S:
        return None
    return (
        f"note: --budget-s {budget_s:g} will likely not start offload=auto: it starts after full_remat (about "
        f"{AUTO_AFTER_S} s) and only with {AUTO_LEAST_S} s left; give --budget-s {AUTO_LEAST_S + AUTO_AFTER_S} or more"
    )


def case_order(presets: list[str]) -> list[str]:
    """full_remat first (every ratio's baseline), then `auto` (what a user runs; its plan and timed
    candidates take 2 to 4 minutes, so it starts while the budget still holds them: last, it never
    started within the default budget, run 6), then the other presets as given, then the placements
    of `--case`."""
    first = [case for case in ("full_remat", "auto") if case in presets]
    return first + [case for case in presets if case not in first] + list(CUSTOM)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCH_ORDER))
    parser.add_argument("--presets", nargs="+", default=list(CASES), help=f"cases of each batch; default {CASES}")
    parser.add_argument("--seq", type=int, default=SEQ, help="the sequence length of every case")
    parser.add_argument("--budget-s", type=float, default=530, help="start no case after this many seconds")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--no-link", action="store_true")
    parser.add_argument(
        "--compile-workers",
        type=int,
        default=COMPILE_WORKERS,
        help="mode=compile processes at a time, compiling the cases' steps ahead on the CPU (0: each run compiles)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="copy each case's output, metrics and trace here")
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="LABEL=OVERRIDE,...",
        help="a placement of your own, run after the presets at each batch, e.g. "
        "mlp_out=offload=minimal,offload.tensors.mlpwi_0=offload",
    )
    parser.add_argument(
        "--extra", nargs="+", default=[], metavar="OVERRIDE", help="overrides added to every case and auto's plan"
    )
    parser.add_argument("--plot", type=Path, default=None, help="only draw the PNG and print the table of a JSON")
    parser.add_argument("--run", default=None, help="with --plot: the run to draw (a label's start); default: latest")
    parser.add_argument("--link-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.link_child:
        measure_link_child(args.link_child)
        return 0
    from benchmarks.tpu_report import markdown_table, plot_frontier

    if args.plot:
        results = json.loads(args.plot.read_text())
        print(markdown_table(results))
        print(plot_frontier(results, args.plot.with_suffix(".png"), args.run))
        return 0
    for spec in args.case:
        label, _, overrides = spec.partition("=")
        if not label or not overrides or label in CASES:
            parser.error(f"--case {spec!r}: give LABEL=override,override,... with a label that is not a preset")
        CUSTOM[label] = overrides.split(",")
    EXTRA.extend(args.extra)
    if (note := auto_budget_note(args.presets, args.budget_s)) is not None:
        print(note, flush=True)
    started = time.perf_counter()
    deadline = started + args.budget_s
    results: list[dict] = []
    order = [(case, batch) for batch in args.batches for case in case_order(args.presets) if case != "auto"]
    compiles = Compiles(order, args.seq, args.compile_workers) if args.compile_workers else None
    if compiles is not None:  # nothing is timed beside them (module docstring)
        print(f"compiled {len(order)} steps ahead in {compiles.wait():.0f} s", flush=True)
    link = {} if args.no_link else measure_link(timeout=120)
    if link:
        results.append({"preset": "host_link", "date": datetime.date.today().isoformat(), **link})
        print("host link:", json.dumps(link_rates(link)), flush=True)
    first = True
    for batch in args.batches:
        for case in case_order(args.presets):
            left = deadline - time.perf_counter()
            if left < least_time(case):
                results.append({"preset": case, "global_batch": batch, "status": "skipped: --budget-s spent"})
                continue
            ahead = compiled_ahead(compiles.get((case, batch)) if compiles else None, left)
            if ahead.get("status") == "oom":  # over HBM: the run would only say so again
                record = {"preset": case, "global_batch": batch, "seq_len": args.seq, **ahead}
                results.append(record | {"date": datetime.date.today().isoformat()})
                print(json.dumps(record), flush=True)
                continue
            # the first case also runs the gradient self-check, timing what train.check_policy costs
            check = first and case == "minimal_offloaded"
            first = first and not check
            rates = link_rates(link) if link else None
            left = deadline - time.perf_counter()
            record = run_case(case, batch, rates, max(left, 60), check, args.keep, args.seq) | ahead
            results.append(record)
            print(json.dumps(record), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")  # kept if a later case fails
    if compiles is not None:
        compiles.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown_table(results))
    print(plot_frontier(results, args.out.with_suffix(".png")))
    print(f"{time.perf_counter() - started:.0f} s in all; {COMMAND} on {datetime.date.today().isoformat()}")
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main())
