"""Gradient accumulation in one buffer: each micro batch's gradient of a layer stack is added
into the sum of the earlier ones inside the stack's backward loop, a layer at a time, so the
stack's gradient is held once (the accumulator) instead of twice (the accumulator and a micro
batch's whole gradient). For a 1.7B model that is 5.6 GB of HBM.

The accumulator is handed to each `LayerStack` as its gradient sink (`LayerStack.sinking`): the
stack's own parameters are then not differentiated, and the sink's cotangent is the new sum.
The sums are the same float32 additions, in the same order, as adding whole gradients.
"""

from typing import Any

import equinox as eqx
import jax

from ferry.nn.stack import LayerStack


def _is_stack(node: Any) -> bool:
    return isinstance(node, LayerStack)


def layer_stacks(tree: Any) -> list[LayerStack]:
    """The `LayerStack`s in a model (or in a gradient shaped like one), in tree order."""
    return [node for node in jax.tree.leaves(tree, is_leaf=_is_stack) if _is_stack(node)]


def stack_gradients(grads: Any) -> list[Any]:
    """Each stack's part of a model-shaped gradient: the sinks for the next micro batch."""
    return [stack.layers for stack in layer_stacks(grads)]


def with_stack_gradients(grads: Any, parts: list[Any]) -> Any:
    """`grads` with each stack's part replaced (None: removed)."""
    if not parts:
        return grads
    return eqx.tree_at(stack_gradients, grads, parts, is_leaf=lambda x: x is None)


def sinking(model: Any, sinks: list[Any]) -> Any:
    """`model` with each stack's gradient added into its sink (`LayerStack.sinking`)."""
    stacks = layer_stacks(model)
    if not stacks:
        return model
    return eqx.tree_at(layer_stacks, model, [s.sinking(k) for s, k in zip(stacks, sinks, strict=True)])
