"""Tags and the tag context: the interface both halves of the offload engine (`ferry.offload.engine`,
per layer; `ferry.offload.scan`, pipelined stacks) and JAX's own offload share.

A layer names its activations with `tag`; while the engine traces it, the innermost handler of
the tag context sees each tagged value: a `Recorder` collects them (the forward pass), an
`Injector` swaps in their saved copies (the replay), a `Namer` hands them to JAX's remat policies.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jax_core

from ferry.offload.policy import LAYER_INPUT, PolicyError
from ferry.sharding import constrain

Axes = tuple[str | None, ...] | None
"""A value's logical axes (`ferry.sharding`), one name or None per dimension; None: unnamed."""

# The tag context: the engine's only global state, a context-variable stack of recorders /
# injectors that is non-empty only while `offloaded` traces a layer (a context variable, so
# threads and async tasks tracing at once each see their own).


class NestedTagError(PolicyError):
    """A tag inside a transformation nested in the layer (an inner `lax.scan`, `jax.checkpoint`,
    `vmap`...): its value lives in that transformation's trace, so the engine cannot save it."""


def _current_trace() -> object:
    """The innermost JAX trace now active (an opaque token, equal for the same trace): a tag is at
    a layer's top level when it is traced under the same trace as the layer itself."""
    return jax_core.get_opaque_trace_state()


class TagHandler:
    """What `tag` calls while a layer is traced; refuses tags nested in inner transformations."""

    def __init__(self) -> None:
        self.trace = _current_trace()

    def __call__(self, x: jax.Array, name: str, axes: Axes) -> jax.Array:
        """What `tag(x, name, axes)` returns while this handler is the innermost."""
        raise NotImplementedError

    def check_top_level(self, name: str) -> None:
        if _current_trace() != self.trace:
            raise NestedTagError(
                f"tag {name!r} sits inside a transformation nested in the layer (lax.scan, jax.checkpoint, "
                "vmap, cond...), whose values the offload engine cannot save or place: tag the layer's "
                "own values, e.g. the output of that scan or checkpoint, not values inside it"
            )


class Recorder(TagHandler):
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


class Namer(TagHandler):
    """Names each tagged value for JAX's own remat policies (`jax.ad_checkpoint.checkpoint_name`)."""

    def __call__(self, x: jax.Array, name: str, axes: Axes) -> jax.Array:
        self.check_top_level(name)
        return checkpoint_name(x, name)


class Injector(TagHandler):
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


TAG_CONTEXT: contextvars.ContextVar[tuple[TagHandler, ...]] = contextvars.ContextVar("ferry_tag_context", default=())


@contextlib.contextmanager
def tag_context(handler: TagHandler) -> Iterator[None]:
    token = TAG_CONTEXT.set((*TAG_CONTEXT.get(), handler))
    try:
        yield
    finally:
        TAG_CONTEXT.reset(token)


def tag(x: jax.Array, name: str, axes: Axes = None) -> jax.Array:
    """Name an activation so an offload policy can place it. Tag a layer's matmul outputs (a
    value whose tangent needs no recomputed matmul), at the layer's top level (not inside an
    inner scan or checkpoint). `axes` names its dimensions logically (e.g.
    `("batch", "seq", "mlp")`) so that under a mesh its sharding is pinned by the activation
    rules, and its host copy is sharded the same way; without `axes` the value's sharding is left
    to XLA. The value is unchanged: outside `offloaded` and without a mesh, `tag` is the identity."""
    if axes is not None:
        x = constrain(x, axes)
    handlers = TAG_CONTEXT.get()
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
    recorder = Recorder()
    with tag_context(recorder):
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
        injector = Injector(injected)
        with tag_context(injector):
            out = layer(p, x)
        injector.finish()
        return out

    _, vjp = jax.vjp(replay, params, h)
    return vjp(cotangent)
