"""The train state in explicit memory kinds: where each leaf lives, and in which pieces the
update streams it.

`offload.optimizer=host` keeps AdamW's moments, and `offload.params=host` the float32 master
weights, in pinned host memory (MaxText's `optimizer_memory_host_offload` and
`parameter_memory_host_offload`). The forward and backward passes never read either: they read
a compute-dtype copy of the weights that stays in HBM. The update (`ferry.train.streamed_update`)
streams the host-resident state through HBM a piece at a time (`stream_pieces`: a loop over each
layer stack's layers, a large leaf in blocks of rows; the rest as one piece): bring layer k's
master weights and moments to the device, apply AdamW, write them back into the host arrays they
came from, refresh layer k's compute copy. HBM holds at most a layer's state and never more than
`offload.stream_mib`, and pinned host nothing but the state.

Which leaves move: the matrices (a layer's weights with two or more axes). Vectors (norm scales,
router biases) are a rounding error of the state and stay in HBM, where `after_step` may update
them (a host leaf `after_step` changed would be computed on in host memory, which the GPU cannot
do; that is refused when the step is traced).
"""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from ferry.config.train import HOST, StatePlacement
from ferry.nn.stack import LayerStack
from ferry.offload.schedule import StateCopy

MASTER_WEIGHTS, MOMENTS = "master weights", "AdamW moments"  # what a state copy moves


@dataclasses.dataclass(frozen=True)
class StateMap:
    """Per parameter leaf (in `jax.tree.leaves` order of the float parameters): the unit its
    update streams in (1, 2, ...: the layer stacks, whose host-resident leaves carry a leading
    layer axis and stream a layer at a time; 0: everything else, updated whole), and whether its
    master weight and its moments live on host."""

    units: tuple[int, ...]
    host_params: tuple[bool, ...]
    host_moments: tuple[bool, ...]
    unit_names: tuple[str, ...] = ("other",)  # unit 0, then each stack's name
    unit_layers: tuple[int, ...] = (1,)
    moment_scale: float = 1.0  # a moment's bytes over its float32 parameter's (0.5: bfloat16 moments)

    @property
    def any_host(self) -> bool:
        return any(self.host_params) or any(self.host_moments)

    def leaves_of(self, unit: int) -> list[int]:
        return [i for i, u in enumerate(self.units) if u == unit]


def _is_float(x: Any) -> bool:
    abstract = isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)
    return abstract or eqx.is_inexact_array(x)


def float_params(model: Any) -> Any:
    """The float parameters (what AdamW updates) of a model, concrete or abstract."""
    return eqx.filter(model, _is_float)


def state_map(model: Any, placement: StatePlacement) -> StateMap:
    """Which unit each parameter streams in and where it lives (from shapes alone)."""
    stacks: list[LayerStack] = []

    def label(node: Any) -> Any:
        if isinstance(node, LayerStack):
            stacks.append(node)
            return jax.tree.map(lambda _: len(stacks), node)
        return 0

    params = float_params(model)
    units = tuple(jax.tree.leaves(jax.tree.map(label, params, is_leaf=lambda n: isinstance(n, LayerStack))))
    shapes = [leaf.shape for leaf in jax.tree.leaves(params)]
    matrix = tuple(len(shape) - (unit > 0) >= 2 for shape, unit in zip(shapes, units, strict=True))
    host_params = tuple(m and placement.params == HOST for m in matrix)
    host_moments = tuple(m and placement.optimizer == HOST for m in matrix)
    # what stays in HBM is updated whole (unit 0), as the device-resident step does
    units = tuple(u if p or m else 0 for u, p, m in zip(units, host_params, host_moments, strict=True))
    names = ("other", *(stack.name for stack in stacks))
    layers = (1, *(stack.num_layers for stack in stacks))
    return StateMap(units, host_params, host_moments, names, layers, placement.moment_bytes / 4)


def on_host(x: Any) -> bool:
    """Is the (traced) array typed as living in host memory?"""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def state_on_host(state_arrays: Any, smap: StateMap) -> Any:
    """A tree shaped like a train state's arrays (its `model` and `opt_state` fields mirroring
    the model): True where the leaf lives on host."""
    flags = iter(smap.host_params)
    params_host = jax.tree.map(lambda x: _is_float(x) and next(flags), state_arrays.model)
    float_host = jax.tree.unflatten(jax.tree.structure(float_params(state_arrays.model)), list(smap.host_moments))
    nowhere = jax.tree.map(lambda _: False, state_arrays.opt_state)
    opt_host = optax.tree_utils.tree_set(nowhere, mu=float_host, nu=float_host)
    return eqx.tree_at(
        lambda s: (s.model, s.opt_state), jax.tree.map(lambda _: False, state_arrays), (params_host, opt_host)
    )


def with_memory_kinds(shardings: Any, host: Any) -> Any:
    """`shardings` with the leaves marked in `host` moved to pinned host memory."""
    return jax.tree.map(lambda sh, h: sh.with_memory_kind("pinned_host") if h else sh, shardings, host)


def _tile_rows(shape: tuple[int, ...], axis: int) -> int:
    """The rows a block of `axis` must be a multiple of for a TPU to slice it in host memory: a
    TPU tiles an array's two minor axes, 128 along its lanes and 8 along its sublanes. The last
    axis is laid along the lanes, and so is the one before it where the last is no multiple of 128
    (XLA may swap them to spare the padding: it did for float32[4, 192, 64], refusing a block of
    24 of the 192 rows)."""
    if axis == len(shape) - 1 or (axis == len(shape) - 2 and shape[-1] % 128):
        return 128
    return 8 if axis == len(shape) - 2 else 1


@dataclasses.dataclass(frozen=True)
class StreamPiece:
    """Host-resident leaves whose update streams through HBM together, in one loop of `steps`:
    each step one layer's slice of a stack (`layers` > 0; none for an unstacked leaf), or of its
    `blocks` blocks of rows (of the axis after the layer axis)."""

    leaves: tuple[int, ...]
    layers: int  # the stack's layers; 0: unstacked leaves
    blocks: int = 1
    step_bytes: float = 0.0  # the moved state a step brings to HBM, per device

    @property
    def steps(self) -> int:
        return max(self.layers, 1) * self.blocks

    def rows(self, shape: tuple[int, ...]) -> int:
        """Rows per block of a leaf of this `shape`."""
        return shape[1 if self.layers else 0] // self.blocks


def stream_pieces(
    smap: StateMap, params: list[Any], shardings: list[NamedSharding], cap_bytes: float
) -> tuple[tuple[int, ...], tuple[StreamPiece, ...]]:
    """How the update streams the host-resident state (`params`: arrays or shapes, in leaf
    order): the unstacked leaves updated whole, and the loops over the rest. HBM holds at most
    the state of a layer of the largest stack at once, and never more than `cap_bytes`: a stack
    whose layer holds more streams its leaves in groups within that, and a leaf larger than it
    (an embedding, a layer's experts) in blocks of rows, the fewest that divide its rows (a row
    at a time at the most; of one of its two minor axes, whole TPU tiles, `_tile_rows`). A leaf
    whose blocked axis is split over devices stays whole (its blocks would need collectives), and
    so does a layer's slice of a stack's leaf that only a block of one of its two minor axes could
    split (a matrix of a stack of several layers, not a MoE layer's experts): XLA's TPU compiler
    aborts on writing such a block into host memory (float32[4, 256, 1024], a block of 128 of the
    256 rows of one layer: "Check failed: update_detail.higher_dimensions_multiplied ==
    original_tensor_detail.higher_dimensions_multiplied (1 vs. 4)")."""

    def state_bytes(i: int) -> float:
        copies = smap.host_params[i] + 2 * smap.host_moments[i] * smap.moment_scale
        shard = shardings[i].shard_shape(params[i].shape)
        return math.prod(shard) * params[i].dtype.itemsize * copies / smap.unit_layers[smap.units[i]]

    stacks = sorted(set(smap.units) - {0})
    layer_bytes = max((sum(map(state_bytes, smap.leaves_of(u))) for u in stacks), default=cap_bytes)
    budget = min(cap_bytes, layer_bytes)

    def blocks(i: int, axis: int) -> int:
        rows = params[i].shape[axis]
        if state_bytes(i) <= budget or _devices_along(shardings[i], axis) > 1:
            return 1
        if axis == 1 and axis >= len(params[i].shape) - 2 and smap.unit_layers[smap.units[i]] > 1:
            return 1  # a TPU writes a block of a tiled axis into host memory only across all axes above it
        tile = _tile_rows(params[i].shape, axis)
        counts = [n for n in range(1, rows // tile + 1) if rows % n == 0 and (rows // n) % tile == 0]
        return next((n for n in counts if state_bytes(i) / n <= budget), max(counts, default=1))

    def piece(leaves: list[int], layers: int, n: int = 1) -> StreamPiece:
        return StreamPiece(tuple(leaves), layers, n, sum(map(state_bytes, leaves)) / n)

    whole = tuple(i for i in smap.leaves_of(0) if blocks(i, 0) == 1)
    pieces = []
    for unit in stacks:
        layers, group = smap.unit_layers[unit], list[int]()
        for i in smap.leaves_of(unit):
            if group and sum(state_bytes(j) for j in [*group, i]) > budget:
                pieces.append(piece(group, layers))
                group = []
            if (n := blocks(i, 1)) > 1:
                pieces.append(piece([i], layers, n))
            else:
                group.append(i)
        if group:
            pieces.append(piece(group, layers))
    pieces += [piece([i], 0, blocks(i, 0)) for i in smap.leaves_of(0) if i not in whole]
    return whole, tuple(pieces)


def model_pieces(model: Any, placement: StatePlacement, param_sharding: Any) -> tuple[StreamPiece, ...]:
    """`stream_pieces`' loops for a model's state placed by `placement`."""
    leaves, shardings = jax.tree.leaves(float_params(model)), jax.tree.leaves(param_sharding)
    return stream_pieces(state_map(model, placement), leaves, shardings, placement.step_bytes)[1]


def stream_line(model: Any, placement: StatePlacement, param_sharding: Any) -> str:
    """How the update streams a host-resident state through HBM, for the start-up line."""
    pieces = model_pieces(model, placement, param_sharding)
    most = max((piece.step_bytes for piece in pieces), default=0.0) * placement.steps_held
    prefetch = ", each step's state fetched during the step before (offload.stream_prefetch)" * placement.prefetch
    return (
        f"streamed through HBM by the update in {len(pieces)} loop(s) of layers or blocks of rows, at most "
        f"{most / 2**20:,.0f} MiB per device at once (offload.stream_mib={placement.stream_mib:g}){prefetch}"
    )


def _devices_along(sharding: NamedSharding, axis: int) -> int:
    """How many devices split `axis` of arrays with this sharding."""
    entry = sharding.spec[axis] if len(sharding.spec) > axis else None
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(sharding.mesh.shape[name] for name in names if name is not None)


def state_copies(model: Any, placement: StatePlacement, param_sharding: Any) -> tuple[StateCopy, ...]:
    """The update's host <-> HBM copies per unit, per device."""
    if not placement.streams:
        return ()
    smap = state_map(model, placement)
    shards = _shard_bytes(model, param_sharding)
    copies = []
    for unit, name in enumerate(smap.unit_names):
        index = smap.leaves_of(unit)
        layers = smap.unit_layers[unit]
        for tensor, flags, count, scale in _moved(smap):
            total = int(sum(shards[i] * count * scale for i in index if flags[i]))
            if total:
                copies.append(StateCopy(name, tensor, layers, total // layers))
    return tuple(copies)


@dataclasses.dataclass(frozen=True)
class StateWrite:
    """One host-resident leaf's write-backs in a step: `arrays` of `bytes` each (per device; a
    stack's: one layer's slice, or a block of its rows; a large unstacked leaf's: one block of
    rows), once per step of its loop (`StreamPiece`)."""

    bytes: int
    layers: int  # its loop's steps: a stack's layers (times the blocks of each), an unstacked leaf's blocks, else 1
    arrays: int  # the master weights (1), the moments (2), or both (3)

    @property
    def copies(self) -> int:
        return self.layers * self.arrays


def state_writes(model: Any, placement: StatePlacement, param_sharding: Any) -> dict[str, StateWrite]:
    """Each host-resident leaf's write-backs to pinned host per step, named `master weights:PATH`,
    `AdamW moments:PATH` or `master weights+AdamW moments:PATH` (float32 moments: of one size):
    how the planner names, and the verifier counts, the update's copies in the compiled program."""
    if not placement.streams:
        return {}
    smap = state_map(model, placement)
    paths = [
        jax.tree_util.keystr(path, simple=True, separator=".")
        for path, _ in jax.tree_util.tree_leaves_with_path(float_params(model))
    ]
    pieces = model_pieces(model, placement, param_sharding)
    steps = {i: piece.steps for piece in pieces for i in piece.leaves}  # else updated whole: once
    writes = {}
    for i, (where, shard) in enumerate(zip(paths, _shard_bytes(model, param_sharding), strict=True)):
        moved = [(tensor, count, scale) for tensor, flags, count, scale in _moved(smap) if flags[i]]
        # arrays of one size are one write of that size; master weights and bfloat16 moments are two
        for scale in sorted({scale for _, _, scale in moved}, reverse=True):
            same = [(tensor, count) for tensor, count, s in moved if s == scale]
            name = "+".join(tensor for tensor, _ in same) + f":{where}"
            size = int(shard * scale) // steps.get(i, 1)
            writes[name] = StateWrite(size, steps.get(i, 1), sum(count for _, count in same))
    return writes


def _moved(smap: Any) -> tuple[tuple[str, Any, int, float], ...]:
    """What the update moves per leaf: each tensor, its host flags, its arrays per parameter and
    their bytes over the float32 parameter's."""
    return (MASTER_WEIGHTS, smap.host_params, 1, 1.0), (MOMENTS, smap.host_moments, 2, smap.moment_scale)


def _shard_bytes(model: Any, param_sharding: Any) -> list[int]:
    """Each float parameter's bytes on one device."""
    return [
        math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
        for x, sh in zip(jax.tree.leaves(float_params(model)), jax.tree.leaves(param_sharding), strict=True)
    ]
