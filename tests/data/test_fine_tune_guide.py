"""docs/guides/fine-tune.md runs as written: every command of its bash blocks, in order, in a
fresh directory (the repository's launchers and chat fixture named by their paths), and what the
page says of the result holds: the replies' held-out loss falls, eval.py scores the two saves
into runs/chat/eval.jsonl, and the fine-tuned model is exported."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_readme import shell_commands

GUIDE = ROOT / "docs" / "guides" / "fine-tune.md"


def guide_commands() -> list[list[str]]:
    """The page's commands, with this interpreter and the repository's files."""
    commands = []
    for words in shell_commands(GUIDE.read_text()):
        words = [sys.executable if w == "python" else w for w in words]
        words = [str(ROOT / w) if w.startswith("launch/") else w for w in words]
        commands.append([w.replace("tests/data/chat", str(ROOT / "tests" / "data" / "chat")) for w in words])
    return commands


def test_the_guide_names_its_steps():
    scripts = [next(w for w in c if w.endswith(".py")).rsplit("/", 1)[-1] for c in guide_commands()]
    assert scripts == ["run.py", "export_hf.py", "run.py", "eval.py", "eval.py", "export_hf.py"]


@pytest.mark.slow  # about a minute: four launcher starts; test_chat.py and test_eval_launcher.py cover the pieces
def test_the_fine_tune_guide_runs_end_to_end(tmp_path):
    env = {**os.environ, "COLUMNS": "120"}
    for command in guide_commands():
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, " ".join(command) + "\n" + done.stdout + done.stderr
    metrics = [json.loads(line) for line in (tmp_path / "runs/chat/metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in metrics if "eval_loss" in r}
    assert evals[0] > 5.0 and evals[40] < 3.0, evals
    scored = [json.loads(line) for line in (tmp_path / "runs/chat/eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in scored] == [20, 40]
    assert scored[1]["loss"] < scored[0]["loss"] and scored[1]["loss"] == pytest.approx(evals[40], rel=0.05)
    assert (tmp_path / "hf/tiny-chat/config.json").is_file()
