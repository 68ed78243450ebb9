"""The train state and the one jitted train step (forward, loss, gradients, AdamW update)."""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from ferry.offload import SAVE_ALL, Policy
from ferry.precision import cast_floating


class TrainState(eqx.Module):
    """Float32 master parameters, their optimizer state and the step counter."""

    model: eqx.Module
    opt_state: optax.OptState
    step: Int[Array, ""]


def init_state(model: eqx.Module, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(model, optimizer.init(eqx.filter(model, eqx.is_inexact_array)), jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Everything about the loss that is fixed for a run (static under jit)."""

    policy: Policy = SAVE_ALL
    compute_dtype: str = "float32"
    z_loss_weight: float = 0.0
    mesh: Mesh | None = None


def batch_loss(
    model: eqx.Module, batch: Int[Array, "batch seq_plus_one"], settings: LossSettings
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The loss to differentiate, and the model's statistics (`loss` is the main next-token
    cross-entropy), computed in the compute dtype."""
    compute_model = cast_floating(model, jnp.dtype(settings.compute_dtype))
    return compute_model.training_loss(batch, settings.policy, settings.mesh, settings.z_loss_weight)


def make_train_step(
    optimizer: optax.GradientTransformation,
    settings: LossSettings,
    learning_rate: optax.Schedule,
) -> Callable[[TrainState, Int[Array, "batch seq_plus_one"]], tuple[TrainState, dict[str, Array]]]:
    """The one jitted step. Its arguments are donated: parameters and optimizer moments are
    updated in place, and the batch buffer is consumed (place a fresh batch every step)."""

    @eqx.filter_jit(donate="all")
    def train_step(state: TrainState, batch: Int[Array, "batch seq_plus_one"]) -> tuple[TrainState, dict[str, Array]]:
        (loss, stats), grads = eqx.filter_value_and_grad(batch_loss, has_aux=True)(state.model, batch, settings)
        params = eqx.filter(state.model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.apply_updates(state.model, updates).after_step(stats)  # e.g. router biases
        metrics = {name: value for name, value in stats.items() if value.ndim == 0}
        metrics |= {
            "total_loss": loss,
            "grad_norm": optax.global_norm(grads),
            "learning_rate": learning_rate(state.step),
        }
        return TrainState(model, opt_state, state.step + 1), metrics

    return train_step


def make_eval_step(settings: LossSettings) -> Callable[[eqx.Module, Int[Array, "batch seq_plus_one"]], Array]:
    @eqx.filter_jit
    def eval_step(model: eqx.Module, batch: Int[Array, "batch seq_plus_one"]) -> Array:
        return batch_loss(model, batch, dataclasses.replace(settings, policy=Policy.save_all()))[1]["loss"]

    return eval_step
