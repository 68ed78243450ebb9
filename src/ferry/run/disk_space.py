"""Room for a checkpoint, checked before the run starts: a disk that cannot hold one checkpoint
of the train state would fail the first save after the first steps were spent."""

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from ferry.errors import FerryError
from ferry.offload.schedule import format_bytes

# Orbax's metadata beside the arrays (a few files of a few KiB per step), with room to spare
METADATA_BYTES = 2**20


class DiskSpaceError(FerryError, OSError):
    """The run directory's file system cannot hold one checkpoint."""


def state_bytes(shapes: Any) -> int:
    """Bytes of every array of the train state (`ShapeDtypeStruct`s), as a checkpoint holds them."""
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))


def existing_ancestor(path: Path) -> Path:
    """`path`, or the nearest directory above it that exists (where it would be made)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_checkpoint_space(
    run_dir: Path, checkpoint_bytes: int, free_bytes: Callable[[Path], int] = lambda p: shutil.disk_usage(p).free
) -> None:
    """Refuse, saying how much is needed and free, when the file system holding `run_dir` has
    less room than one checkpoint of `checkpoint_bytes` and its metadata."""
    where = existing_ancestor(run_dir / "checkpoints")
    try:
        free = free_bytes(where)
    except OSError:
        return  # a path that cannot be asked (permission): its own check says so
    need = checkpoint_bytes + METADATA_BYTES
    if free < need:
        raise DiskSpaceError(
            f"run.dir={run_dir}: one checkpoint of this run needs about {format_bytes(need)} (the train state's "
            f"{format_bytes(checkpoint_bytes)} and Orbax's metadata), but the file system holding {where} has "
            f"{format_bytes(free)} free; free at least {format_bytes(need - free)} there, or pass a run.dir on a "
            "disk with room"
        )
