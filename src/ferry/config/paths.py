"""Paths from the config checked for their kind and reach before anything is read or written: a
file where a directory belongs (or the reverse), a directory that cannot be made (below a file,
on a kernel filesystem such as /proc, read-only, not permitted) is refused naming the key, instead
of an `OSError` traceback from deep inside the run once it has started.
"""

import errno
import os
import tempfile
from pathlib import Path

from ferry.errors import ConfigError


def nameable_path(key: str, value: str) -> Path:
    """`value` as a path (`~` expanded), refused naming the key where the file system cannot name
    it: a part longer than its limit (often 255 bytes), or the whole longer than the system's.
    `Path.exists` raises `OSError: File name too long` for such a path instead of answering."""
    path = Path(value).expanduser()
    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ENAMETOOLONG:
            longest = max(len(os.fsencode(part)) for part in path.parts)
            raise ConfigError(
                f"{key}={value} is longer than the file system allows (its longest name is {longest} bytes, the "
                f"whole path {len(os.fsencode(str(path)))}); choose a shorter path"
            ) from error
    return path


def _deepest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor or ".")


def check_directory_to_write(key: str, value: str) -> None:
    """`value` is a directory ferry may create and writes into: an existing directory that this
    user may write, or a path whose deepest existing part is a directory a directory can be made
    in (tried by making and removing an empty one there)."""
    path = nameable_path(key, value)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}={value} is a file, not a directory; point {key} at a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}={value}: permission denied (this user cannot write there)")
        return
    ancestor = _deepest_existing(path)
    if not ancestor.is_dir():
        raise ConfigError(f"{key}={value} cannot be made: a part of its path is a file ({ancestor})")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ferry-probe-", dir=ancestor))
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        hint = (
            f"{ancestor} takes no new directories (a kernel filesystem such as /proc?)"
            if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.EINVAL)
            else reason.lower()
        )
        raise ConfigError(f"{key}={value} cannot be made: {hint}; choose a writable directory") from error


def check_existing_directory(key: str, value: str, what: str) -> None:
    """`value` must be a directory when it exists (its absence is left to the reader, which says
    how to make it)."""
    path = nameable_path(key, value)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={value} is a file, not a directory; point {key} at {what}")


def check_existing_file(key: str, value: str, what: str) -> None:
    """`value` must be a file when it exists."""
    path = nameable_path(key, value)
    if path.exists() and path.is_dir():
        raise ConfigError(f"{key}={value} is a directory, not a file; point {key} at {what}")
