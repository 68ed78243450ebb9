"""The lines a finished run ends with (`ferry.run.summary`)."""

import json

from ferry.run.summary import last_checkpoint, run_summary


def write_run(run_dir, records, checkpoints=()):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"cut')
    for name in checkpoints:
        (run_dir / "checkpoints" / name).mkdir(parents=True)


RECORDS = [
    {"step": 0, "eval_loss": 5.6},
    {"step": 1, "loss": 5.5, "tokens_per_s": 100.0, "mfu": 0.01},  # compiling: left out of the median
    {"step": 2, "loss": 5.0, "tokens_per_s": 1000.0, "mfu": 0.2},
    {"step": 3, "loss": 4.5, "tokens_per_s": 3000.0, "mfu": 0.4},
    {"step": 4, "loss": 4.25, "tokens_per_s": 2000.0, "mfu": 0.3, "eval_loss": 4.5},
]


def test_summary_of_a_finished_run(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, RECORDS, ("2", "4", "6.orbax-checkpoint-tmp-1"))
    text = run_summary(run_dir, 4, 4, 0, None)
    assert text.splitlines() == [
        "summary: done at step 4 of 4",
        "  train loss 4.2500 (step 4), eval loss 4.5000 (step 4)",
        "  speed: 2,000 tokens/s, MFU 30.0% (median of 3 logged step(s))",
        f"  run directory: {run_dir}",
        f"  last checkpoint: {run_dir / 'checkpoints' / '4'}",
        "  profile trace: none (profile.start_step=N traces profile.steps steps)",
    ]


def test_summary_of_a_stopped_resumed_profiled_run(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, [{k: v for k, v in r.items() if k != "mfu"} for r in RECORDS])
    (run_dir / "profile").mkdir()
    text = run_summary(run_dir, 4, 10, 3, run_dir / "profile")
    assert "summary: stopped at step 4 of 10" in text
    assert "speed: 2,000 tokens/s (median of 1 logged step(s))" in text  # since the resumed step; no MFU logged
    assert "last checkpoint: none" in text
    assert f"profile trace: {run_dir / 'profile'}" in text


def test_no_metrics_no_checkpoints(tmp_path):
    assert last_checkpoint(tmp_path / "missing") is None
    text = run_summary(tmp_path, 0, 5, 0, None)
    assert "train loss -, eval loss -" in text and "speed: no step logged" in text
