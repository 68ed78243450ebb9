"""A quiet terminal: the default run prints a few lines no wider than the terminal before its first
step; the whole start-up report goes to <run dir>/startup.txt, and log.verbose=true prints it."""

import io
import os
import subprocess
import sys

from rich.console import Console
from rich.table import Table

from ferry.run.startup import STARTUP_REPORT, StartupConsole, detail
from tests.conftest import ROOT, SMALL_RUN, run_launcher

COLUMNS = 100


def test_the_default_run_prints_a_few_lines_within_the_terminal_before_step_1(tmp_path):
    """The default command (two steps of it), on a fresh machine: its corpus is tokenized first.
    It runs in `tmp_path` with a relative run.dir, so the lines' widths are ferry's, not the path's."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "COLUMNS": str(COLUMNS), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [sys.executable, str(ROOT / "launch" / "run.py"), "train.steps=2", "train.warmup_steps=0", "run.dir=run"]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    before = lines[: next(i for i, line in enumerate(lines) if line.startswith("step "))]
    assert 3 <= len(before) <= 15, before
    assert max(len(line) for line in before) <= COLUMNS, before
    assert before[0].startswith("offload: minimal (default: the fastest measured preset")
    assert any(line[2:].startswith("tokenizing stdlib: ") for line in before), before  # after its spinner
    assert any(line.startswith("model llama_tiny: 131,392 parameters; ") for line in before), before
    assert before[-1] == f"run directory: run (details: {STARTUP_REPORT}, or log.verbose=true)"
    report = (run_dir / STARTUP_REPORT).read_text()
    for detail_line in ("platform cpu: no extra flags", "mesh data=1", "offload schedule: minimal", "compiled step"):
        assert detail_line in report and detail_line not in result.stdout
    assert "offload: minimal (default: no plan for this machine" in report
    assert "bfloat16 matmul measured on this CPU on" in report  # the peak MFU is against, measured once


def test_log_verbose_prints_the_start_up_report(tmp_path):
    run_dir = tmp_path / "run"
    result = run_launcher(*SMALL_RUN, "log.verbose=true", f"run.dir={run_dir}", old_default=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (run_dir / STARTUP_REPORT).read_text()
    for printed in ("platform cpu: no extra flags", "offload schedule: minimal", "│ decoder x2 │", "compiled step"):
        assert printed in result.stdout and printed in report
    assert "(details: " not in result.stdout  # nothing was left out


def test_details_reach_the_report_and_the_terminal_only_when_verbose(tmp_path):
    for verbose in (False, True):
        out = io.StringIO()
        console = StartupConsole(verbose, file=out, width=COLUMNS)
        console.print("note: printed")
        table = Table("tensor")
        table.add_row("query_proj")
        detail(console, table)
        detail(console, "a long detail line", brief="a brief")
        run_dir = tmp_path / str(verbose)
        run_dir.mkdir()
        assert console.write_report(run_dir) == run_dir / STARTUP_REPORT
        console.print("after the start")  # the report is written: not kept
        report = (run_dir / STARTUP_REPORT).read_text()
        assert "note: printed" in report and "query_proj" in report and "a long detail line" in report
        assert "a brief" not in report and "after the start" not in report
        printed = out.getvalue()
        assert ("query_proj" in printed) == verbose and ("a long detail line" in printed) == verbose
        assert ("a brief" in printed) != verbose and "after the start" in printed
    plain = io.StringIO()
    detail(Console(file=plain), "on a plain console", brief="never")  # tests' and tools' consoles print it all
    assert plain.getvalue() == "on a plain console\n"
