"""offload=auto's candidates compiled for the TPU on this machine's CPU before they are timed on its
chip (`offload.auto.measure`): each candidate's run step (`ferry.run.precompile`) in a process of
its own, all at once, at a low CPU priority, into the compilation cache its measuring process then
loads, instead of compiling one after the other on the chip's host (most of a case's start at the
v5e benchmark's shape: docs/results/tpu-v5e.md, run 6). A compile that fails costs nothing but its
time: the measuring process then compiles for itself."""

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ferry.plan.auto import Tried

COMPILE_TIMEOUT_S = 600.0
NICENESS = 10  # below the process on the chip, which needs the CPU too


def compile_in_subprocesses(
    nodes: Sequence[Mapping[str, Any]], target: str, timeout_s: float = COMPILE_TIMEOUT_S
) -> list[str]:
    """Each run config `node`'s train step compiled for `target` in its own process, all at once;
    one line each: what it compiled in how long, or why it did not."""
    with tempfile.TemporaryDirectory(prefix="ferry-compile-ahead-") as directory:
        children = []
        for number, node in enumerate(nodes):
            request, result = Path(directory) / f"{number}.json", Path(directory) / f"{number}.out"
            request.write_text(json.dumps(node))
            command = [sys.executable, "-m", "ferry.run.compile_ahead", target, str(request), str(result)]
            # precompile allows itself beside the planning process's libtpu (ALLOW_MULTIPLE_LIBTPU_LOAD)
            child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            children.append((child, result))
        return [_outcome(child, result, timeout_s) for child, result in children]


def subprocess_compiler(
    run_node: Callable[[int, Tried], dict[str, Any]], target: str
) -> Callable[[Sequence[tuple[int, Tried]]], list[str]]:
    """`compile_ahead` for `measure_candidates` on a TPU: the candidates' runs, as
    `subprocess_measurer` times them, compiled for `target` on the CPU all at once
    (`compile_in_subprocesses`), so each measuring process loads its step from the cache."""
    return lambda numbered: compile_in_subprocesses([run_node(n, c) for n, c in numbered], target)


def _outcome(child: subprocess.Popen, result: Path, timeout_s: float) -> str:
    try:
        output, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return f"not compiled within {timeout_s:.0f} s"
    if result.exists():
        return result.read_text()
    tail = output.decode(errors="replace").strip().splitlines()[-3:]
    return f"not compiled (exit {child.returncode}): " + " | ".join(tail)[-400:]


def main(argv: list[str]) -> int:
    """`python -m ferry.run.compile_ahead TARGET REQUEST RESULT`: compile the run config in
    REQUEST (JSON) for TARGET; write the line saying what was compiled, or why not, to RESULT."""
    import dataclasses
    import io

    from rich.console import Console

    from ferry.config.root import load_config
    from ferry.errors import FerryError
    from ferry.run.precompile import precompile

    os.nice(NICENESS)
    target, request, result = argv[0], Path(argv[1]), Path(argv[2])
    try:
        config = load_config(json.loads(request.read_text()))
        compiling = dataclasses.replace(config, mode="compile", target=target)
        result.write_text(precompile(compiling, Console(file=io.StringIO())))
    except FerryError as error:
        result.write_text("not compiled: " + " ".join(str(error).split()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
