"""A file whose content is made when it is first opened: how one compile both shows ferry the
module XLA's scheduler gets and schedules it with the profile priced from that module.

XLA:GPU reads its latency profile once, when it sets up the latency-hiding scheduler: after every
pass that shapes the module the scheduler gets (and after their dumps), before scheduling. A
profile file written in advance cannot price that module, and a pipe cannot stand in for the file
(XLA reads it with a positioned read, which a pipe refuses). A write lease can: Linux blocks any
open of a leased file until the lease holder lets go (or `/proc/sys/fs/lease-break-time`, 45 s by
default, has passed). So the profile file is created empty and leased; when XLA's open breaks the
lease, the module is on disk in XLA's dump, and the content is made from it, written, and the lease
released: XLA's open returns and it reads the whole profile.
"""

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

# Linux's fcntl commands for leases (fcntl(2)); Python names them only on some builds
_SET_LEASE = getattr(fcntl, "F_SETLEASE", 1024)
_GET_LEASE = getattr(fcntl, "F_GETLEASE", 1025)
_POLL_SECONDS = 0.005  # how often the lease is checked for an open waiting on it


class Handoff:
    """What became of a leased file: whether someone opened it while leased, and whether the
    content was written whole before the opener could read it (`delivered`)."""

    def __init__(self) -> None:
        self.opened = False
        self.delivered = False
        self.error: BaseException | None = None


def leases_supported(directory: Path) -> bool:
    """Whether files in `directory` take a write lease (Linux, a filesystem with leases on)."""
    fd, probe = tempfile.mkstemp(prefix=".lease-probe-", dir=directory)  # its own: processes probe at once
    try:
        fcntl.fcntl(fd, _SET_LEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, _SET_LEASE, fcntl.F_UNLCK)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


@contextlib.contextmanager
def written_when_opened(path: Path, content: Callable[[], str]) -> Iterator[Handoff]:
    """`path`, created empty and leased while inside: the first open of it (by any thread) waits
    until `content()` is written to it. `content` runs on a watcher thread; should it fail, the
    opener reads what was written (nothing, or part) and `Handoff.error` says why. Requires
    `leases_supported`."""
    path.write_text("")
    fd = os.open(path, os.O_RDWR)
    handoff = Handoff()
    done = threading.Event()
    try:
        fcntl.fcntl(fd, _SET_LEASE, fcntl.F_WRLCK)
        # Linux signals a lease's holder (SIGIO, fatal by default) when an open breaks it; no one
        # owns this file's signals, so none is sent: the watcher polls the lease instead
        fcntl.fcntl(fd, fcntl.F_SETOWN, 0)
    except OSError:
        os.close(fd)
        raise

    def watch() -> None:
        try:
            while fcntl.fcntl(fd, _GET_LEASE) == fcntl.F_WRLCK:  # a waiting open turns it to the opener's mode
                if done.wait(_POLL_SECONDS):
                    return
            handoff.opened = True
            _write_all(fd, content().encode())
            # still leased: the opener is still waiting and will read all of it (else the kernel
            # broke the lease on its own after lease-break-time, and the opener may have read less)
            handoff.delivered = fcntl.fcntl(fd, _GET_LEASE) != fcntl.F_UNLCK
        except BaseException as error:  # kept for the caller; the opener must not wait on it
            handoff.error = error
        finally:  # the opener goes on
            with contextlib.suppress(OSError):  # the kernel may have broken it already
                fcntl.fcntl(fd, _SET_LEASE, fcntl.F_UNLCK)
            os.close(fd)

    watcher = threading.Thread(target=watch, name=f"handoff {path.name}", daemon=True)
    watcher.start()
    try:
        yield handoff
    finally:
        done.set()
        watcher.join()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
