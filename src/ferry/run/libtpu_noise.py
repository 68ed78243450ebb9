"""libtpu's start-up complaints, off the terminal of a deviceless compile.

`mode=plan` and `mode=compile` load libtpu on a machine that is no TPU VM (or compile for a TPU
the machine does not have), and libtpu says so on file descriptor 2 from C++ (absl logging,
before anything could configure it): "could not determine TPU accelerator type", "E0000 ...
unexpected worker hostname", "=== Source Location Trace: ===" and its file lines. None of it is
wrong for a compile that needs no chip. `quiet_libtpu` runs a block with fd 2 read through a pipe
that drops those lines and passes every other one on as it comes: a real error stays visible."""

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

NOISE = (
    "Failed to find host bounds for accelerator type",
    "could not determine TPU accelerator type",
    "WARNING: Logging before InitGoogle() is written to STDERR",
    "unexpected worker hostname",
    "=== Source Location Trace: ===",
)
# the lines of a Source Location Trace: a source file and line, e.g. learning/.../libtpu_init_utils.cc:370
TRACE_LINE = re.compile(r"^\s*[\w./-]+\.(cc|h|cpp):\d+\s*$")


class NoiseFilter:
    """Whether each line of libtpu's stderr is noise (a trace's file lines follow its header)."""

    def __init__(self) -> None:
        self.in_trace = False

    def is_noise(self, line: str) -> bool:
        if any(marker in line for marker in NOISE):
            self.in_trace = "Source Location Trace" in line
            return True
        if self.in_trace and TRACE_LINE.match(line):
            return True
        self.in_trace = False
        return False


def filtered(text: str) -> str:
    """`text` without libtpu's start-up noise."""
    noise = NoiseFilter()
    return "".join(line for line in text.splitlines(keepends=True) if not noise.is_noise(line))


@contextlib.contextmanager
def quiet_libtpu() -> Iterator[None]:
    """Run the block with file descriptor 2 (this process's, and any child's it starts) passed
    through `NoiseFilter`, line by line as written."""
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        noise = NoiseFilter()
        with os.fdopen(read_end, "rb") as lines:
            for raw in lines:
                if not noise.is_noise(raw.decode(errors="replace")):
                    try:
                        os.write(terminal, raw)
                    except OSError:  # the block is over and fd 2 restored: nowhere left to write
                        return

    forwarder = threading.Thread(target=forward, name="libtpu-stderr-filter", daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # closes the pipe's last writer in this process: the forwarder drains and ends
        forwarder.join(timeout=10)  # a child still holding the pipe does not hold the launcher
        os.close(terminal)
