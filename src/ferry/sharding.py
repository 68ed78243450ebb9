"""The device mesh and the shardings of the train state and the batches."""

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


def make_mesh(num_devices: int = 1) -> Mesh:
    """A data-parallel mesh over the first `num_devices` devices (auto sharding inside jit)."""
    available = jax.device_count()
    if num_devices > available:
        raise ValueError(f"the mesh needs {num_devices} devices but {available} are available")
    return jax.make_mesh((num_devices,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:num_devices])


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Rows of a [batch, seq] array split over the `data` axis."""
    return NamedSharding(mesh, PartitionSpec("data"))
