"""Models that only fit with ferry, on one v5e chip: each case `python launch/run.py ...` in a
process of its own (at most `--timeout-s`, 9 minutes by default), its record appended to
`benchmarks/results/capacity_tpu_v5e.json` with the command, the commit, the date, tokens/s, MFU,
the HBM peak, the pinned host bytes, the host RSS peak, the step time, the loss at the first and
last step, and the physical floors beside them:

- compute: the step's model FLOPs over the chip's bf16 peak (197 TFLOP/s);
- state: a state on host moves its master weights (4 B per parameter) and AdamW's moments (8 B)
  to HBM and back once per step: 12 B per parameter each way, over the host link both ways at
  once (25.7 GB/s measured, docs/results/tpu-v5e.md).

The parent watches the child's resident host memory and stops it above `--host-limit-gib` (36 GiB
of the VM's 40 by default): a run that would exhaust the VM is recorded as such instead of taking
the machine down with it. The record keeps the RSS every 2 s (`host_rss_timeline`: seconds, GiB)
and the RSS at each of the run's output lines (`host_rss_at_lines`), so where the host memory
grows (set-up, the compile, the state's init, the first step) can be read off it.

    python benchmarks/capacity_tpu.py --cases qwen3_1_7b
    python benchmarks/capacity_tpu.py --list
"""

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "capacity_tpu_v5e.json"
PEAK_FLOPS = 197e12  # one v5e chip, bf16
LINK_BOTH_WAYS = 25.7e9  # bytes/s, device<->host at once, inside a compiled program (docs/results/tpu-v5e.md)
STATE_BYTES_EACH_WAY = 12  # per parameter: float32 master weights and AdamW's two float32 moments
COMMON = (
    "platform=tpu",
    "data=stdlib",  # the built-in text corpus
    "train.log_every=1",
    "train.eval_batches=0",
    "train.check_policy=false",
    "checkpoint.final=false",
    "log.tensorboard=false",
)
STATE_ON_HOST = ("offload.optimizer=host", "offload.params=host")
PARAMETERS = {  # configs/model/<case's model>.yaml
    "qwen3_1_7b": 1_720_574_976,
    "qwen3_1_7b_b4": 1_720_574_976,
    "llama3_2_1b_64k": 1_235_814_400,
    "llama3_2_1b_64k_attention_offload": 1_235_814_400,
}
LONG = ("model=llama3_2_1b", "offload=full_remat", *STATE_ON_HOST, "train.seq_len=65536", "train.global_batch_size=1")
# the attention's residuals (its output and log-sum-exp) reloaded in the backward pass, not recomputed
ATTENTION_OFFLOAD = ("offload.tensors.attention_out=offload", "offload.tensors.attention_lse=offload")
CASES = {
    "qwen3_1_7b": (
        "model=qwen3_1_7b",
        "offload=full_remat",
        *STATE_ON_HOST,
        "train.seq_len=4096",
        "train.global_batch_size=64",
        "train.micro_batch_size=1",
        "train.steps=4",
        "train.warmup_steps=1",
    ),
    # the step that fits today (no micro batches): where the state's traffic stands beside a small step
    "qwen3_1_7b_b4": (
        "model=qwen3_1_7b",
        "offload=full_remat",
        *STATE_ON_HOST,
        "train.seq_len=4096",
        "train.global_batch_size=4",
        "train.steps=5",
        "train.warmup_steps=1",
    ),
    # 64k tokens of context: recomputing causal attention costs about S FLOPs per byte of its output,
    # so above about 14k tokens reloading it is the cheaper (docs/results/tpu-v5e.md, the chip's figures)
    "llama3_2_1b_64k": (*LONG, "train.steps=3", "train.warmup_steps=1"),
    "llama3_2_1b_64k_attention_offload": (*LONG, *ATTENTION_OFFLOAD, "train.steps=3", "train.warmup_steps=1"),
}


def run_case(name: str, timeout_s: float, host_limit: float) -> dict:
    """One case in its own process, stopped past `timeout_s` or `host_limit` bytes of RSS."""
    import psutil

    with tempfile.TemporaryDirectory(prefix=f"ferry-capacity-{name}-") as scratch:
        run_dir = Path(scratch) / "run"
        overrides = [*CASES[name], *COMMON, f"run.dir={run_dir}"]
        command = [sys.executable, str(ROOT / "launch" / "run.py"), *overrides]
        record = {"case": name, "command": "python launch/run.py " + " ".join(overrides[:-1]), "date": _today()}
        started = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        peak, stopped, samples = [0], [None], []
        threading.Thread(
            target=_watch, args=(psutil.Process(child.pid), host_limit, peak, stopped, samples), daemon=True
        ).start()
        lines, at_lines = [], []
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line)
            elapsed = time.perf_counter() - started
            rss_gib = round(samples[-1][1] / 2**30, 2) if samples else 0.0
            at_lines.append([round(elapsed, 1), rss_gib, line[:100].rstrip()])
            if time.perf_counter() - started > timeout_s:
                stopped[0] = stopped[0] or f"ran past {timeout_s:.0f} s"
                child.kill()
        child.wait()
        record |= {"process_s": round(time.perf_counter() - started, 1), "host_rss_watched_peak_bytes": peak[0]}
        record["host_rss_timeline"] = [[round(t, 1), round(rss / 2**30, 2)] for t, rss in samples[::4]]
        record["host_rss_at_lines"] = at_lines[:200]
        if stopped[0] or child.returncode != 0:
            return record | {"status": stopped[0] or f"exit {child.returncode}", "output_tail": "".join(lines[-15:])}
        floor = {"floor_state_s": state_floor_s(PARAMETERS[name]) if STATE_ON_HOST[0] in CASES[name] else 0.0}
        return record | read_metrics(run_dir / "metrics.jsonl") | floor | {"status": "ok"}


def _watch(process, host_limit: float, peak: list[int], stopped: list[str | None], samples: list) -> None:
    """Poll the child's (and its children's) RSS every 0.5 s into `samples` (seconds, bytes); kill
    it above `host_limit`."""
    import psutil

    started = time.perf_counter()
    while process.is_running():
        try:
            rss = process.memory_info().rss + sum(c.memory_info().rss for c in process.children(recursive=True))
        except psutil.Error:
            return
        peak[0] = max(peak[0], rss)
        samples.append((time.perf_counter() - started, rss))
        if rss > host_limit:
            stopped[0] = f"host memory past {host_limit / 2**30:.0f} GiB (RSS {rss / 2**30:.1f} GiB): stopped"
            process.kill()
            return
        time.sleep(0.5)


def read_metrics(path: Path) -> dict:
    """The step records: the steps after the first (which compiles) timed, the memory of the last."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "tokens_per_s" in r]
    timed = steps[1:] or steps
    last = steps[-1]
    step_s = sorted(r["step_time_s"] for r in timed)[len(timed) // 2]
    flops = last["tflops_per_s_per_device"] * 1e12 * step_s  # the model FLOPs of a step, per device
    return {
        "tokens_per_s": sorted(r["tokens_per_s"] for r in timed)[len(timed) // 2],
        "step_s": step_s,
        "mfu": last.get("mfu"),
        "hbm_peak_bytes": last.get("device_memory_peak_bytes"),
        "compiled_bytes": last.get("device_memory_compiled_bytes"),
        "pinned_host_bytes": last.get("pinned_host_bytes_compiled"),
        "host_rss_peak_bytes": last.get("host_rss_peak_bytes"),
        "loss_first": steps[0].get("loss"),
        "loss_last": last.get("loss"),
        "steps": [r.get("step") for r in steps],
        "floor_compute_s": flops / PEAK_FLOPS,
    }


def state_floor_s(parameters: int) -> float:
    """The update's state traffic of a state on host: 12 B per parameter each way, both at once."""
    return 2 * STATE_BYTES_EACH_WAY * parameters / LINK_BOTH_WAYS


def _today() -> str:
    return datetime.date.today().isoformat()


def _commit() -> str | None:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return result.stdout.strip() or None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--timeout-s", type=float, default=540.0)
    parser.add_argument("--host-limit-gib", type=float, default=36.0)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD, if any)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    args = parser.parse_args()
    if args.list:
        for name, overrides in CASES.items():
            print(name, " ".join(overrides))
        return 0
    records = json.loads(args.out.read_text()) if args.out.exists() else []
    for name in args.cases:
        record = run_case(name, args.timeout_s, args.host_limit_gib * 2**30)
        record["commit"] = args.commit or _commit()
        record["machine"] = "one TPU v5e chip"
        print(json.dumps(record), flush=True)
        records.append(record)
        args.out.write_text(json.dumps(records, indent=1) + "\n")  # after every case: a lost machine keeps the rest
    return 0


if __name__ == "__main__":
    sys.exit(main())
