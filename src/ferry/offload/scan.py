"""A stack of identical layers whose host copies are software-pipelined one layer deep, in Python.

`offloaded` (ferry.offload.engine) moves a layer's residuals inside that layer: a store issued at its
tag has only the rest of the layer to hide under, and a reload issued when the backward pass
reaches the layer has nothing (the replay reads it at once). Inside a `lax.scan` neither copy can
straddle two iterations, so `offloaded_scan` moves them itself, one layer apart:

- forward, iteration k: store layer k-1's offloaded values (carried in HBM from iteration k-1)
  while layer k runs; iteration 0 stores the carry's zeros, and layer L-1's values leave the
  loop in HBM: the backward pass reads them first, so they never make the round trip;
- backward, iteration k: reload layer k-1's values (the host stack's entry k) while layer k's
  backward runs, and carry them to iteration k-1: a double buffer.

Every copy so gets a whole layer's compute to hide under, both loop indices are the iteration
(a plain scan output and input), and the bytes crossing the link are those of the per-layer
engine (the zeros' store replaces layer L-1's). The cost: one more layer of offloaded values
in HBM, in both passes; `pipelined_bytes` says how much.

Peeled (`Policy.peels`: `offload.peel` = n), layer 0 and the last n layers run outside the loop:
layer 0 stores nothing (no placeholder crosses the link), each of the last n stores the values of
the layer before it, and the backward pass reloads them as that layer's backward starts, so those
copies are free to overlap whatever XLA schedules around them (the later layers, the loss head),
where in a loop an iteration's copies can hide only under that iteration. The layer body is then
compiled n + 2 times.

With a gradient sink (`sink`: float32 arrays shaped like the stack's differentiated leaves, the
gradient accumulated over earlier micro batches) the backward pass adds each layer's gradient
into it in place and returns the sum as the sink's cotangent, the stack's own being zero: a micro
batch's gradient of the stack never exists whole beside the accumulator (`ferry.train.gradient_sink`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ferry.offload.engine import (
    LAYER_INPUT,
    Axes,
    Policy,
    copy_scope,
    layer_function,
    record_tags_and_axes,
    replay_vjp,
    split_params,
    to_memory,
)
from ferry.sharding import constrain


def offloaded_scan(fn: Callable[..., Any], policy: Policy, *, name: str = "layers") -> Callable[..., Any]:
    """Wrap `fn(layer, x, *extra) -> (x, stats)` into `run(stacked_layers, x, *extra, sink=None) ->
    (x, stacked stats)`: a `lax.scan` over the stacked layers (the leading axis of every array leaf
    of `stacked_layers`) whose residuals are placed by `policy`, offloaded ones pipelined one
    layer apart (module docstring). Floating-point leaves of `stacked_layers` and `x` are
    differentiated; integer leaves and `extra` are not. `name` names the copies' scope. With a
    `sink` the stack's gradient is added into it in place (module docstring)."""
    if policy.keep_all:
        return functools.partial(_plain_scan, fn)

    def call(stacked: Any, x: jax.Array, *extra: Any, sink: Any = None) -> Any:
        diff, fixed, static = split_params(stacked)
        layer_fn = layer_function(fn, static)
        steps = _Steps(layer_fn, _Layout.of(layer_fn, diff, x, fixed, extra, policy), name)
        num_layers = jax.tree.leaves(diff)[0].shape[0]
        tail = policy.peels(num_layers)  # layers after the loop (and layer 0 before it), when peeled
        if tail:
            peeled = _Peeled(steps, num_layers - tail, num_layers)
            forward, backward = peeled.forward, peeled.backward
        else:
            forward, backward = functools.partial(_pipelined_fwd, steps), functools.partial(_pipelined_bwd, steps)
        if sink is None:
            run = jax.custom_vjp(functools.partial(_scan, layer_fn))
            run.defvjp(forward, backward)
            return run(diff, x, fixed, extra)
        sinking = jax.custom_vjp(functools.partial(_sinking_scan, layer_fn))
        sinking.defvjp(functools.partial(_sinking_fwd, forward), functools.partial(_sinking_bwd, backward))
        return sinking(diff, split_params(sink)[0], x, fixed, extra)

    return call


def _plain_scan(fn: Callable[..., Any], stacked: Any, x: jax.Array, *extra: Any) -> Any:
    """`keep_all`: a plain scan, JAX's own autodiff keeping every residual in HBM."""
    dynamic, static = eqx.partition(stacked, eqx.is_array)
    return jax.lax.scan(lambda h, d: fn(eqx.combine(d, static), h, *extra), x, dynamic)


def _scan(layer_fn: Callable[..., Any], p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> Any:
    """The stack's primal: a scan of `layer_fn` over the stacked (p, f)."""
    return jax.lax.scan(lambda c, xs: layer_fn(xs[0], c, xs[1], e), h, (p, f))


def _sinking_scan(layer_fn: Callable[..., Any], p: Any, sink: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> Any:
    """The primal of a stack with a gradient sink: the sink is not read."""
    return _scan(layer_fn, p, h, f, e)


def _sinking_fwd(forward: Callable[..., Any], p: Any, sink: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> Any:
    out, residuals = forward(p, h, f, e)
    return out, (residuals, sink)


def _sinking_bwd(backward: Callable[..., Any], residuals: Any, cotangent: Any) -> tuple[Any, ...]:
    """The stack's backward pass with its gradient added into the sink: the sink's cotangent, the
    stack's own None (zero)."""
    residuals, sink = residuals
    summed, dx, _, _ = backward(residuals, cotangent, sink=sink)
    return None, summed, dx, None, None


@dataclasses.dataclass(frozen=True)
class _Steps:
    """One layer's forward and backward step, shared by the loop bodies and the peeled layers."""

    layer_fn: Callable[..., Any]
    layout: _Layout
    name: str  # the copies' scope

    def forward(self, p_k: Any, f_k: Any, e: tuple[Any, ...], h: jax.Array, pending: Any) -> tuple[Any, ...]:
        """Layer k's forward pass, the store of `pending` (layer k-1's offloaded values, None for
        none) issued first: all of layer k hides it."""
        stored = None if pending is None else self.layout.store(pending, self.name)
        (out_h, stats), tagged, _ = record_tags_and_axes(self.layer_fn, p_k, h, f_k, e)
        values = self.layout.recorded(tagged)
        return out_h, self.layout.offloaded(values, h), stats, self.layout.kept(values, h), stored

    def backward(
        self, p_k: Any, f_k: Any, e: tuple[Any, ...], kept_k: Any, current: Any, ct: Any, ct_stats_k: Any
    ) -> Any:
        """Layer k's gradients (params, input), replayed with its saved values (`current`: its
        offloaded ones, back in HBM)."""
        h, injected = self.layout.saved(kept_k, current)
        return replay_vjp(lambda p_, h_: self.layer_fn(p_, h_, f_k, e), injected, p_k, h, (ct, ct_stats_k))

    def reload(self, stored: Any) -> Any:
        return self.layout.reload(stored, self.name)


def _pipelined_fwd(steps: _Steps, p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> tuple[Any, Any]:
    """Every layer in the loop: iteration k stores layer k-1's values (iteration 0 the zeros)."""

    def forward_body(carry: Any, xs: Any) -> tuple[Any, Any]:
        (p_k, f_k), (h_k, pending) = xs, carry
        out_h, offloaded, stats, kept, stored = steps.forward(p_k, f_k, e, h_k, pending)
        return (out_h, offloaded), (stats, kept, stored)

    (out, last), (stats, kept, stored) = jax.lax.scan(forward_body, (h, steps.layout.zeros()), (p, f))
    return (out, stats), (p, f, e, kept, stored, last)


def _pipelined_bwd(steps: _Steps, residuals: Any, cotangent: Any, sink: Any = None) -> tuple[Any, Any, None, None]:
    """The reverse loop: iteration k reloads layer k-1's values while layer k's backward runs. Its
    gradients are the loop's outputs, or are added into `sink`, a loop carry updated in place."""
    p, f, e, kept, stored, last = residuals
    ct_out, ct_stats = cotangent

    def backward_body(carry: Any, xs: Any) -> tuple[Any, Any]:
        ct, current, summed = carry  # current: layer k's offloaded values, in HBM
        k, p_k, f_k, kept_k, stored_k, ct_stats_k = xs
        previous = steps.reload(stored_k)  # layer k-1's: all of layer k's backward hides it
        dp, dh = steps.backward(p_k, f_k, e, kept_k, current, ct, ct_stats_k)
        if summed is None:
            return (dh, previous, None), dp
        return (dh, previous, jax.tree.map(lambda a, d: _add_at(a, d, k), summed, dp)), None

    layers = None if sink is None else jnp.arange(jax.tree.leaves(p)[0].shape[0])  # where each layer's sum goes
    xs = (layers, p, f, kept, stored, ct_stats)
    (dx, _, summed), dp = jax.lax.scan(backward_body, (ct_out, last, sink), xs, reverse=True)
    return (dp if sink is None else summed), dx, None, None


@dataclasses.dataclass(frozen=True)
class _Peeled:
    """Layer 0, a loop over layers 1..loop_end-1, then layers loop_end..num_layers-1: the custom
    VJP of a peeled stack (`Policy.peels`)."""

    steps: _Steps
    loop_end: int
    num_layers: int

    def forward(self, p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> tuple[Any, Any]:
        """No placeholder is stored, and the stores issued outside the loop may run on under the
        rest of the forward pass and the loss head."""
        h, pending, stats_0, kept_0, _ = self.steps.forward(_at(p, 0), _at(f, 0), e, h, None)

        # Each loop reads its layer's index from an array (`jnp.arange`), and XLA copies the
        # layer's weights out of the stack each iteration (a copy kernel; the peak HBM is the
        # same). With a counter carried through the loop the matmuls would read them in place,
        # but XLA merges that counter with the loop's own and updates it in place before the
        # layer runs, so every store must finish before the layer's first matmul: nothing
        # hides it (docs/results/deviceless.md, "A peeled stack's loop index").
        def forward_body(carry: Any, k: jax.Array) -> tuple[Any, Any]:
            out_h, offloaded, stats, kept, stored = self.steps.forward(_at(p, k), _at(f, k), e, *carry)
            return (out_h, offloaded), (stats, kept, stored)

        stats, kept, stored = [_stack_of_one(stats_0)], None, None  # the loop's kept and stored: None without a loop
        if self.loop_end > 1:
            xs = jnp.arange(1, self.loop_end)
            (h, pending), (looped, kept, stored) = jax.lax.scan(forward_body, (h, pending), xs)
            stats.append(looped)
        kept_tail, stored_tail = [], []
        for k in range(self.loop_end, self.num_layers):
            h, pending, stats_k, kept_k, stored_k = self.steps.forward(_at(p, k), _at(f, k), e, h, pending)
            stats.append(_stack_of_one(stats_k))
            kept_tail.append(kept_k)
            stored_tail.append(stored_k)  # layer k-1's values, on host
        stats = jax.tree.map(lambda *parts: jnp.concatenate(parts), *stats)
        return (h, stats), (p, f, e, (kept_0, kept, kept_tail), (stored, stored_tail), pending)

    def backward_step(
        self, p: Any, f: Any, e: tuple[Any, ...], write: Callable[..., Any], carry: Any, xs: Any
    ) -> tuple[Any, None]:
        """Layer k's backward pass, layer k-1's reload issued first (all of it hides the copy), its
        gradients written (`_put`) or added (`_add_at`) into the stack's: a loop body, and the
        peeled layers'."""
        dh, current, dp = carry
        k, kept_k, stored_k, ct_stats_k = xs
        previous = self.steps.reload(stored_k)
        dp_k, dh = self.steps.backward(_at(p, k), _at(f, k), e, kept_k, current, dh, ct_stats_k)
        return (dh, previous, jax.tree.map(lambda a, d: write(a, d, k), dp, dp_k)), None

    def backward(self, residuals: Any, cotangent: Any, sink: Any = None) -> tuple[Any, Any, None, None]:
        """The reverse of `forward`. Outside the loop the layers pass barriers, as the per-layer
        engine's unscanned layers do (`ferry.offload.engine.offloaded`): the host values wait for the
        cotangent (else XLA folds a store read straight back into nothing: the loop's too, which
        XLA unrolls where it runs one layer), each reload of a layer after the loop waits for the
        cotangent of the layer above (so it is issued as that layer's backward starts, not all at
        once), and no replay may merge with the forward pass. With a `sink` the gradients are added into it."""
        p, f, e, (kept_0, kept, kept_tail), (stored, stored_tail), current = residuals
        ct_out, ct_stats = cotangent
        dh, p, f, kept_tail, current, stored, stored_tail = jax.lax.optimization_barrier(
            (ct_out, p, f, kept_tail, current, stored, stored_tail)
        )
        write = _put if sink is None else _add_at
        step = functools.partial(self.backward_step, p, f, e, write)
        loop_end, num_layers = self.loop_end, self.num_layers
        dp = jax.tree.map(jnp.zeros_like, p) if sink is None else sink
        for k in reversed(range(loop_end, num_layers)):
            stored_k = stored_tail[k - loop_end]
            if k < num_layers - 1:
                dh, stored_k = jax.lax.optimization_barrier((dh, stored_k))
            ct_stats_k = jax.tree.map(lambda a, k=k: a[k], ct_stats)
            (dh, current, dp), _ = step((dh, current, dp), (k, kept_tail[k - loop_end], stored_k, ct_stats_k))
        if loop_end > 1:
            ct_middle = jax.tree.map(lambda a: a[1:loop_end], ct_stats)
            xs = (jnp.arange(1, loop_end), kept, stored, ct_middle)
            (dh, current, dp), _ = jax.lax.scan(step, (dh, current, dp), xs, reverse=True)
        dh, p, f, kept_0, current = jax.lax.optimization_barrier((dh, p, f, kept_0, current))
        ct_stats_0 = jax.tree.map(lambda a: a[0], ct_stats)
        dp_0, dx = self.steps.backward(_at(p, 0), _at(f, 0), e, kept_0, current, dh, ct_stats_0)
        return jax.tree.map(lambda a, d: write(a, d, 0), dp, dp_0), dx, None, None


def _at(tree: Any, k: int | jax.Array) -> Any:
    """Layer k of stacked arrays (k may be traced: a loop's index)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, keepdims=False), tree)


def _stack_of_one(tree: Any) -> Any:
    """One layer's arrays as a stack of one layer."""
    return jax.tree.map(lambda a: a[None], tree)


def _put(stacked: jax.Array, value: jax.Array, k: int | jax.Array) -> jax.Array:
    """`stacked` with layer k replaced by `value` (in place where XLA can)."""
    return jax.lax.dynamic_update_index_in_dim(stacked, value.astype(stacked.dtype), k, 0)


def _add_at(stacked: jax.Array, value: jax.Array, k: int | jax.Array) -> jax.Array:
    """`stacked` with `value` added to layer k (in `stacked`'s dtype, in place where XLA can)."""
    total = jax.lax.dynamic_index_in_dim(stacked, k, keepdims=False) + value.astype(stacked.dtype)
    return jax.lax.dynamic_update_index_in_dim(stacked, total, k, 0)


class _Layout:
    """One layer's residuals by placement: which tags (and whether its input) go to host, which
    stay in HBM, and the shapes of the pipelined ones (for the forward carry's zeros)."""

    def __init__(self, names: list[str], axes: list[Axes], shapes: list[jax.ShapeDtypeStruct], x: Any, policy: Policy):
        self.names = names
        placements = [policy.placement(n) for n in names]
        self.offload_input = policy.placement(LAYER_INPUT) == "offload"
        self.offloaded_index = [i for i, p in enumerate(placements) if p == "offload"]
        self.device_index = [i for i, p in enumerate(placements) if p == "device"]
        pipelined = [(shapes[i], axes[i]) for i in self.offloaded_index]
        if self.offload_input:
            pipelined.append((jax.ShapeDtypeStruct(x.shape, x.dtype), None))
        self.pipelined = pipelined
        self.pipelined_names = [names[i] for i in self.offloaded_index] + ([LAYER_INPUT] if self.offload_input else [])

    @classmethod
    def of(
        cls, layer_fn: Callable[..., Any], diff: Any, x: jax.Array, fixed: Any, extra: tuple[Any, ...], policy: Policy
    ) -> _Layout:
        """Found by running the first layer abstractly (nothing is computed)."""
        first = jax.tree.map(lambda a: a[0], (diff, fixed))
        found: dict[str, Any] = {}

        def record(p: Any, h: jax.Array, f: Any, e: tuple[Any, ...]) -> list[jax.Array]:
            _, values, axes = record_tags_and_axes(layer_fn, p, h, f, e)
            found["names"], found["axes"] = [n for n, _ in values], axes
            return [v for _, v in values]

        shapes = jax.eval_shape(record, first[0], x, first[1], extra)
        return cls(found["names"], found["axes"], shapes, x, policy)

    def recorded(self, tagged: list[tuple[str, jax.Array]]) -> list[jax.Array]:
        """The values a layer's run tagged, checked against the abstract run's names."""
        names = [n for n, _ in tagged]
        if names != self.names:
            raise RuntimeError(f"the layer tagged {names} where its abstract run tagged {self.names}")
        return [value for _, value in tagged]

    def zeros(self) -> tuple[jax.Array, ...]:
        return tuple(
            constrain(jnp.zeros(s.shape, s.dtype), a) if a else jnp.zeros(s.shape, s.dtype) for s, a in self.pipelined
        )

    def offloaded(self, values: list[jax.Array], h: jax.Array) -> tuple[jax.Array, ...]:
        out = [values[i] for i in self.offloaded_index]
        return tuple([*out, h] if self.offload_input else out)

    def kept(self, values: list[jax.Array], h: jax.Array) -> tuple[Any, ...]:
        """What stays in HBM: the device-placed values and the input (unless offloaded)."""
        return tuple(values[i] for i in self.device_index), (None if self.offload_input else h)

    def store(self, pending: tuple[jax.Array, ...], layer: str) -> tuple[jax.Array, ...]:
        return self._move(pending, layer, "pinned_host", "to_host")

    def reload(self, stored: tuple[jax.Array, ...], layer: str) -> tuple[jax.Array, ...]:
        return self._move(stored, layer, "device", "to_device")

    def _move(
        self, values: tuple[jax.Array, ...], layer: str, memory_kind: str, direction: str
    ) -> tuple[jax.Array, ...]:
        """Each pipelined value to `memory_kind`, under its copy scope (`copy_scope`)."""
        out = []
        for tensor, value, (_, axes) in zip(self.pipelined_names, values, self.pipelined, strict=True):
            with jax.named_scope(copy_scope(layer, tensor, direction)):
                out.append(to_memory(value, memory_kind, axes))
        return tuple(out)

    def saved(self, kept: tuple[Any, ...], current: tuple[jax.Array, ...]) -> tuple[jax.Array, list]:
        """The layer's input and its (name, saved value or None) in tag order, for the injector."""
        device_values, h = kept
        by_index = dict(zip(self.device_index, device_values, strict=True))
        by_index |= dict(zip(self.offloaded_index, current, strict=False))
        if self.offload_input:
            h = current[-1]
        return h, [(n, by_index.get(i)) for i, n in enumerate(self.names)]
