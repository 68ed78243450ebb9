"""The offload engine: name activations with `tag`, place them with a `Policy`, and let
`offloaded` wrap a decoder layer in a custom VJP that moves the saved residuals between HBM
and pinned host memory.

Forward: run the layer while a recorder collects every tagged value; `"offload"` values are
`device_put` to pinned host, `"device"` values are kept, `"remat"` values are dropped.
Backward: bring offloaded values back to the device and take the VJP of the layer replayed
with the saved values *injected* at their tags. Injection is an identity whose primal output is
the saved value and whose tangent is the tangent of the recomputed value, so the recomputed
producer of a saved value is dead code that XLA removes: only what lies between saved values is
recomputed. Every placement decision is the plain Python below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ferry.offload.policy import (
    ENGINES,
    LAYER_INPUT,
    PLACEMENTS,
    SAVE_ALL,
    Engine,
    Placement,
    Policy,
    PolicyError,
)
from ferry.offload.tags import (
    Axes,
    Namer,
    NestedTagError,
    Recorder,
    record_tags,
    record_tags_and_axes,
    replay_vjp,
    tag,
    tag_context,
    tagged_names,
)
from ferry.sharding import activation_spec, context_mesh

__all__ = [  # the engine's public interface: the policy and the tags re-exported beside the engine
    "COPY_SCOPE",
    "ENGINES",
    "LAYER_INPUT",
    "PLACEMENTS",
    "SAVE_ALL",
    "Axes",
    "Engine",
    "NestedTagError",
    "Placement",
    "Policy",
    "PolicyError",
    "checkpointed_by_jax",
    "copy_scope",
    "has_memory_kinds",
    "layer_function",
    "offloaded",
    "record_tags",
    "record_tags_and_axes",
    "replay_vjp",
    "spec_of",
    "split_params",
    "tag",
    "tagged_names",
    "to_memory",
]


# Memory placement.


def _mesh() -> Mesh | jax.sharding.AbstractMesh:
    """The mesh to place on: the one set by `jax.set_mesh` (`context_mesh`), else the only
    device's."""
    mesh = context_mesh()
    if mesh is not None:
        return mesh
    if jax.device_count() == 1:
        return Mesh(jax.devices()[:1], ("data",))
    raise ValueError("offloading on several devices needs a mesh: trace the step under `with jax.set_mesh(mesh):`")


def spec_of(x: jax.Array, axes: Axes, mesh: Mesh | jax.sharding.AbstractMesh) -> PartitionSpec:
    """The value's own partition spec, so its host copy is sharded exactly like it: the spec in
    its type where the mesh axes are explicit (sharding in types), else the spec its logical
    axes give under the activation rules, which `tag` already pinned the value to."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty and any(e is not None for e in sharding.spec):
        return sharding.spec
    if mesh.size == 1:
        return PartitionSpec()
    return activation_spec(x, axes, mesh)


def to_memory(x: jax.Array, memory_kind: str, axes: Axes = None) -> jax.Array:
    """`device_put` a value to `memory_kind` ("pinned_host" or "device") keeping its sharding.

    Compile-only devices (a GPU target compiled without a GPU) have no memories, and JAX would
    silently canonicalise a `pinned_host` NamedSharding to device memory, dropping the offload;
    there the value goes to the memory *space* instead, which the compiler honours, its spec
    kept by the sharding constraint."""
    target = _mesh()
    spec = spec_of(x, axes, target)
    if target.size > 1 and all(t == AxisType.Auto for t in target.axis_types):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(target, spec))  # the device value's spec, pinned
    if not has_memory_kinds(target):
        return jax.device_put(x, jax.memory.Space.Host if memory_kind == "pinned_host" else jax.memory.Space.Device)
    return jax.device_put(x, NamedSharding(target, spec, memory_kind=memory_kind))


def has_memory_kinds(mesh: Mesh | jax.sharding.AbstractMesh) -> bool:
    """Do the mesh's devices expose memories? Not for compile-only devices (the planner traces
    under `jax.set_mesh` of a concrete mesh of them, so `context_mesh` finds it); an abstract
    mesh names no devices and is taken to have them."""
    if not isinstance(mesh, Mesh):
        return True
    return bool(mesh.devices.flat[0].addressable_memories())


# The custom VJP.

COPY_SCOPE = "ferry_offload"
"""Every host copy is issued under the name scope `ferry_offload/<layer>/<tensor>/<direction>`
(direction `to_host` or `to_device`), so the copies of the compiled program (their HLO
`op_name` metadata) say which tensor of which layer group they move."""


def copy_scope(layer: str, tensor: str, direction: str) -> str:
    return f"{COPY_SCOPE}/{layer}/{tensor}/{direction}"


def split_params(params: Any) -> tuple[Any, Any, Any]:
    """A layer's parameters as (differentiated: floating-point arrays, fixed: other arrays such as
    integer tables, which are inputs never differentiated, static: everything else)."""
    diff, rest = eqx.partition(params, eqx.is_inexact_array)
    fixed, static = eqx.partition(rest, eqx.is_array)
    return diff, fixed, static


def layer_function(fn: Callable[..., Any], static: Any) -> Callable[..., Any]:
    """`fn(params, x, *extra)` as `layer(diff, x, fixed, extra)`, the form both engines' custom VJPs
    take (`split_params`): the static part is closed over, `extra` passed as one tuple."""

    def layer(p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> Any:
        return fn(eqx.combine(p, f, static), h, *e)

    return layer


@dataclasses.dataclass(frozen=True)
class _Placer:
    """Moves one layer's tagged values by `policy`: to host and back under their copy scopes."""

    policy: Policy
    name: str  # the layer (group), in the copies' name scope

    def save(self, tensor: str, value: jax.Array, axes: Axes) -> jax.Array | None:
        """The residual kept for `tensor`: its host copy, the value itself, or None (remat)."""
        placement = self.policy.placement(tensor)
        if placement == "offload":
            with jax.named_scope(copy_scope(self.name, tensor, "to_host")):
                return to_memory(value, "pinned_host", axes)
        return value if placement == "device" else None

    def restore(self, tensor: str, value: jax.Array | None, axes: Axes) -> jax.Array | None:
        """A saved residual back in HBM (offloaded ones copied back)."""
        if self.policy.placement(tensor) == "offload":
            assert value is not None  # an offloaded residual is saved, never None
            with jax.named_scope(copy_scope(self.name, tensor, "to_device")):
                return to_memory(value, "device", axes)
        return value


class _PerLayerVJP:
    """One traced call's custom VJP: `forward` issues each host copy at its tag and records the tag
    order, `backward` reloads and replays (`replay_vjp`)."""

    def __init__(self, layer_fn: Callable[..., Any], placer: _Placer, check_names: bool, in_scan: bool):
        self.layer_fn, self.placer, self.check_names, self.in_scan = layer_fn, placer, check_names, in_scan
        self.names: list[str] = []  # the tag order of the forward pass; residuals must be arrays
        self.axes: list[Axes] = []
        self.call = jax.custom_vjp(layer_fn)
        self.call.defvjp(self.forward, self.backward)

    def forward(self, p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> tuple[Any, Any]:
        # each value's host copy is issued at its tag, as soon as the value exists, so the rest of
        # the layer's forward pass can hide it
        recorder = Recorder(on_tag=self.placer.save)
        with tag_context(recorder):
            out = self.layer_fn(p, h, f, e)
        self.names[:] = [tensor for tensor, _ in recorder.values]
        self.axes[:] = recorder.axes
        if self.check_names:
            self.placer.policy.validate(set(self.names))
        return out, (p, self.placer.save(LAYER_INPUT, h, None), f, e, recorder.saved)

    def backward(self, residuals: Any, cotangent: Any) -> tuple[Any, Any, None, None]:
        p, h, f, e, saved = residuals
        if not self.in_scan:
            # The reloads wait for the layer's backward pass (its cotangent), through a barrier.
            # Outside a loop XLA would otherwise fold a copy to host that is read straight back
            # into nothing, and where it keeps the copies it starts each reload as soon as its
            # store is done: the value back in HBM from the forward pass on, saving nothing (read in
            # an H200 program: docs/results/deviceless.md, "The engine outside a layer loop").
            cotangent, h, saved = jax.lax.optimization_barrier((cotangent, h, saved))
        h = self.placer.restore(LAYER_INPUT, h, None)
        saved = [self.placer.restore(t, value, a) for t, value, a in zip(self.names, saved, self.axes, strict=True)]
        if not self.in_scan:
            # What the replay reads passes a barrier, as `jax.checkpoint`'s prevent_cse does:
            # outside a loop XLA would otherwise merge the replay with the forward pass, keeping
            # the forward values alive and saving nothing.
            p, h, f, e, saved = jax.lax.optimization_barrier((p, h, f, e, saved))
        injected = list(zip(self.names, saved, strict=True))
        return (*replay_vjp(lambda p_, h_: self.layer_fn(p_, h_, f, e), injected, p, h, cotangent), None, None)


def offloaded(
    fn: Callable[..., Any],
    policy: Policy,
    *,
    check_names: bool = True,
    name: str = "layer",
    in_scan: bool = False,
) -> Callable[..., Any]:
    """Wrap a layer `fn(params, x, *extra)` so its residuals are placed by `policy`.

    `params` is any pytree (an Equinox module included); its floating-point arrays are
    differentiated, its other arrays (integer tables, masks) are passed through undifferentiated,
    everything else is static. `x` is the differentiated input. `extra` are further inputs that
    are not differentiated (their cotangent is taken as zero): integer positions or segment ids,
    say. The output may be any pytree of arrays. The policy must name only tensors this layer
    tags, unless `check_names=False` because the caller checks it against a whole model whose
    layers tag different names (dense and MoE layers). `name` names the layer (group) in the
    copies' name scope (`copy_scope`).

    `in_scan` says the layer is the body of a `lax.scan` of more than one step. Outside one, the
    engine adds two optimisation barriers in its backward pass (one orders the reloads after the
    cotangent, one keeps the replay apart from the forward pass); inside one they are not needed
    (the scan's stacked host buffers keep the copies, an iteration bounds when a reload starts, and
    the backward loop cannot merge with the forward one), and would cost: XLA's host offloader
    refuses a barrier on host values in a loop body, and the replay could not start before every
    reload is done.
    """
    if policy.keep_all:
        return fn
    if policy.engine == "jax":
        return checkpointed_by_jax(fn, policy, in_scan=in_scan)
    placer = _Placer(policy, name)

    def call(params: Any, x: jax.Array, *extra: Any) -> Any:
        diff, fixed, static = split_params(params)
        return _PerLayerVJP(layer_function(fn, static), placer, check_names, in_scan).call(diff, x, fixed, extra)

    return call


def checkpointed_by_jax(fn: Callable[..., Any], policy: Policy, *, in_scan: bool = False) -> Callable[..., Any]:
    """The layer `fn(params, x, *extra)` with `policy`'s placements made by JAX's own offload:
    `jax.checkpoint` with `save_and_offload_only_these_names`, each tag a `checkpoint_name`.
    What a JAX user would write instead of ferry's engine, so the two can be compared on the
    same model and tensors (`offload.engine=jax`). The layer input stays where the scan keeps it.
    """
    placed = {placement: [name for name, p in policy.pairs if p == placement] for placement in PLACEMENTS}
    remat_policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=placed["device"],
        names_which_can_be_offloaded=placed["offload"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def named(params: Any, x: jax.Array, *extra: Any) -> Any:
        with tag_context(Namer()):
            return fn(params, x, *extra)

    # in a scan body JAX's own advice: no CSE barrier (the loop already keeps the replay apart)
    return eqx.filter_checkpoint(named, policy=remat_policy, prevent_cse=not in_scan)
