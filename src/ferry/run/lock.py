"""One writer per run directory: process 0 holds an exclusive lock on `<run dir>/ferry.lock` for
the run's life, so a second launch into the same directory (a double submit, a scheduler's
requeue while the first job still runs) is refused naming the holder instead of interleaving
two runs' checkpoints and metrics.

The lock is `flock` on an open file: the kernel releases it when the holder exits in any way,
SIGKILL included, so a dead holder never blocks a retry. The file holds the holder's host, pid
and start time while held and is emptied on a clean release; finding it non-empty when the lock
was free means the last holder died, which is said in one line. The file stays in a directory
whose run started (it marks the directory as ferry's); a run refused before writing anything
takes its lock file, and the directory if it made it, away again.
"""

import dataclasses
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from ferry.errors import FerryError

LOCK_FILE = "ferry.lock"


class RunDirectoryError(FerryError, FileExistsError):
    """The chosen run directory already holds a run that this command may not continue."""


@dataclasses.dataclass
class RunLock:
    """A held lock on a run directory; `stale_holder` describes a dead holder it took over."""

    directory: Path
    fd: int
    created_from: Path | None  # the outermost directory this lock made (the run directory or a parent of it)
    created_file: bool  # the lock file did not exist before
    stale_holder: str | None
    started: bool = False  # the run has written into the directory: keep the lock file as its mark
    previous: str = ""  # the lock file's text before this lock wrote its holder into it

    def release(self) -> None:
        """Give the lock up (idempotent). A run that never started leaves the directory as it
        found it: its lock file removed, or given back its earlier text."""
        if self.fd < 0:
            return
        path = self.directory / LOCK_FILE
        try:
            if not self.started and self.created_file:
                path.unlink(missing_ok=True)  # while still held: no one can take the unlinked file
                _remove_made(self.directory, self.created_from)
            elif not self.started:
                _overwrite(self.fd, self.previous)
            else:
                os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # releases the flock
            self.fd = -1


def describe_holder(text: str) -> str:
    """'pid 123 on host node7 since 2026-01-02T03:04:05' from the lock file's JSON."""
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']} since {holder['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process whose details the lock file does not hold"


def acquire(directory: Path) -> RunLock:
    """Lock `directory` (made if missing) for this process, or refuse naming the holder."""
    created_from = _make_directory(directory)
    path = directory / LOCK_FILE
    while True:
        created_file = not path.exists()
        fd = _open_lock_file(directory, path, created_from, created_file)
        _lock_or_refuse(directory, fd)
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:  # the previous holder removed the file between our open and lock: retry
            os.close(fd)
            continue
        previous = _read(fd)
        _claim(directory, path, RunLock(directory, fd, created_from, created_file, None, previous=previous))
        stale = describe_holder(previous) if previous.strip() else None
        return RunLock(directory, fd, created_from, created_file, stale, previous=previous)


def _make_directory(directory: Path) -> Path | None:
    """Make the run directory (and its parents) if missing; the outermost one made (None: none)."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    created_from = missing[-1] if missing else None
    if directory.exists() and not directory.is_dir():
        raise RunDirectoryError(f"run.dir={directory} is a file, not a directory; pass a directory for the run")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError) as error:
        raise RunDirectoryError(
            f"run.dir={directory} cannot be made: a part of its path is a file ({error})"
        ) from error
    except PermissionError as error:
        raise RunDirectoryError(
            f"run.dir={directory} cannot be made: permission denied; pass a run.dir where you can write"
        ) from error
    except OSError as error:  # a read-only or full file system, a path the kernel refuses
        raise RunDirectoryError(
            f"run.dir={directory} cannot be made ({error.strerror or error}); pass a run.dir where you can write"
        ) from error
    return created_from


def _open_lock_file(directory: Path, path: Path, created_from: Path | None, created_file: bool) -> int:
    """Open (creating) the lock file; refused, take back what `acquire` made."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError as error:
        _undo(directory, created_from, created_file)
        raise RunDirectoryError(
            f"run.dir={directory} is not writable (permission denied on {path}); pass a run.dir where you can write"
        ) from error
    except OSError as error:  # a directory named ferry.lock, a read-only or full file system
        _undo(directory, created_from, created_file)
        raise RunDirectoryError(
            f"run.dir={directory}: its lock file {path} cannot be opened ({error.strerror or error}); "
            "pass a run.dir where you can write"
        ) from error


def _lock_or_refuse(directory: Path, fd: int) -> None:
    """Take the exclusive lock without waiting, or refuse naming the run that holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = describe_holder(_read(fd))
        os.close(fd)
        raise RunDirectoryError(
            f"run.dir={directory} is in use by another ferry run ({holder}); wait for it to finish, "
            "or pass another run.dir"
        ) from None


def _claim(directory: Path, path: Path, lock: RunLock) -> None:
    """Write this process into the held lock file; on a full disk release everything and refuse."""
    try:
        _write(lock.fd, {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()})
    except OSError as error:  # a full disk: nothing of this run may stay behind
        try:
            lock.release()
        except OSError:
            pass
        raise RunDirectoryError(
            f"run.dir={directory}: its lock file {path} cannot be written ({error.strerror or error}); "
            "free space there or pass a run.dir on another disk"
        ) from error


def _undo(directory: Path, created_from: Path | None, created_file: bool) -> None:
    """Take back what `acquire` made before it was refused."""
    if created_file:
        (directory / LOCK_FILE).unlink(missing_ok=True)
    _remove_made(directory, created_from)


def _remove_made(directory: Path, created_from: Path | None) -> None:
    """Remove the directories a lock made, `directory` up to `created_from`, while they are empty:
    a run refused before it wrote leaves no directory behind, its parents included."""
    if created_from is None:
        return
    for made in (directory, *directory.parents):
        if not made.is_dir() or any(made.iterdir()):
            return
        made.rmdir()
        if made == created_from:
            return


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _write(fd: int, holder: dict[str, object]) -> None:
    _overwrite(fd, json.dumps(holder) + "\n")


def _overwrite(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    data = text.encode()
    while data:
        data = data[os.write(fd, data) :]
    os.fsync(fd)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
