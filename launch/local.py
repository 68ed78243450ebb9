"""Run `launch/run.py` as several processes on this machine, joined by `jax.distributed` over
localhost: a multi-host job in miniature (on CPU the processes exchange data through gloo).

    python launch/local.py --processes 2 -- model=llama_tiny mesh.data=2 train.steps=50

Every process gets the same overrides plus its `distributed.*` settings; process 0 prints and
writes the run directory. If one process fails, the others are stopped and its exit code is
returned.
"""

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

RUN = Path(__file__).resolve().parent / "run.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def process_command(overrides: list[str], port: int, processes: int, process_id: int) -> list[str]:
    return [
        sys.executable,
        str(RUN),
        *overrides,
        f"distributed.coordinator_address=localhost:{port}",
        f"distributed.num_processes={processes}",
        f"distributed.process_id={process_id}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2, help="how many processes (default 2)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for launch/run.py, after --")
    args = parser.parse_args()
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    port = free_port()
    children = [
        subprocess.Popen(process_command(args.overrides, port, args.processes, index))
        for index in range(args.processes)
    ]
    try:
        return supervise(children)
    except KeyboardInterrupt:  # the terminal's Ctrl-C reached the children too: let them stop
        for child in children:
            try:
                child.wait(timeout=INTERRUPT_WAIT_S)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                child.kill()
        print("interrupted: every process stopped; the same command resumes from the run's latest checkpoint")
        return 130


# seconds each process gets to stop by itself after Ctrl-C before it is killed
INTERRUPT_WAIT_S = 30


def supervise(children: list[subprocess.Popen]) -> int:
    """Wait for the processes: the first failure's exit code (the others stopped), else 0."""
    while True:
        codes = [child.poll() for child in children]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            for child in children:
                if child.poll() is None:
                    child.terminate()
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
