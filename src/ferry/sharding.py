"""The device mesh and the logical-axis rules that shard parameters, optimizer state and
activations over it.

The mesh has four named axes, each of size 1 when unused: `data` (pure data parallelism),
`fsdp` (data parallelism whose parameters and optimizer moments are sharded, gathered layer by
layer), `tensor` (heads and MLP columns split across devices) and `expert` (MoE experts split
across devices; outside the experts it acts as one more FSDP axis: the batch is split over it and
every other parameter and its moments are sharded over it too, as in MaxText, so an expert-parallel
mesh holds no replicated dense weights). Every dimension is named
by a *logical* axis (`embed`, `heads`, `batch`...); the two rule tables below map logical axes to
mesh axes, one for parameters and one for activations, as MaxText's `logical_axis_rules` do.

Activations name their axes where they are made (`tag(x, name, axes)`); parameters where they are
created: every layer that owns arrays is an `AbstractSharded` module whose `param_axes` names each
array's axes (a `Linear` is told its weight's axes when it is built). The shardings of a whole
train state are read from those declarations; an array no layer declares is an error naming it,
never silently replicated.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
from jax._src.mesh import get_concrete_mesh  # no public API: `jax.sharding.get_mesh` refuses while tracing
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ferry.errors import FerryError

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "expert")
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
"""The mesh axes a batch is split over; their product is the data-parallel size."""

LogicalAxes = tuple[str | None, ...]

PARAM_RULES: Mapping[str, tuple[str, ...]] = {
    "embed": ("fsdp", "expert"),
    "latent": ("fsdp", "expert"),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
}
ACTIVATION_RULES: Mapping[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}

# The logical axes of the activations the layers tag.
EMBED: LogicalAxes = ("batch", "seq", "embed")
HEADS: LogicalAxes = ("batch", "seq", "heads")  # heads x head_dim, flattened
SPLIT_HEADS: LogicalAxes = ("batch", "seq", "heads", None)
MLP: LogicalAxes = ("batch", "seq", "mlp")
LATENT: LogicalAxes = ("batch", "seq", None)  # MLA's low-rank projections, not split


class MeshError(FerryError, ValueError):
    """A mesh that does not fit the devices, the model or the batch."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the four mesh axes; their product must equal the number of devices."""

    data: int = 1  # plain data parallelism: the batch split, parameters and optimizer state replicated
    fsdp: int = 1  # data parallelism with the parameters and optimizer state sharded
    tensor: int = 1  # tensor parallelism: attention heads, MLP columns and the vocabulary split
    expert: int = 1  # expert parallelism: a MoE layer's experts split (and the batch, outside the experts)

    def __post_init__(self) -> None:
        for axis in MESH_AXES:
            if getattr(self, axis) < 1:
                raise MeshError(f"mesh.{axis} must be at least 1, got {getattr(self, axis)}")

    @property
    def shape(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape.values())

    @property
    def axis_names(self) -> tuple[str, ...]:
        return MESH_AXES

    @property
    def data_parallel(self) -> int:
        """How many ways a batch is split (data x fsdp x expert): `data_parallel_size` of a mesh
        of this shape, so the config and the mesh cannot disagree."""
        return data_parallel_size(self)

    def describe(self) -> str:
        return " x ".join(f"{axis}={size}" for axis, size in self.shape.items())


def make_mesh(config: MeshConfig | None = None) -> Mesh:
    """The run's mesh over all devices (of every process), axes in `MESH_AXES` order, auto
    sharding inside jit: XLA's partitioner inserts the collectives."""
    config = config or MeshConfig()
    available = jax.device_count()
    if config.num_devices != available:
        raise MeshError(
            f"the mesh {config.describe()} has {config.num_devices} devices but {available} are available; "
            f"choose mesh sizes whose product is {available}"
        )
    return jax.make_mesh(
        tuple(config.shape.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=jax.devices()
    )


def mesh_axes(logical: str | None, rules: Mapping[str, tuple[str, ...]], mesh: Any) -> tuple[str, ...]:
    """The mesh axes a logical axis maps to, keeping only axes the mesh has."""
    if logical is None:
        return ()
    return tuple(axis for axis in rules.get(logical, ()) if axis in mesh.axis_names)


def logical_spec(axes: Sequence[str | None], rules: Mapping[str, tuple[str, ...]], mesh: Any) -> PartitionSpec:
    """The partition spec of an array whose dimensions are named `axes`; a mesh axis is used by at
    most one dimension (the first that asks for it)."""
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for logical in axes:
        chosen = tuple(axis for axis in mesh_axes(logical, rules, mesh) if axis not in used)
        used.update(chosen)
        entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*entries)


def _axis_size(mesh: Any, entry: str | tuple[str, ...] | None) -> int:
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[name] for name in names)


class AbstractSharded(eqx.Module):
    """A layer that owns parameters and says, where it creates them, which logical axis each of
    their dimensions is (its sublayers say their own)."""

    @abc.abstractmethod
    def param_axes(self) -> dict[str, LogicalAxes]:
        """Each array field's logical axes, one per dimension (a `LayerStack`'s leading layer axis
        is added, unnamed)."""


@dataclasses.dataclass(frozen=True)
class ParamAxes:
    """What a layer declared for one array of a tree: its path and logical axes (a tree leaf)."""

    path: str
    axes: LogicalAxes


def declared_axes(tree: Any) -> Any:
    """`tree` (a model, or a train state whose optimizer moments mirror it) with every array
    replaced by the `ParamAxes` its layer declared; a scalar needs none. An array no layer
    declares is a MeshError naming it."""

    def undeclared(path: str, leaf: Any) -> ParamAxes:
        shape = tuple(getattr(leaf, "shape", ()))
        if shape:
            raise MeshError(
                f"parameter {path} of shape {shape} has no logical axes: the layer that creates it must "
                "declare them (an AbstractSharded layer's param_axes)"
            )
        return ParamAxes(path, ())

    def in_layer(prefix: str, layer: AbstractSharded) -> Any:
        declared = layer.param_axes()

        def one(path: tuple[Any, ...], leaf: Any) -> Any:
            where = prefix + jax.tree_util.keystr(path)
            if isinstance(leaf, AbstractSharded) and leaf is not layer:
                return in_layer(where, leaf)
            field = getattr(path[0], "name", None)
            return ParamAxes(where, declared[field]) if field in declared else undeclared(where, leaf)

        return jax.tree_util.tree_map_with_path(one, layer, is_leaf=lambda x: x is not layer and _is_sharded(x))

    def top(path: tuple[Any, ...], leaf: Any) -> Any:
        where = jax.tree_util.keystr(path)
        return in_layer(where, leaf) if isinstance(leaf, AbstractSharded) else undeclared(where, leaf)

    return jax.tree_util.tree_map_with_path(top, tree, is_leaf=_is_sharded)


def _is_sharded(node: Any) -> bool:
    return isinstance(node, AbstractSharded)


def param_spec(path: str, shape: tuple[int, ...], axes: LogicalAxes, mesh: Any) -> PartitionSpec:
    """A parameter's (or its optimizer moment's) spec from its declared logical axes (leading
    stacked axes unnamed); a dimension its mesh axes do not divide is an error naming both."""
    if len(axes) > len(shape):
        raise MeshError(f"parameter {path} has shape {shape} but its layer declares {len(axes)} axes {axes}")
    spec = logical_spec((None,) * (len(shape) - len(axes)) + tuple(axes), PARAM_RULES, mesh)
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=False)):
        if size % _axis_size(mesh, entry):
            raise MeshError(
                f"parameter {path} has shape {shape}: dimension {dim} ({size}) is not divisible by "
                f"mesh axis {entry} of size {_axis_size(mesh, entry)}; choose a mesh size that divides it"
            )
    return spec


def tree_shardings(tree: Any, mesh: Mesh | jax.sharding.AbstractMesh) -> Any:
    """A NamedSharding for every array leaf of `tree` (a model, or a whole train state whose
    optimizer moments mirror the model), from the axes its layers declare."""

    def sharding(leaf: Any, declared: ParamAxes) -> NamedSharding:
        shape = tuple(getattr(leaf, "shape", ()))
        return NamedSharding(mesh, param_spec(declared.path, shape, declared.axes, mesh))

    return jax.tree.map(sharding, tree, declared_axes(tree))


def parameters_per_device(tree: Any, mesh: Any) -> int:
    """How many of `tree`'s parameters (a model, concrete or abstract) one device holds."""
    total = 0
    for leaf, declared in zip(jax.tree.leaves(tree), jax.tree.leaves(declared_axes(tree)), strict=True):
        shape = tuple(getattr(leaf, "shape", ()))
        total += math.prod(shard_shape(shape, param_spec(declared.path, shape, declared.axes, mesh), mesh))
    return total


def batch_spec(mesh: Any) -> PartitionSpec:
    """Rows of a [batch, ...] array split over every batch axis the mesh has."""
    return logical_spec(("batch",), ACTIVATION_RULES, mesh)


def data_parallel_size(mesh: Any) -> int:
    """How many ways the mesh (or a `MeshConfig`) splits a batch: the product of its batch axes
    (`ACTIVATION_RULES`), the one definition of the data-parallel size."""
    return _axis_size(mesh, batch_spec(mesh)[0])


def batch_sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def activation_spec(x: jax.Array | jax.ShapeDtypeStruct, axes: Sequence[str | None] | None, mesh: Any) -> PartitionSpec:
    """The spec of an activation named `axes` (default: batch-major, `batch` then unsharded). A
    mesh axis that does not divide its dimension is left out, so odd shapes stay legal."""
    axes = tuple(axes) if axes is not None else ("batch",) + (None,) * (x.ndim - 1)
    if len(axes) != x.ndim:
        raise ValueError(f"logical axes {axes} name {len(axes)} dimensions of an array of shape {x.shape}")
    entries = []
    for size, entry in zip(x.shape, logical_spec(axes, ACTIVATION_RULES, mesh), strict=True):
        entries.append(entry if entry is not None and size % _axis_size(mesh, entry) == 0 else None)
    return PartitionSpec(*entries)


def shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh: Any) -> tuple[int, ...]:
    """The shape one device holds of an array of `shape` split by `spec`."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return tuple(size // _axis_size(mesh, entry) for size, entry in zip(shape, entries, strict=True))


def context_mesh() -> Mesh | jax.sharding.AbstractMesh | None:
    """The mesh set by `jax.set_mesh` (the one way ferry's layers find their mesh, so no `mesh`
    argument threads through them): the concrete mesh when one is set, which names its devices
    (the offload engine asks them for memories), else the abstract one (`use_abstract_mesh`),
    else None."""
    concrete = get_concrete_mesh()  # `jax.sharding.get_mesh` refuses to answer while tracing
    if concrete is not None and not concrete.empty:
        return concrete
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def constrain(x: jax.Array, axes: Sequence[str | None] | None = None) -> jax.Array:
    """Pin an activation's sharding to its logical axes under the context mesh. Only auto axes
    are pinned: with explicit axes the sharding is part of the value's type already. Identity
    outside a mesh and on a single device."""
    mesh = context_mesh()
    if mesh is None or mesh.size == 1 or any(t != AxisType.Auto for t in mesh.axis_types):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, activation_spec(x, axes, mesh)))


def check_divisible(what: str, size: int, axis: str, axis_size: int, fix: str) -> None:
    if size % axis_size:
        raise MeshError(f"{what} ({size}) is not divisible by mesh.{axis}={axis_size}; {fix}")


# The platform a trace lowers for: attention kernels and the loss head choose by it.
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("ferry_attention_platform", default=None)


@contextlib.contextmanager
def attention_platform(platform: str | None) -> Iterator[None]:
    """Trace attention for `platform` ("cpu", "gpu", "tpu"; None: as `lowering_platform` finds it)
    inside this block: an abstract trace for a target has no devices to say it."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def _platform_name(platform: str) -> str:
    return "gpu" if platform in ("cuda", "rocm") else platform


def mesh_platform(mesh: Any) -> str | None:
    """The platform of a concrete mesh's devices (None: no mesh, or an abstract one)."""
    return _platform_name(mesh.devices.flat[0].platform) if isinstance(mesh, Mesh) else None


def lowering_platform() -> str:
    """The platform the program being traced is for ("cpu", "gpu" or "tpu"): `attention_platform`'s,
    else the context mesh's devices where `jax.set_mesh` set a concrete mesh, else JAX's default
    backend."""
    return _PLATFORM.get() or mesh_platform(context_mesh()) or _platform_name(jax.default_backend())
