"""Run many `launch/run.py` commands in one Python process and print each one's exit status and
output as JSON: `python -m tests.launcher_cases < cases.json` (a list of argument lists).

Each case calls the launcher's `main(argv)`, the function `python launch/run.py ARGV...` exits
with, with stdout and stderr captured; an exception escaping `main` is recorded with its
traceback (as the interpreter would print it) and exit status 1. One process pays JAX's and
Hydra's start-up once, so a table of refusals runs in seconds. Only commands that share the
process's platform (the CPU, no extra flags) can share it; others need a process of their own.
"""

import contextlib
import importlib.util
import io
import json
import sys
import traceback
from pathlib import Path

from tests.old_default import with_old_default

LAUNCHER = Path(__file__).resolve().parent.parent / "launch" / "run.py"


def load_script(name: str):
    """A script of launch/ as a module (its `__main__` block not run)."""
    spec = importlib.util.spec_from_file_location(f"ferry_{Path(name).stem}", LAUNCHER.parent / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_launcher():
    return load_script(LAUNCHER.name)


def run_case(launcher, argv: list[str]) -> dict:
    """One command's exit status and output (with offload=minimal_offloaded where it names no
    preset: `tests.old_default`)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = launcher.main(list(with_old_default(tuple(argv))))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # what the interpreter would print for an uncaught exception
            traceback.print_exc()
            code = 1
    return {"argv": argv, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    launcher = load_launcher()
    cases = json.load(sys.stdin)
    print(json.dumps([run_case(launcher, argv) for argv in cases]))
