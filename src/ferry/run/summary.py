"""The lines a finished run ends with: where it got to (the final train and held-out loss), how
fast (tokens/s, MFU), and where its outputs are (the run directory, the last checkpoint, the
profile trace), so a user need not scroll back past the progress bar or open metrics.jsonl."""

import json
import statistics
from pathlib import Path
from typing import Any


def metric_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (none where this process writes none, or a line is cut)."""
    path = run_dir / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def last_checkpoint(directory: Path) -> Path | None:
    """The newest finished checkpoint (Orbax's step directories; unfinished saves carry a suffix)."""
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
    return directory / str(max(steps)) if steps else None


def _latest(records: list[dict[str, Any]], key: str) -> str:
    record = next((r for r in reversed(records) if key in r), None)
    return "-" if record is None else f"{record[key]:.4f} (step {record['step']})"


def _speed(records: list[dict[str, Any]], since_step: int) -> str:
    """The median tokens/s and MFU of this run's logged steps (the first, which may wait on
    one-time work, left out where there are others)."""
    timed = [r for r in records if "tokens_per_s" in r and r["step"] > since_step]
    if len(timed) > 1:
        timed = timed[1:]
    if not timed:
        return "no step logged"
    tokens = statistics.median(r["tokens_per_s"] for r in timed)
    text = f"{tokens:,.0f} tokens/s"
    if all("mfu" in r for r in timed):
        text += f", MFU {100 * statistics.median(r['mfu'] for r in timed):.1f}%"
    return f"{text} (median of {len(timed)} logged step(s))"


def run_summary(run_dir: Path, step: int, steps: int, start: int, profile_dir: Path | None) -> str:
    """The run's closing lines: at `step` of `steps`, having started at `start` (a resumed run's
    checkpoint, else 0); `profile_dir` where profile.start_step asked for a trace."""
    records = metric_records(run_dir)
    checkpoint = last_checkpoint(run_dir / "checkpoints")
    where = "done" if step >= steps else "stopped"
    lines = [
        f"summary: {where} at step {step} of {steps}",
        f"  train loss {_latest(records, 'loss')}, eval loss {_latest(records, 'eval_loss')}",
        f"  speed: {_speed(records, start)}",
        f"  run directory: {run_dir}",
        f"  last checkpoint: {checkpoint or 'none'}",
    ]
    if profile_dir is None:
        lines.append("  profile trace: none (profile.start_step=N traces profile.steps steps)")
    elif profile_dir.is_dir():
        lines.append(f"  profile trace: {profile_dir} (XProf or TensorBoard's profile plugin)")
    return "\n".join(lines)
