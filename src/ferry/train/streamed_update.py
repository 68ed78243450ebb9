"""The update of a train state part of which lives in pinned host memory (`offload.optimizer`,
`offload.params`; `ferry.train.state_memory` says where each leaf lives and in which pieces it
streams): each piece's master weights and moments brought to HBM a layer or a block of rows at a
time, AdamW applied, the new state written back into the host arrays it came from and the
compute copy refreshed.

Everything here is elementwise per parameter except gradient clipping, which needs the global
norm and so runs first, on the whole gradient in HBM; the result is the same bits as the
device-resident update (tested on CPU)."""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ferry.offload.engine import has_memory_kinds
from ferry.sharding import context_mesh
from ferry.train.state_memory import StateMap, StreamPiece, stream_pieces


def _moments(adam_state: Any) -> tuple[Any, Any]:
    return optax.tree_utils.tree_get(adam_state, "mu"), optax.tree_utils.tree_get(adam_state, "nu")


def _put(x: jax.Array, kind: str, sharding: NamedSharding) -> jax.Array:
    """`x` (a layer's slice when `sharding` is its stack's) to `kind` memory in its spec, on the
    context mesh."""
    mesh = context_mesh()
    spec = sharding.spec
    if x.ndim < len(spec):  # a slice of a stack: the spec of its per-layer axes
        spec = PartitionSpec(*spec[len(spec) - x.ndim :])
    if not isinstance(mesh, Mesh) or not has_memory_kinds(mesh):  # compile-only devices: the memory space instead
        return jax.device_put(x, jax.memory.Space.Host if kind == "pinned_host" else jax.memory.Space.Device)
    return jax.device_put(x, NamedSharding(mesh, spec, memory_kind=kind))


def _clip(g: jax.Array, g_norm: jax.Array, max_norm: float) -> jax.Array:
    """`optax.clip_by_global_norm` on one slice, given the whole gradient's norm (the same
    expression, so the same bits)."""
    return jax.lax.select(g_norm < max_norm, g, (g / g_norm.astype(g.dtype)) * max_norm)


@dataclasses.dataclass(frozen=True)
class StreamedUpdate:
    """AdamW applied unit by unit to a state part of which lives on host.

    `adamw` is the elementwise part of the optimizer (its weight-decay mask a fixed tree, so a
    layer's slice is decayed as its whole stack is); clipping by the global norm runs before it on
    each slice, with the norm of the whole gradient. Returns the new
    master parameters, the new AdamW state and the compute copies of the host-resident weights,
    each leaf already selected by `apply` (a step with a non-finite loss changes nothing)."""

    max_norm: float  # global-norm gradient clipping, applied per slice with the whole gradient's norm
    adamw: optax.GradientTransformation
    smap: StateMap
    compute_dtype: Any
    param_sharding: Any  # NamedSharding per master leaf (for the host <-> device copies' specs)
    stream_bytes: float  # the most moved state per device a step brings to HBM (`StatePlacement.step_bytes`)
    moves: bool = True  # False: the same arithmetic with every leaf left where it is (a reference)
    prefetch: bool = False  # a loop fetches its next step's state during this one (`StatePlacement.prefetch`)

    def __call__(self, params: Any, adam_state: Any, grads: Any, apply: jax.Array) -> tuple[Any, Any, Any]:
        treedef = jax.tree.structure(params)
        mu, nu = _moments(adam_state)
        columns = [jax.tree.leaves(t) for t in (params, grads, mu, nu)]
        shardings = jax.tree.leaves(self.param_sharding)
        new = [[None] * len(columns[0]) for _ in range(4)]  # params, mu, nu, compute copies
        g_norm = optax.tree.norm(grads)
        host_params = self.smap.host_params
        # compile-only GPU devices drop the inputs' memory kind (README): there the update collects
        # new arrays, as a scan, since it cannot write host slices into device-space inputs
        collect = self.moves and not all(map(_in_host_memory, _moved_inputs(columns, self.smap)))
        whole, pieces = stream_pieces(self.smap, columns[0], shardings, self.stream_bytes)
        previous: list[Any] = []
        for piece in [StreamPiece(tuple(whole), 0), *pieces]:  # the whole part first: it yields the counts
            index = list(piece.leaves)
            inputs = [[column[i] for i in index] for column in columns]
            update = self._unit_update(treedef, index, adam_state, apply, g_norm, [shardings[i] for i in index])
            if piece.steps == 1 and not piece.layers:  # the whole part
                outputs, new_state = update(inputs)
            else:
                host = [host_params[i] for i in index]
                after = previous if self.prefetch else None
                outputs = _in_place(update, inputs, piece, self.compute_dtype, host, collect, after)
            for column, values in zip(new, outputs, strict=True):
                for i, value in zip(index, values, strict=True):
                    column[i] = value
            # the device-resident results of this piece: the next loop's first fetch waits for them
            previous = [v for values in outputs for v in values if v is not None and not _in_host_memory(v)]
        new_params, new_mu, new_nu, compute = (jax.tree.unflatten(treedef, column) for column in new)
        compute = compute if any(self.smap.host_params) else None
        return new_params, optax.tree_utils.tree_set(new_state, mu=new_mu, nu=new_nu), compute

    def _unit_update(
        self,
        treedef: Any,
        index: list[int],
        adam_state: Any,
        apply: jax.Array,
        g_norm: jax.Array,
        shardings: list[NamedSharding],
    ) -> "_UnitUpdate":
        """The update of one unit's leaves (for a stack: one layer's slices), the other leaves of
        the tree standing in as empty arrays so optax sees the whole structure."""
        count = treedef.num_leaves
        host_p = [self.smap.host_params[i] for i in index]
        host_m = [self.smap.host_moments[i] for i in index]

        def whole(values: list[jax.Array]) -> Any:
            leaves = [jnp.zeros((0,), jnp.float32)] * count
            for i, value in zip(index, values, strict=True):
                leaves[i] = value
            return jax.tree.unflatten(treedef, leaves)

        def fetch(inputs: list[list[jax.Array]]) -> list[list[jax.Array]]:
            """The unit's host-resident (params, mu, nu) brought to HBM; the gradients as they are."""
            p, g, m, v = inputs
            bring = lambda xs, hs: [
                _put(x, "device", sh) if h and self.moves else x for x, h, sh in zip(xs, hs, shardings, strict=True)
            ]
            return [bring(p, host_p), g, bring(m, host_m), bring(v, host_m)]

        def update(fetched: list[list[jax.Array]]) -> tuple[list[list[Any]], Any]:
            p, g, m, v = fetched
            g = [_clip(x, g_norm, self.max_norm) for x in g]  # in the body: the bits of optax's fused clip
            params, grads = whole(p), whole(g)
            state = optax.tree_utils.tree_set(adam_state, mu=whole(m), nu=whole(v))
            updates, new_state = self.adamw.update(grads, state, params)
            new_p = [jax.tree.leaves(optax.apply_updates(params, updates))[i] for i in index]
            new_mu, new_nu = ([jax.tree.leaves(t)[i] for i in index] for t in _moments(new_state))
            keep = lambda new, old: jnp.where(apply, new, old)
            new_p = [keep(a, b) for a, b in zip(new_p, p, strict=True)]
            new_mu = [keep(a, b) for a, b in zip(new_mu, m, strict=True)]
            new_nu = [keep(a, b) for a, b in zip(new_nu, v, strict=True)]
            compute = [x.astype(self.compute_dtype) if h else None for x, h in zip(new_p, host_p, strict=True)]
            return [new_p, new_mu, new_nu, compute], new_state

        def store(new: list[list[Any]]) -> list[list[Any]]:
            """The unit's new (params, mu, nu) sent to where their state lives; the compute copies stay."""
            new_p, new_mu, new_nu, compute = new
            back = lambda xs, hs: [
                _put(x, "pinned_host", sh) if h and self.moves else x
                for x, h, sh in zip(xs, hs, shardings, strict=True)
            ]
            return [back(new_p, host_p), back(new_mu, host_m), back(new_nu, host_m), compute]

        return _UnitUpdate(fetch, update, store)


@dataclasses.dataclass(frozen=True)
class _UnitUpdate:
    """A unit's update in three parts: `fetch` brings its host-resident state to HBM, `update`
    applies AdamW in HBM, `store` sends the new state back to host; called, all three (a loop that
    prefetches calls `fetch` a step ahead, and orders it before `store`)."""

    fetch: Callable[[list[list[jax.Array]]], list[list[jax.Array]]]
    update: Callable[[list[list[jax.Array]]], tuple[list[list[Any]], Any]]
    store: Callable[[list[list[Any]]], list[list[Any]]]

    def __call__(self, inputs: list[list[jax.Array]]) -> tuple[list[list[Any]], Any]:
        new, state = self.update(self.fetch(inputs))
        return self.store(new), state


def _moved_inputs(columns: list[list[Any]], smap: StateMap) -> list[Any]:
    """The inputs (of the params, grads, mu, nu columns) that the state map puts on host."""
    params, _, mu, nu = columns
    moved = [p for p, host in zip(params, smap.host_params, strict=True) if host]
    return moved + [x for m, v, host in zip(mu, nu, smap.host_moments, strict=True) if host for x in (m, v)]


def _in_host_memory(x: Any) -> bool:
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def _in_place(
    update: _UnitUpdate,
    inputs: list[list[jax.Array]],
    piece: StreamPiece,
    compute_dtype: Any,
    host_params: list[bool],
    collect: bool = False,
    after: list[Any] | None = None,
) -> list[list[Any]]:
    """`update` applied to each step's slice of a piece's (params, grads, mu, nu) columns (a
    layer of a stack, or a block of its rows, or a block of an unstacked leaf's rows), each
    step's results written back into the arrays they came from: a loop carrying the arrays, where
    a scan would collect new ones. The donated host-resident state is so updated where it lies; a
    scan's outputs are new host buffers of the whole stack, copied into the donated ones after the
    loop (on an H200 those copies took most of the step: docs/results/gpu-h200.md, "The update of
    a state on host"). Returns
    the new params, mu, nu and compute copies (None where the master weights are in HBM).
    `collect`: a scan collecting new arrays instead, for inputs that are not where the update
    writes. `after` (prefetching): each step fetches the next step's slices before it updates its
    own, so the fetch overlaps this step's update and write-back (an async copy must finish within
    its loop iteration); the last step fetches its own slice again, unused (one step's fetch
    more). The first step's fetch, before the loop, waits for `after`, the loop before's results
    (`_zero_after`); the gradients, in HBM, are sliced where the update uses them."""
    if collect:
        return _collected(update, inputs, piece)
    params, grads, mu, nu = inputs
    compute = [jnp.zeros(x.shape, compute_dtype) if host else None for x, host in zip(params, host_params, strict=True)]

    def take(xs: list[Any], k: jax.Array) -> list[jax.Array]:
        return [_part(piece, x, k) for x in xs]

    # sliced a step ahead with the fetched state, the gradients were held whole in float32 longer
    # (more HBM for a DeepSeek-V3-width slice on v5e, at the same speed: docs/results/tpu-v5e.md, run 11)
    def sliced(k: jax.Array, carry: tuple[list[Any], ...], g: list[jax.Array]) -> list[list[jax.Array]]:
        """Step `k`'s (params, grads, mu, nu), `g` standing for its gradients."""
        return [take(carry[0], k), g, take(carry[1], k), take(carry[2], k)]

    def written(k: jax.Array, carry: tuple[list[Any], ...], new: list[list[Any]]) -> tuple[list[Any], ...]:
        return tuple(
            [x if y is None else _write(piece, x, y, k) for x, y in zip(xs, ys, strict=True)]
            for xs, ys in zip(carry, new, strict=True)
        )

    def step(k: jax.Array, carry: tuple[list[Any], ...]) -> tuple[list[Any], ...]:
        return written(k, carry, update(sliced(k, carry, take(grads, k)))[0])

    state = (params, mu, nu, compute)
    if after is None or piece.steps == 1:
        return list(jax.lax.fori_loop(0, piece.steps, step, state))

    def prefetching_step(k: jax.Array, carry: tuple) -> tuple:
        state, (p, _, m, v) = carry
        ahead = update.fetch(sliced(jnp.minimum(k + 1, piece.steps - 1), state, []))  # not yet written: k's is
        ahead, new = _read_before_written(ahead, update.update([p, take(grads, k), m, v])[0])
        return written(k, state, update.store(new)), ahead

    first = update.fetch(sliced(_zero_after(after), state, []))
    return list(jax.lax.fori_loop(0, piece.steps, prefetching_step, (state, first))[0])


def _zero_after(values: list[Any]) -> jax.Array:
    """0, as an index XLA can compute only once `values` are: `_in_place`'s first fetch of a loop
    after the loop before. An `optimization_barrier` does not order it, as libtpu drops the
    barriers before it schedules. Waiting for nothing, every loop's first fetch was issued at the
    start of the step, flew under the forward and backward passes and was held through them: on
    v5e a little faster than waiting, in more HBM, which a run that streams its state lacks; so was
    waiting for the loop before that instead (a loop of lookahead; docs/results/tpu-v5e.md, runs
    10 and 11). No value is both above 1 and below -1, NaN and infinities included."""
    never = jnp.zeros((), bool)
    for value in (v for v in values if v.size):
        first = value.reshape(-1)[0]
        never = never | ((first > 1) & (first < -1))
    return never.astype(jnp.int32)


def _read_before_written(ahead: list[list[Any]], new: list[list[Any]]) -> tuple[list[list[Any]], list[list[Any]]]:
    """Each array's next slice (`ahead`: params, grads, mu, nu) read before this step's new slice
    (`new`: params, mu, nu, compute copies) is written into the same array, array by array, so one
    array's write-back can fly beside another's fetch. Unordered, XLA copied every host array
    whole, on the host, each step (a DeepSeek-V3-width slice on v5e ran far slower than without
    prefetching: docs/results/tpu-v5e.md, run 9)."""
    ahead, new = [list(column) for column in ahead], [list(column) for column in new]
    for fetched, written in ((0, 0), (2, 1), (3, 2)):  # params, mu, nu
        for i, value in enumerate(new[written]):
            ahead[fetched][i], new[written][i] = jax.lax.optimization_barrier((ahead[fetched][i], value))
    return ahead, new


def _collected(update: _UnitUpdate, inputs: list[list[jax.Array]], piece: StreamPiece) -> list[list[Any]]:
    """`update` over a piece's steps as a scan collecting new arrays (`_in_place`'s `collect`)."""
    rest = 2 if piece.layers else 1  # the axes after the layer and row axes
    split = lambda xs: [x.reshape(piece.steps, piece.rows(x.shape), *x.shape[rest:]) for x in xs]
    outputs = jax.lax.scan(lambda _, xs: (None, update(xs)[0]), None, [split(xs) for xs in inputs])[1]
    shapes = [x.shape for x in inputs[0]]
    join = lambda ys: [None if y is None else y.reshape(shape) for y, shape in zip(ys, shapes, strict=True)]
    return [join(ys) for ys in outputs]


def _window(piece: StreamPiece, x: jax.Array, k: jax.Array) -> tuple[list[jax.Array], tuple[int, ...]]:
    """Where step `k`'s slice of `x` starts, and its size (a stack's keeps its layer axis)."""
    rows = piece.rows(x.shape)
    zero = jnp.zeros((), k.dtype)
    if not piece.layers:
        return [k * rows] + [zero] * (x.ndim - 1), (rows, *x.shape[1:])
    layer, block = k // piece.blocks, k % piece.blocks
    return [layer, block * rows] + [zero] * (x.ndim - 2), (1, rows, *x.shape[2:])


def _part(piece: StreamPiece, x: jax.Array, k: jax.Array) -> jax.Array:
    """Step `k`'s slice of `x` (a stack's without its layer axis)."""
    starts, sizes = _window(piece, x, k)
    y = jax.lax.dynamic_slice(x, starts, sizes)
    return y[0] if piece.layers else y


def _write(piece: StreamPiece, x: jax.Array, y: jax.Array, k: jax.Array) -> jax.Array:
    """`x` with step `k`'s slice replaced by `y`."""
    starts, _ = _window(piece, x, k)
    return jax.lax.dynamic_update_slice(x, y[None] if piece.layers else y, starts)
