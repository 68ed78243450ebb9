"""Multi-host batch placement: each process builds only the rows of a global batch that its own
devices hold, and the global batch is assembled from them, rows split over the mesh's batch axes."""

import dataclasses
from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ferry.sharding import batch_sharded


def device_batch(rows: Callable[[slice], np.ndarray], shape: tuple[int, int], mesh: Mesh) -> jax.Array:
    """The global batch of `shape`, rows split over the batch axes; `rows(slice)` builds a block
    of rows, and each process builds only the blocks its own devices hold."""
    return jax.make_array_from_callback(
        shape, batch_sharded(mesh), lambda index: rows(_index(index)[0])[:, _index(index)[1]]
    )


def _index(index: tuple[slice, ...] | None) -> tuple[slice, ...]:
    """A device's block of a 2-d batch (JAX types it optional; a sharded array's is always set)."""
    return cast(tuple[slice, ...], index)


def process_rows(mesh: Mesh, shape: tuple[int, int]) -> np.ndarray:
    """The rows of a global batch that this process's devices hold, sorted."""
    indices = batch_sharded(mesh).addressable_devices_indices_map(shape).values()
    return np.unique(np.concatenate([np.arange(shape[0])[_index(index)[0]] for index in indices]))


def local_batch(local: np.ndarray, local_rows: np.ndarray, shape: tuple[int, int], mesh: Mesh) -> jax.Array:
    """The global batch from this process's rows `local` (of global rows `local_rows`)."""
    return device_batch(lambda rows: local[np.searchsorted(local_rows, np.arange(shape[0])[rows])], shape, mesh)


@dataclasses.dataclass(frozen=True)
class BatchPlacement:
    """Global batches of `shape` on `mesh`, rows split over its batch axes: this process builds
    only `local_rows`, the rows its own devices hold."""

    mesh: Mesh
    shape: tuple[int, int]
    local_rows: np.ndarray

    @classmethod
    def on(cls, mesh: Mesh, shape: tuple[int, int]) -> "BatchPlacement":
        return cls(mesh, shape, process_rows(mesh, shape))

    def place(self, local: np.ndarray) -> jax.Array:
        """The global batch from this process's rows."""
        return local_batch(local, self.local_rows, self.shape, self.mesh)

    def spec(self) -> jax.ShapeDtypeStruct:
        """The global batch's shape, dtype and sharding, for compiling before any batch exists."""
        return jax.ShapeDtypeStruct(self.shape, jnp.int32, sharding=batch_sharded(self.mesh))
