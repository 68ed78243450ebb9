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

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, get_args

import equinox as eqx
import jax
from jax._src import core as jax_core
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ferry.errors import FerryError
from ferry.sharding import activation_spec, constrain, context_mesh

Axes = tuple[str | None, ...] | None

Placement = Literal["device", "offload", "remat"]
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)
Engine = Literal["ferry", "jax"]
ENGINES: tuple[Engine, ...] = get_args(Engine)
LAYER_INPUT = "decoder_layer_input"
"""The name of a layer's input. It is a residual of every layer and cannot be recomputed
inside the layer, so a policy places it on `device` (the default) or `offload`s it."""


class PolicyError(FerryError, ValueError):
    """A policy that cannot be applied: a bad placement or a name the model does not tag."""


@dataclasses.dataclass(frozen=True)
class Policy(Mapping[str, Placement]):
    """Where each tagged activation lives between the forward and the backward pass: an
    immutable mapping from the tensor names it mentions to their placement.

    Names not mentioned are rematerialised (the layer input: kept on device); `placement(name)`
    answers for any name. `keep_all` disables the custom VJP altogether, so JAX's own autodiff
    keeps every residual in HBM: the `save_all` reference every other policy is compared against.
    `pipelined` (the default) moves a scanned stack's offloaded values one layer apart
    (`ferry.offload_scan`): each copy hides under a whole layer, for one more layer of them in
    HBM; False moves them inside each layer (`offloaded`). `peel` runs a pipelined stack's
    first layer and its last `peel` layers outside its loop (`peel` + 2 copies of the layer in the
    program): no placeholder crosses the link, and the copies of the layers outside the loop may
    overlap any work around them (the loss head), where a loop iteration's must finish under it.
    `engine="jax"` places the same tensors with JAX's own offload instead (`checkpointed_by_jax`),
    the baseline ferry's engine is measured against.
    """

    placements: tuple[tuple[str, str], ...] | Mapping[str, str] = ()
    keep_all: bool = False
    pipelined: bool = True
    peel: int = 0
    engine: str = "ferry"

    def __post_init__(self) -> None:
        # `Policy({"mlpwo": "offload"})` reads as a user writes it; stored as sorted pairs, so two
        # policies placing the same names alike are equal and hash alike (it is a jit static).
        pairs = self.placements.items() if isinstance(self.placements, Mapping) else self.placements
        object.__setattr__(self, "placements", tuple(sorted((str(k), str(v)) for k, v in pairs)))
        for name, placement in self.placements:
            if placement not in PLACEMENTS:
                raise PolicyError(
                    f"tensor {name!r} has placement {placement!r}; a placement is one of {', '.join(PLACEMENTS)}"
                )
            if name == LAYER_INPUT and placement == "remat":
                raise PolicyError(
                    f"{LAYER_INPUT} cannot be rematerialised: nothing inside the layer computes it; "
                    "place it on 'device' or 'offload'"
                )
        names = [name for name, _ in self.placements]
        if len(set(names)) != len(names):
            raise PolicyError(f"a tensor is placed twice in {names}")
        if self.peel < 0:
            raise PolicyError(f"peel is {self.peel}; it counts the last layers run outside the loop: 0 or more")
        if self.keep_all and any(p != "device" for _, p in self.placements):
            raise PolicyError("keep_all keeps every residual on device; it takes no other placements")
        if self.engine not in ENGINES:
            raise PolicyError(f"engine is {self.engine!r}; an offload engine is one of {', '.join(ENGINES)}")
        if self.engine == "jax" and dict(self.placements).get(LAYER_INPUT) == "offload":
            raise PolicyError(
                f"engine 'jax' cannot offload {LAYER_INPUT}: jax.checkpoint keeps a layer's input where the "
                "scan put it (HBM); place it on 'device', or use engine 'ferry'"
            )

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, str] | None = None,
        *,
        keep_all: bool = False,
        pipelined: bool = True,
        peel: int = 0,
        engine: str = "ferry",
    ) -> Policy:
        """Build a policy from `{tensor name: placement}` (e.g. a Hydra config node); the same as
        `Policy(tensors)`."""
        return cls(dict(tensors or {}), keep_all, pipelined, peel, engine)

    @classmethod
    def save_all(cls) -> Policy:
        """Keep every residual on device: no recompute, no transfers."""
        return cls(keep_all=True)

    @property
    def peeled(self) -> bool:
        """Does this policy peel its scanned stacks of two layers or more (`peels`)?"""
        return self.peel > 0 and self.pipelined_by_ferry

    @property
    def pipelined_by_ferry(self) -> bool:
        """Does ferry's engine move a scanned stack's copies one layer apart (`ferry.offload_scan`)?
        JAX's own offload (`engine="jax"`) has no such schedule."""
        return self.pipelined and not self.keep_all and self.engine == "ferry"

    def peels(self, num_layers: int) -> int:
        """How many of a scanned stack's last layers run outside its loop under this policy
        (`ferry.offload_scan`; its first layer too, where any do): `peel`, at most all but the
        first, and only in a pipelined stack."""
        return min(self.peel, num_layers - 1) if self.peeled and num_layers >= 2 else 0

    def placement(self, name: str) -> Placement:
        if self.keep_all:
            return "device"
        default = "device" if name == LAYER_INPUT else "remat"
        return dict(self.placements).get(name, default)

    def __getitem__(self, name: str) -> Placement:
        return dict(self.placements)[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.placements)

    def __len__(self) -> int:
        return len(self.placements)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self)

    def validate(self, tagged: frozenset[str] | set[str]) -> None:
        """Refuse names the model never tags, listing the ones it does tag."""
        unknown = sorted(self.names - set(tagged) - {LAYER_INPUT})
        if unknown:
            raise PolicyError(
                f"the offload policy names {unknown}, which this model never tags; "
                f"it tags: {', '.join(sorted(set(tagged) | {LAYER_INPUT}))}"
            )


SAVE_ALL = Policy.save_all()
"""The default policy of a model called directly: no custom VJP, every residual in HBM."""


# --------------------------------------------------------------------------------------------
# The tag context: the engine's only global state, a context-variable stack of recorders /
# injectors that is non-empty only while `offloaded` traces a layer (a context variable, so
# threads and async tasks tracing at once each see their own).


class NestedTagError(PolicyError):
    """A tag inside a transformation nested in the layer (an inner `lax.scan`, `jax.checkpoint`,
    `vmap`...): its value lives in that transformation's trace, so the engine cannot save it."""


def _current_trace() -> object:
    """The innermost JAX trace now active: a tag is at a layer's top level when it is traced
    under the same trace as the layer itself."""
    return jax_core.trace_ctx.trace


class _Handler:
    """What `tag` calls while a layer is traced; refuses tags nested in inner transformations."""

    def __init__(self) -> None:
        self.trace = _current_trace()

    def check_top_level(self, name: str) -> None:
        if _current_trace() is not self.trace:
            raise NestedTagError(
                f"tag {name!r} sits inside a transformation nested in the layer (lax.scan, jax.checkpoint, "
                "vmap, cond...), whose values the offload engine cannot save or place: tag the layer's "
                "own values, e.g. the output of that scan or checkpoint, not values inside it"
            )


class _Recorder(_Handler):
    """Collects tagged values (and their logical axes) in the order the layer produces them; with
    `on_tag`, each value is replaced by what it returns (the engine issues its host copy there,
    as soon as the value exists)."""

    def __init__(self, on_tag: Callable[[str, jax.Array, Axes], Any] | None = None) -> None:
        super().__init__()
        self.values: list[tuple[str, jax.Array]] = []
        self.axes: list[Axes] = []
        self.saved: list[Any] = []
        self.on_tag = on_tag

    def __call__(self, x: jax.Array, name: str, axes: Axes) -> jax.Array:
        self.check_top_level(name)
        self.values.append((name, x))
        self.axes.append(axes)
        if self.on_tag is not None:
            self.saved.append(self.on_tag(name, x, axes))
        return x


class _Namer(_Handler):
    """Names each tagged value for JAX's own remat policies (`jax.ad_checkpoint.checkpoint_name`)."""

    def __call__(self, x: jax.Array, name: str, axes: Axes) -> jax.Array:
        self.check_top_level(name)
        return checkpoint_name(x, name)


class _Injector(_Handler):
    """Replaces the k-th value tagged `name` by its saved copy; `finish` refuses a replay that
    did not reach every saved value (a layer whose tags depend on anything but its inputs)."""

    def __init__(self, saved: list[tuple[str, jax.Array | None]]) -> None:
        super().__init__()
        self.saved = saved
        self.position = 0

    def __call__(self, x: jax.Array, name: str, axes: Axes) -> jax.Array:
        self.check_top_level(name)
        if self.position >= len(self.saved):
            raise RuntimeError(f"tag {name!r} appeared in the replay but not in the forward pass")
        saved_name, saved = self.saved[self.position]
        self.position += 1
        if saved_name != name:
            raise RuntimeError(f"replay tagged {name!r} where the forward pass tagged {saved_name!r}")
        return x if saved is None else _inject(x, saved)

    def finish(self) -> None:
        if self.position != len(self.saved):
            unused = [name for name, _ in self.saved[self.position :]]
            raise RuntimeError(
                f"the replay of the layer tagged {self.position} values but the forward pass saved "
                f"{len(self.saved)}: {unused} were never reached (the layer must tag the same values in "
                "the same order every time it runs on the same inputs)"
            )


_TAG_CONTEXT: contextvars.ContextVar[tuple[_Handler, ...]] = contextvars.ContextVar("ferry_tag_context", default=())


@contextlib.contextmanager
def _tag_context(handler: _Handler) -> Iterator[None]:
    token = _TAG_CONTEXT.set((*_TAG_CONTEXT.get(), handler))
    try:
        yield
    finally:
        _TAG_CONTEXT.reset(token)


def tag(x: jax.Array, name: str, axes: Axes = None) -> jax.Array:
    """Name an activation so an offload policy can place it. Tag a layer's matmul outputs (a
    value whose tangent needs no recomputed matmul), at the layer's top level (not inside an
    inner scan or checkpoint). `axes` names its dimensions logically (e.g.
    `("batch", "seq", "mlp")`) so that under a mesh its sharding is pinned by the activation
    rules, and its host copy is sharded the same way; without `axes` the value's sharding is left
    to XLA. The value is unchanged: outside `offloaded` and without a mesh, `tag` is the identity."""
    if axes is not None:
        x = constrain(x, axes)
    handlers = _TAG_CONTEXT.get()
    if not handlers:
        return x
    return handlers[-1](x, name, axes)


@jax.custom_jvp
def _inject(recomputed: jax.Array, saved: jax.Array) -> jax.Array:
    return saved


@_inject.defjvp
def _inject_jvp(primals: tuple[jax.Array, jax.Array], tangents: tuple[Any, Any]) -> tuple[jax.Array, Any]:
    _, saved = primals
    recomputed_tangent, _ = tangents
    return saved, recomputed_tangent


def record_tags(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[tuple[str, jax.Array]]]:
    """Run `fn(*args)` and return its output with the (name, value) of every tag it passed."""
    out, values, _ = record_tags_and_axes(fn, *args)
    return out, values


def record_tags_and_axes(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[tuple[str, jax.Array]], list[Axes]]:
    """`record_tags`, with the logical axes each tag gave (None where it gave none)."""
    recorder = _Recorder()
    with _tag_context(recorder):
        out = fn(*args)
    return out, recorder.values, recorder.axes


def tagged_names(fn: Callable[..., Any], *args: Any) -> frozenset[str]:
    """The names `fn(*args)` tags, found by abstract evaluation (nothing is computed)."""
    names: set[str] = set()

    def names_only(*a: Any) -> Any:
        out, values = record_tags(fn, *a)
        names.update(name for name, _ in values)
        return out

    eqx.filter_eval_shape(names_only, *args)
    return frozenset(names) | {LAYER_INPUT}


# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# The custom VJP.

COPY_SCOPE = "ferry_offload"
"""Every host copy is issued under the name scope `ferry_offload/<layer>/<tensor>/<direction>`
(direction `to_host` or `to_device`), so the copies of the compiled program (their HLO
`op_name` metadata) say which tensor of which layer group they move."""


def copy_scope(layer: str, tensor: str, direction: str) -> str:
    return f"{COPY_SCOPE}/{layer}/{tensor}/{direction}"


def replay_vjp(
    layer: Callable[[Any, jax.Array], Any],
    injected: list[tuple[str, jax.Array | None]],
    params: Any,
    h: jax.Array,
    cotangent: Any,
) -> tuple[Any, jax.Array]:
    """The gradients (params, input) of `layer(params, h)` replayed with the saved values
    `injected` at their tags (None: recomputed): the backward pass of every offloaded layer."""

    def replay(p: Any, x: jax.Array) -> Any:
        injector = _Injector(injected)
        with _tag_context(injector):
            out = layer(p, x)
        injector.finish()
        return out

    _, vjp = jax.vjp(replay, params, h)
    return vjp(cotangent)


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
    engine adds two optimisation barriers in `layer_bwd` (one orders the reloads after the
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

    def save(tensor: str, value: jax.Array, axes: Axes) -> jax.Array | None:
        placement = policy.placement(tensor)
        if placement == "offload":
            with jax.named_scope(copy_scope(name, tensor, "to_host")):
                return to_memory(value, "pinned_host", axes)
        return value if placement == "device" else None

    def restore(tensor: str, value: jax.Array | None, axes: Axes) -> jax.Array | None:
        if policy.placement(tensor) == "offload":
            with jax.named_scope(copy_scope(name, tensor, "to_device")):
                return to_memory(value, "device", axes)
        return value

    def call(params: Any, x: jax.Array, *extra: Any) -> Any:
        diff, rest = eqx.partition(params, eqx.is_inexact_array)
        fixed, static = eqx.partition(rest, eqx.is_array)  # integer arrays: inputs, never differentiated
        names: list[str] = []  # the tag order of the forward pass; residuals must be arrays
        axes: list[Axes] = []

        def layer_fn(p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> Any:
            return fn(eqx.combine(p, f, static), h, *e)

        @jax.custom_vjp
        def layer(p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> Any:
            return layer_fn(p, h, f, e)

        def layer_fwd(p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> tuple[Any, Any]:
            # each value's host copy is issued at its tag, as soon as the value exists, so the
            # rest of the layer's forward pass can hide it
            recorder = _Recorder(on_tag=save)
            with _tag_context(recorder):
                out = layer_fn(p, h, f, e)
            names[:] = [tensor for tensor, _ in recorder.values]
            axes[:] = recorder.axes
            if check_names:
                policy.validate(set(names))
            return out, (p, save(LAYER_INPUT, h, None), f, e, recorder.saved)

        def layer_bwd(residuals: Any, cotangent: Any) -> tuple[Any, Any, None, None]:
            p, h, f, e, saved = residuals
            if not in_scan:
                # The reloads wait for the layer's backward pass (its cotangent), through a barrier.
                # Outside a loop XLA would otherwise fold a copy to host that is read straight back
                # into nothing, and where it keeps the copies it starts each reload as soon as its
                # store is done: the value back in HBM from the forward pass on, saving nothing
                # (Llama 3.1 8B layers unscanned, one H200: 7.79 GiB of temporaries against
                # save_all's 7.73; with the barrier 7.01).
                cotangent, h, saved = jax.lax.optimization_barrier((cotangent, h, saved))
            h = restore(LAYER_INPUT, h, None)
            saved = [restore(tensor, value, a) for tensor, value, a in zip(names, saved, axes, strict=True)]
            if not in_scan:
                # What the replay reads passes a barrier, as `jax.checkpoint`'s prevent_cse does:
                # outside a loop XLA would otherwise merge the replay with the forward pass, keeping
                # the forward values alive and saving nothing.
                p, h, f, e, saved = jax.lax.optimization_barrier((p, h, f, e, saved))
            injected = list(zip(names, saved, strict=True))
            return (*replay_vjp(lambda p_, h_: layer_fn(p_, h_, f, e), injected, p, h, cotangent), None, None)

        layer.defvjp(layer_fwd, layer_bwd)
        return layer(diff, x, fixed, extra)

    return call


def checkpointed_by_jax(fn: Callable[..., Any], policy: Policy, *, in_scan: bool = False) -> Callable[..., Any]:
    """The layer `fn(params, x, *extra)` with `policy`'s placements made by JAX's own offload:
    `jax.checkpoint` with `save_and_offload_only_these_names`, each tag a `checkpoint_name`.
    What a JAX user would write instead of ferry's engine, so the two can be compared on the
    same model and tensors (`offload.engine=jax`). The layer input stays where the scan keeps it.
    """
    placed = {placement: [name for name, p in policy.placements if p == placement] for placement in PLACEMENTS}
    remat_policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=placed["device"],
        names_which_can_be_offloaded=placed["offload"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def named(params: Any, x: jax.Array, *extra: Any) -> Any:
        with _tag_context(_Namer()):
            return fn(params, x, *extra)

    # in a scan body JAX's own advice: no CSE barrier (the loop already keeps the replay apart)
    return eqx.filter_checkpoint(named, policy=remat_policy, prevent_cse=not in_scan)
