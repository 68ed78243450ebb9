"""The train state: what a step reads and returns, and what a checkpoint holds."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int

from ferry.config.train import DEVICE_STATE, HOST, StatePlacement
from ferry.train.state_memory import float_params, state_map


class TrainState(eqx.Module):
    """Float32 master parameters, their optimizer state, the step counter and how many steps had
    a non-finite loss or gradient (their updates were not applied)."""

    model: eqx.Module
    opt_state: optax.OptState
    step: Int[Array, ""]
    nonfinite_steps: Int[Array, ""]
    compute: Any = None  # compute-dtype copies of the master weights that live on host (else None)

    @property
    def forward_model(self) -> eqx.Module:
        """The model the forward pass reads: the master weights, or for those on host their
        compute-dtype copies in HBM."""
        return self.model if self.compute is None else eqx.combine(self.compute, self.model)


def init_state(
    model: eqx.Module,
    optimizer: optax.GradientTransformation,
    placement: StatePlacement = DEVICE_STATE,
    compute_dtype: str = "bfloat16",
) -> TrainState:
    """A fresh state; with the master weights on host (`placement.params`) also their
    compute-dtype copies, which the forward pass reads."""
    opt_state = optimizer.init(float_params(model))
    compute = None
    if placement.params == HOST:
        host = state_map(model, placement).host_params
        leaves, treedef = jax.tree.flatten(float_params(model))
        copies = [x.astype(compute_dtype) if h else None for x, h in zip(leaves, host, strict=True)]
        compute = jax.tree.unflatten(treedef, copies)
    return TrainState(model, opt_state, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), compute)
