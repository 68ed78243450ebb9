"""Identical decoder layers stored as one module with a leading layer axis.

The layers are built with a vmapped init and run with `lax.scan` over the `eqx.partition`ed
arrays, so a 126-layer model compiles one layer body. Each layer runs through the offload engine.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ferry.nn.block import LayerOutput
from ferry.nn.kernels.flash import with_declared_lse
from ferry.offload.engine import Policy, offloaded, tagged_names
from ferry.offload.scan import offloaded_scan


class LayerStack(eqx.Module):
    layers: eqx.Module
    num_layers: int = eqx.field(static=True)
    scan_layers: bool = eqx.field(static=True)
    name: str = eqx.field(static=True)
    gradient_sink: Any = None  # set by `sinking` inside a micro batch's loss only

    def __init__(
        self,
        make_layer: Callable[[PRNGKeyArray], eqx.Module],
        num_layers: int,
        *,
        key: PRNGKeyArray,
        scan_layers: bool = True,
        name: str = "layers",
    ):
        self.layers = eqx.filter_vmap(make_layer)(jax.random.split(key, num_layers))
        self.num_layers = num_layers
        self.scan_layers = scan_layers
        self.name = name
        self.gradient_sink = None

    def sinking(self, sink: Any) -> "LayerStack":
        """This stack with its gradient added into `sink` (the gradient of earlier micro batches:
        float32 arrays shaped like the layers' floating leaves) and returned as the sink's, so one
        buffer holds the stack's gradient (`ferry.train.gradient_sink`): the layers themselves are
        not differentiated."""
        frozen = jax.tree.map(lambda a: jax.lax.stop_gradient(a) if eqx.is_inexact_array(a) else a, self.layers)
        return eqx.tree_at(lambda s: (s.layers, s.gradient_sink), self, (frozen, sink), is_leaf=lambda x: x is None)

    @property
    def pipelined(self) -> bool:
        """Does this stack run its layers in a scan of more than one step (XLA unrolls a scan of
        one step)? Only there does a pipelined policy move its copies one layer apart, and only
        there are the layers the body of a loop (`offloaded`'s `in_scan`)."""
        return self.scan_layers and self.num_layers > 1

    def layer(self, index: int) -> eqx.Module:
        """One layer, unstacked."""
        return _layer_of(self.layers, index)

    def tagged_names(self, x: Any, *extra: Any) -> frozenset[str]:
        """The activation names one layer tags for an input like `x` (found abstractly; the stack
        itself may be abstract)."""
        names = tagged_names(lambda stack, h, *e: stack.layer(0)(h, *e), self, x, *extra)
        return with_declared_lse(names)  # attention_lse on every backend

    def __call__(
        self,
        x: Float[Array, "batch seq dim"],
        policy: Policy,
        *extra: Any,
        tagged_elsewhere: frozenset[str] = frozenset(),
    ) -> tuple[Float[Array, "batch seq dim"], Any]:
        """Run every layer as `layer(h, *extra)` (`extra`: inputs every layer reads and nothing
        differentiates, such as segment ids); a layer returns `h`, or a `LayerOutput` of `h` and
        its statistics. Returns the last `h` and the stats of all layers stacked along a leading
        layer axis (None when layers report none).

        The policy may name only tensors this stack's layer tags or `tagged_elsewhere` (the
        names the model's other layers tag): a misspelt name is an error listing the names."""
        if not policy.keep_all and policy.names - tagged_elsewhere:  # tracing the layer only if it decides
            policy.validate(self.tagged_names(x, *extra) | tagged_elsewhere)
        if self.pipelined and policy.pipelined_by_ferry:  # the backward loop adds into the sink in place
            run_stack = offloaded_scan(_hidden_and_stats, policy, name=self.name)
            return run_stack(self.layers, x, *extra, sink=self.gradient_sink)
        layers = self.layers if self.gradient_sink is None else _into_sink(self.layers, self.gradient_sink)
        run = offloaded(_run_layer, policy, check_names=False, name=self.name, in_scan=self.pipelined)
        if self.pipelined:
            dynamic, static = eqx.partition(layers, eqx.is_array)

            def step(h: jax.Array, d: Any) -> tuple[jax.Array, Any]:
                out = run(eqx.combine(d, static), h, *extra)
                return out.hidden, out.stats

            return jax.lax.scan(step, x, dynamic)
        all_stats = []
        for index in range(self.num_layers):
            out = run(_layer_of(layers, index), x, *extra)
            x = out.hidden
            all_stats.append(out.stats)
        return x, stack_trees(all_stats)


def _layer_of(layers: eqx.Module, index: int) -> eqx.Module:
    dynamic, static = eqx.partition(layers, eqx.is_array)
    return eqx.combine(jax.tree.map(lambda a: a[index], dynamic), static)


def _into_sink(layers: eqx.Module, sink: Any) -> eqx.Module:
    """`layers` whose gradient is added into `sink` and returned as the sink's: where no loop of
    ferry's engine does it in place, the same sum taken once the stack's gradient is whole."""
    diff, rest = eqx.partition(layers, eqx.is_inexact_array)
    return eqx.combine(_identity_into_sink(diff, eqx.filter(sink, eqx.is_inexact_array)), rest)


@jax.custom_vjp
def _identity_into_sink(diff: Any, sink: Any) -> Any:
    return diff


def _identity_into_sink_fwd(diff: Any, sink: Any) -> tuple[Any, Any]:
    return diff, sink


def _identity_into_sink_bwd(sink: Any, cotangent: Any) -> tuple[None, Any]:
    return None, jax.tree.map(lambda s, c: s + c.astype(s.dtype), sink, cotangent)


_identity_into_sink.defvjp(_identity_into_sink_fwd, _identity_into_sink_bwd)


def _run_layer(layer: Callable[..., jax.Array | LayerOutput], h: jax.Array, *extra: Any) -> LayerOutput:
    """One layer's output as a `LayerOutput` (a layer without statistics may return `h` alone)."""
    out = layer(h, *extra)
    return out if isinstance(out, LayerOutput) else LayerOutput(out)


def _hidden_and_stats(
    layer: Callable[..., jax.Array | LayerOutput], h: jax.Array, *extra: Any
) -> tuple[jax.Array, Any]:
    out = _run_layer(layer, h, *extra)
    return out.hidden, out.stats


def stack_trees(trees: list[Any]) -> Any:
    """Stack same-structured pytrees leaf by leaf along a new leading axis (what `scan` returns)."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)
