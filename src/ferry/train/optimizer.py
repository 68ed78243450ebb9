"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from ferry.config.train import StatePlacement, TrainConfig
from ferry.train.state_memory import float_params, state_map
from ferry.train.streamed_update import StreamedUpdate


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.steps,
        end_value=config.learning_rate * config.min_learning_rate_ratio,
    )


def _decay_mask(params: optax.Params) -> optax.Params:
    """Weight decay on matrices only: norm scales are not decayed."""
    return jax.tree.map(lambda p: p.ndim >= 2 and p.shape[-1] > 1 and p.shape[-2] > 1, params)


def gradient_clip(config: TrainConfig) -> optax.GradientTransformation:
    return optax.clip_by_global_norm(config.grad_clip_norm)


def adamw(config: TrainConfig, mask: Any = _decay_mask) -> optax.GradientTransformation:
    """AdamW alone; `mask` (which leaves are decayed) a function of the parameters or a tree. Its
    moments are stored in `train.adam_moments_dtype`."""
    adam = optax.adamw(
        learning_rate_schedule(config),
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        mask=mask,
    )
    if config.adam_moments_dtype == "float32":
        return adam
    return stored_in(jnp.dtype(config.adam_moments_dtype), adam)


def stored_in(dtype: Any, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` whose floating-point state (AdamW's moments) is kept in `dtype` between updates:
    each update computes in float32 from the stored values and rounds the new ones to `dtype`.
    optax's own `mu_dtype` covers the first moment only."""

    def store(state: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

    def widen(state: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

    def init(params: optax.Params) -> optax.OptState:
        return store(inner.init(params))

    def update(updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None) -> Any:
        new_updates, new_state = inner.update(updates, widen(state), params)
        return new_updates, store(new_state)

    return optax.GradientTransformation(init, update)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW: the state is the pair of their states."""
    return optax.chain(gradient_clip(config), adamw(config))


def streamed_update(
    config: TrainConfig, model: Any, placement: StatePlacement, param_sharding: Any
) -> StreamedUpdate | None:
    """The update that streams a partly host-resident state through HBM (None when it all lives
    on the device). The decay mask is fixed from the whole parameters, as `make_optimizer`'s."""
    if not placement.streams:
        return None
    params = float_params(model)
    smap = state_map(model, placement)
    decayed = adamw(config, mask=_decay_mask(params))
    dtype = jnp.dtype(config.compute_dtype)
    return StreamedUpdate(
        config.grad_clip_norm, decayed, smap, dtype, param_sharding, placement.step_bytes, prefetch=placement.prefetch
    )
