"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

import jax
import optax

from ferry.train.config import TrainConfig


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


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        optax.adamw(
            learning_rate_schedule(config),
            b1=config.adam_b1,
            b2=config.adam_b2,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            mask=_decay_mask,
        ),
    )
