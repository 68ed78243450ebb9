"""`mode=plan`'s terminal: tables within 100 columns, no empty table, and none of libtpu's
complaints about a machine that is no TPU VM (a real error on stderr still shows)."""

import os
import subprocess
import sys

from ferry.run.libtpu_noise import filtered, quiet_libtpu
from tests.conftest import ROOT, needs_libtpu

LIBTPU_NOISE = """Failed to find host bounds for accelerator type: WARNING: could not determine TPU accelerator type
WARNING: Logging before InitGoogle() is written to STDERR
E0000 00:00:1796689370.927822   11145 common_lib.cc:860] INVALID_ARGUMENT: Error: unexpected worker hostname 'x'
=== Source Location Trace: ===
learning/45eac/tfrc/runtime/libtpu_init_utils.cc:370
"""
REAL = "E0000 00:00:1.0 1 compiler.cc:99] RESOURCE_EXHAUSTED: Ran out of memory\nTraceback (most recent call last):\n"


@needs_libtpu
def test_a_deviceless_v5e_plan_prints_narrow_tables_no_empty_one_and_no_libtpu_noise(tmp_path):
    env = {**os.environ, "COLUMNS": "100"}
    command = [sys.executable, str(ROOT / "launch" / "run.py"), "mode=plan", "target=v5e", f"run.dir={tmp_path}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    for noise in ("unexpected worker hostname", "Source Location Trace", "E0000", "InitGoogle"):
        assert noise not in result.stderr, result.stderr
    lines = result.stdout.splitlines()
    table_lines = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert len(table_lines) >= 10 and max(len(line) for line in table_lines) <= 100, result.stdout
    for above, below in zip(lines, lines[1:], strict=False):
        assert not (above.startswith("┡") and below.startswith("└")), result.stdout  # a header and no row
    assert "full_remat: the compiled program checked, no host copies; nothing rematerialised" in result.stdout
    assert "every row: arguments" in result.stdout  # what every preset shares, said once


def test_the_filter_drops_libtpus_noise_and_keeps_real_errors(capfd):
    assert filtered(LIBTPU_NOISE + REAL) == REAL
    with quiet_libtpu():
        os.write(2, (LIBTPU_NOISE + REAL).encode())
        subprocess.run([sys.executable, "-c", f"import sys; sys.stderr.write({LIBTPU_NOISE!r} + 'child error\\n')"])
    err = capfd.readouterr().err
    assert err == REAL + "child error\n", err
