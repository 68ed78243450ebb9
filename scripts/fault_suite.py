"""The fault suite: a small run of `launch/run.py` stopped by SIGTERM at each moment a preemption
can come (the compile, a step, a checkpoint's save, an evaluation), then resumed with the same
command; each line of the table says how the stop ended (exit status, its last line, what it
left) and whether the resumed run's losses equal an uninterrupted run's bit for bit.

    python scripts/fault_suite.py            # a markdown table on stdout, about a minute per case on a CPU

Disk full, read-only and immutable files are the tests' (tests/run/test_save_faults.py,
tests/run/test_resume_identity.py): they need a file system made for them.
"""

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = (
    "model=llama_tiny",
    "data=synthetic",
    "train.steps=12",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.eval_every=4",
    "train.eval_batches=2",
    "train.global_batch_size=8",
    "train.seq_len=64",
    "checkpoint.every=3",
    "log.tensorboard=false",
    "train.check_policy=false",
)


def launch(run_dir: Path) -> subprocess.Popen:
    command = [sys.executable, str(ROOT / "launch" / "run.py"), *RUN, f"run.dir={run_dir}"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def output_shows(text: str) -> Callable[[subprocess.Popen, Path, list[str]], bool]:
    return lambda process, run_dir, lines: any(text in line for line in lines)


def step_logged(step: int, key: str = "loss") -> Callable[[subprocess.Popen, Path, list[str]], bool]:
    return lambda process, run_dir, lines: any(r.get("step") == step and key in r for r in records(run_dir))


MOMENTS = {
    "the compile": output_shows("loss head:"),
    "a step (step 5)": step_logged(5),
    "a save (step 6's)": step_logged(6),  # checkpoint.every=3: step 6's save starts as its record is written
    "an evaluation (step 8's)": step_logged(7),  # eval_every=4: the evaluation after step 8 follows step 7
}


def stopped_at(moment: str, run_dir: Path) -> tuple[int, str]:
    """Run until `moment`, SIGTERM; the exit status and the last line printed."""
    process = launch(run_dir)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        if MOMENTS[moment](process, run_dir, lines):
            process.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    process.wait(timeout=300)
    reader.join(timeout=10)
    last = next((line for line in reversed(lines) if line.strip()), "")
    return process.returncode, last.strip()


def resumed(run_dir: Path) -> int:
    process = launch(run_dir)
    process.communicate(timeout=600)
    return process.returncode


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ferry-faults-") as scratch:
        reference = Path(scratch) / "reference"
        if resumed(reference) != 0:
            print("the uninterrupted run failed", file=sys.stderr)
            return 1
        expected = losses(reference)
        print("| SIGTERM during | exit | last line | left behind | resumed | losses vs uninterrupted |")
        print("|---|---|---|---|---|---|")
        for number, moment in enumerate(MOMENTS):
            run_dir = Path(scratch) / f"case{number}"
            code, last = stopped_at(moment, run_dir)
            saved = sorted(p.name for p in (run_dir / "checkpoints").glob("[0-9]*")) if run_dir.exists() else []
            nothing = "nothing" if not run_dir.exists() else "no checkpoint"
            left = f"checkpoints {', '.join(saved)}" if saved else nothing
            again = resumed(run_dir)
            got = losses(run_dir)
            differing = sorted(s for s in expected if got.get(s) != expected[s])
            same = "equal, bit for bit" if not differing else f"differ at steps {differing}"
            print(f"| {moment} | {code} | {last[:90]} | {left} | exit {again} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
