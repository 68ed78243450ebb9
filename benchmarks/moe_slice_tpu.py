"""A DeepSeek-V3-width slice trained on one TPU chip, beside its dense layer alone, in one run.

The slice: DeepSeek-V3's widths (dim 7168, MLA, dense FFN 18432, experts of 2048) with 1 dense
layer and 1 DeepSeekMoE layer of 16 routed experts (top 8) and the shared one, vocabulary 32,768
and no MTP block (1.99B parameters: the full vocabulary and MTP make 4.4B, whose 49 GiB of train
state outgrow a v5e VM's 40 GiB of RAM), batch 1 x sequence 2048, full_remat, the float32 master
weights and AdamW's moments in pinned host memory (`offload.params=host offload.optimizer=host`),
streamed through HBM by the update in pieces of at most `offload.stream_mib`. Each slice is
`python launch/run.py ...` in a process of its own; the two-layer steps are compiled ahead on the CPU
(`mode=compile`), side by side, before any slice is timed.

    python benchmarks/moe_slice_tpu.py [--out moe_slice.json] [--extra OVERRIDE ...] [--prefetch]

`--prefetch` also runs the two-layer slice with `offload.stream_prefetch=true` (each step of the
update's loops fetching the next step's state while it writes back its own) and prints its step
against the same slice without.

Prints per slice tokens/s, MFU, the step, the HBM peak against the compiled arguments +
temporaries, and the state streamed each way per step with the floor the host link (measured in
the same run) sets for moving it: one way after the other, and both ways at once. The MoE layer's
share of the two-layer step is 1 - t(dense) / t(dense + MoE): what adding it costs, its state's
streaming included.
"""

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks.* from anywhere

from benchmarks.tpu_check import TIMED, link_rates, measure_link, read_metrics, refusal, timed_output  # noqa: E402

SLICE = (
    "model=deepseek_v3",
    "model.num_experts=16",
    "model.vocab_size=32768",
    "model.mtp_depth=0",
    "model.num_dense_layers=1",
    "train.seq_len=2048",
    "train.global_batch_size=1",
    "offload=full_remat",
    "offload.optimizer=host",
    "offload.params=host",
    "data=synthetic",
    "platform=tpu",
    f"train.steps={max(TIMED)}",
    "train.log_every=1",
    "train.eval_batches=0",
    "train.check_policy=false",
    "checkpoint.final=false",
    "log.tensorboard=false",
)
LAYERS = {"dense": 1, "dense+moe": 2, "dense+moe, prefetch": 2}
PREFETCH = "dense+moe, prefetch"  # the two-layer slice with offload.stream_prefetch=true (--prefetch)
OVERRIDES = {PREFETCH: ["offload.stream_prefetch=true"]}
COMMAND = "python benchmarks/moe_slice_tpu.py"


def launch(overrides: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "launch" / "run.py"), *overrides]


def state_each_way(output: str) -> int | None:
    """The train state the update streams each way per step, from the run's start-up line."""
    found = re.search(r"train state in pinned host ([\d.]+) GiB, each way per step", output)
    return int(float(found[1]) * 2**30) if found else None


def link_floor(state_bytes: int | None, rates: dict | None) -> dict:
    """Seconds the measured link needs to move the state down and back: one way after the other,
    and both at once."""
    if not state_bytes or not rates:
        return {}
    gb = state_bytes / 1e9
    serial = gb / rates["to_device_gbps"] + gb / rates["to_host_gbps"]
    return {"link_serial_s": serial, "link_both_ways_s": 2 * gb / rates["both_gbps"]}


def slice_dir(work: Path, name: str) -> Path:
    """The slice's run directory, named without the commas and spaces a Hydra override refuses."""
    return work / re.sub(r"\W+", "_", name)


def run_slice(name: str, overrides: list[str], rates: dict | None, timeout: float, work: Path) -> dict:
    run_dir = slice_dir(work, name)
    returncode, output = timed_output(launch([*overrides, f"run.dir={run_dir}"]), timeout)
    record = {"slice": name, "layers": LAYERS[name], "date": datetime.date.today().isoformat()}
    if returncode is None:
        return record | {"status": "timeout", "message": output[-2000:]}
    if returncode != 0:
        return record | refusal(output, returncode)
    record |= read_metrics(run_dir / "metrics.jsonl") | {"state_each_way_bytes": state_each_way(output)}
    return record | link_floor(record["state_each_way_bytes"], rates) | {"status": "ok"}


def report(records: list[dict]) -> str:
    gib = lambda b: f"{b / 2**30:.2f}" if b else "-"
    lines = [
        "| slice | tokens/s | MFU | step s | HBM peak GiB (compiled) | state each way GiB | link: serial s | "
        "link: both ways s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['slice']} | {r['status']} | | | | | | |")
            continue
        lines.append(
            f"| {r['slice']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['step_s']:.3f} | "
            f"{gib(r['hbm_peak_bytes'])} ({gib(r['compiled_bytes'])}) | {gib(r['state_each_way_bytes'])} | "
            f"{r.get('link_serial_s', 0):.2f} | {r.get('link_both_ways_s', 0):.2f} |"
        )
    done = {r["slice"]: r for r in records if r["status"] == "ok"}
    if "dense" in done and "dense+moe" in done:
        share = 1 - done["dense"]["step_s"] / done["dense+moe"]["step_s"]
        lines.append(f"the MoE layer's share of the dense+moe step: {share:.1%}")
    if "dense+moe" in done and PREFETCH in done:
        speedup = done["dense+moe"]["step_s"] / done[PREFETCH]["step_s"]
        lines.append(f"prefetching the update's state: {speedup:.3f}x the dense+moe step's speed")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("moe_slice.json"))
    parser.add_argument("--extra", nargs="+", default=[], metavar="OVERRIDE", help="added to both slices")
    parser.add_argument("--timeout-s", type=float, default=240, help="per slice")
    parser.add_argument("--prefetch", action="store_true", help="the two-layer slice again, prefetching")
    parser.add_argument("--compile-timeout-s", type=float, default=420, help="the two-layer steps' compiles ahead")
    args = parser.parse_args()
    names = [name for name in LAYERS if args.prefetch or name != PREFETCH]
    link = measure_link(timeout=120)
    rates = link_rates(link) if link.get("status") == "ok" else None
    records: list[dict] = [{"slice": "host_link", "date": datetime.date.today().isoformat(), **link}]
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        cache = f"platform.compilation_cache={work / 'cache'}"
        overrides = {
            name: [*SLICE, f"model.num_layers={LAYERS[name]}", cache, *OVERRIDES.get(name, []), *args.extra]
            for name in names
        }
        compiling = []  # the two-layer steps compiled ahead, side by side, before any slice is timed
        for index, name in enumerate(n for n in names if LAYERS[n] == 2):
            ahead = launch([*overrides[name], "mode=compile", "target=v5e", f"run.dir={work / f'compile{index}'}"])
            compiling.append(subprocess.Popen(ahead, cwd=ROOT, stdout=subprocess.PIPE, text=True))
        for process in compiling:  # a slice timed beside them would run slow (tpu_check's docstring)
            process.communicate(timeout=args.compile_timeout_s)
        for name in names:
            records.append(
                run_slice(name, overrides[name], rates, args.timeout_s, work) | {"overrides": overrides[name]}
            )
            args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(report(records[1:]))
    print(f"{COMMAND} on {datetime.date.today().isoformat()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
