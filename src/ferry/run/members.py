"""What a run directory holds, checked before anything in it is touched: each member ferry
writes must be of its kind (a file or a directory) and writable, and every checkpoint step a
directory. A refused start leaves the directory byte for byte as it was."""

import os
from pathlib import Path

from ferry.run.details_log import DETAILS_LOG
from ferry.run.lock import LOCK_FILE, RunDirectoryError
from ferry.run.run_record import RUN_RECORD

# the members ferry writes or rewrites, and whether each is a directory
MEMBERS = {
    "checkpoints": True,
    "tensorboard": True,
    "profile": True,
    "metrics.jsonl": False,
    "config.yaml": False,
    "schedule.json": False,
    LOCK_FILE: False,
    RUN_RECORD: False,
    DETAILS_LOG: False,
}


def _writable(path: Path, is_dir: bool) -> bool:
    """access(2) also refuses writing to an immutable inode and a read-only file system, for root too."""
    return os.access(path, os.W_OK | (os.X_OK if is_dir else 0))


def check_members(run_dir: Path, resuming: bool) -> None:
    """Refuse, naming the member and the fix, when `run_dir` or a member is of the wrong kind or
    not writable, or a checkpoint step is not a directory. A resumed run keeps its first
    config.yaml (it writes its own beside it), which may then be read-only."""
    if not run_dir.is_dir():
        return  # a new directory: nothing to check yet
    if not _writable(run_dir, True):
        raise RunDirectoryError(
            f"run.dir={run_dir} is not writable (permission denied, immutable or a read-only file system); "
            "make it writable, or pass another run.dir"
        )
    fix = "move it aside (nothing was changed) or pass another run.dir"
    for name, is_dir in MEMBERS.items():
        path = run_dir / name
        if not path.exists() and not path.is_symlink():
            continue
        if path.is_dir() != is_dir:
            found, wanted = ("a directory", "a file") if path.is_dir() else ("a file", "a directory")
            raise RunDirectoryError(f"run.dir={run_dir}: {path} is {found}, where ferry keeps {wanted}; {fix}")
        if not _writable(path, is_dir) and not (resuming and name == "config.yaml"):
            raise RunDirectoryError(
                f"run.dir={run_dir}: {path} is not writable (permission denied, immutable or a read-only file "
                f"system); make it writable, or {fix}"
            )
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        for entry in checkpoints.iterdir():
            if entry.name.isdigit() and not entry.is_dir():
                raise RunDirectoryError(
                    f"run.dir={run_dir}: checkpoint step {entry.name} ({entry}) is not a directory, so it holds "
                    f"no checkpoint; {fix}"
                )
