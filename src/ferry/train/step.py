"""The train step before jit (forward, loss, gradients, AdamW update), which
`ferry.train.compiled_step` compiles, and the eval step."""

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from ferry.data.loss_weights import counted, split_rows
from ferry.data.segments import DocumentMask, loss_weights
from ferry.head.loss import DEFAULT_HEAD, LossHead
from ferry.models.base import AbstractLanguageModel
from ferry.offload.engine import SAVE_ALL, Policy
from ferry.precision import cast_floating
from ferry.train.gradient_sink import sinking, stack_gradients, with_stack_gradients
from ferry.train.state_memory import float_params, on_host
from ferry.train.streamed_update import StreamedUpdate
from ferry.train.train_state import TrainState


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Everything about the loss that is fixed for a run (static under jit)."""

    policy: Policy = SAVE_ALL
    compute_dtype: str = "float32"
    z_loss_weight: float = 0.0
    documents: DocumentMask | None = None  # data.document_mask: attention stays inside each document
    head: LossHead = DEFAULT_HEAD  # train.loss_head: the logits made a vocabulary chunk at a time, or whole
    weighted: bool = False  # data.format=chat: batch rows carry their tokens' loss weights (ferry.data.loss_weights)

    @classmethod
    def of(
        cls, train: Any, policy: Policy, documents: DocumentMask | None = None, weighted: bool = False
    ) -> "LossSettings":
        """The settings a `TrainConfig` gives (with the run's offload policy, document mask, and
        whether its batches carry loss weights)."""
        return cls(policy, train.compute_dtype, train.z_loss_weight, documents, train.head, weighted)


def compute_copy(model: AbstractLanguageModel, dtype: Any, head: LossHead) -> AbstractLanguageModel:
    """The model in the compute dtype, but for the chunked or fused head's own weight: kept as
    stored (float32), which the chunked head casts a chunk at a time, so no compute-dtype copy of
    the whole head is held (`ferry.head.chunked`), and the fused head sums its gradient over
    chunks in float32 (`ferry.head.fused`). A head tied to the embedding table is cast with the rest: the
    embedding's gather reads it too."""
    compute_model = cast_floating(model, dtype)
    if head.kind == "logits" or model.output_head().tied:
        return compute_model
    return eqx.tree_at(lambda m: m.output_head().weight, compute_model, model.output_head().weight)


def batch_loss(
    model: AbstractLanguageModel,
    batch: Int[Array, "batch seq_plus_one"],
    settings: LossSettings,
    sinks: list[Any] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The loss to differentiate, and the model's statistics (`loss` is the main next-token
    cross-entropy), computed in the compute dtype. With `sinks` the layer stacks' gradients are
    added into them (`ferry.train.gradient_sink`). A weighted batch (`settings.weighted`) is its
    tokens and their loss weights: the means are over the targets that count."""
    compute_model = compute_copy(model, jnp.dtype(settings.compute_dtype), settings.head)
    if sinks is not None:
        compute_model = sinking(compute_model, sinks)
    if not settings.weighted:  # a text batch: the loss as it was before batches carried weights
        return compute_model.training_loss(
            batch, settings.policy, settings.z_loss_weight, documents=settings.documents, head=settings.head
        )
    tokens, target_weights = split_rows(batch)
    return compute_model.training_loss(
        tokens,
        settings.policy,
        settings.z_loss_weight,
        documents=settings.documents,
        head=settings.head,
        target_weights=target_weights,
    )


def accumulated_loss_and_grad(
    model: eqx.Module, batch: Int[Array, "batch seq_plus_one"], settings: LossSettings, micro_steps: int
) -> tuple[tuple[Float[Array, ""], dict[str, Array]], Any]:
    """Loss, statistics and gradients of the whole batch, computed `micro_steps` rows-slices at a
    time with `lax.scan` (gradient accumulation). Where every target counts they are means over the
    micro batches, which equal the whole batch's because the slices are equal; where some do not
    (loss weights, `loss_across_documents=False`), each micro batch weighs by its share of the
    counted targets, so the loss is the mean over the whole batch's counted targets. The layer
    stacks' gradients are added into the running sum inside their backward loops
    (`ferry.train.gradient_sink`)."""
    value_and_grad = _float32_gradients(eqx.filter_value_and_grad(batch_loss, has_aux=True))
    if micro_steps == 1:
        return value_and_grad(model, batch, settings)
    micro_batches = batch.reshape(micro_steps, batch.shape[0] // micro_steps, batch.shape[1])
    out_shapes = eqx.filter_eval_shape(value_and_grad, model, micro_batches[0], settings)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)
    sinking_value_and_grad = _float32_gradients(eqx.filter_value_and_grad(_sinking_loss, has_aux=True))
    shares = _counted_shares(micro_batches, settings)

    def accumulate(total: Any, xs: tuple[jax.Array, Any]) -> tuple[Any, None]:
        (values, grads), (micro_batch, share) = total, xs
        sinks = stack_gradients(grads)
        out_values, (out_grads, sums) = sinking_value_and_grad((model, sinks), micro_batch, settings, share)
        no_stacks = [None] * len(sinks)  # the stacks' own gradients are zero: their sums are `sums`
        others = jax.tree.map(
            jnp.add, with_stack_gradients(grads, no_stacks), with_stack_gradients(out_grads, no_stacks)
        )
        return (jax.tree.map(jnp.add, values, out_values), with_stack_gradients(others, sums)), None

    total, _ = jax.lax.scan(accumulate, zeros, (micro_batches, shares))
    return total if shares is not None else jax.tree.map(lambda x: x / micro_steps, total)


def _counted_shares(
    micro_batches: Int[Array, "micro batch row"], settings: LossSettings
) -> Float[Array, " micro"] | None:
    """Each micro batch's share of the whole batch's counted targets, or None where every target
    counts (the shares are then equal: the sum's mean is taken at the end, as before)."""
    if not settings.weighted and loss_weights(micro_batches[0, :, :-1], settings.documents) is None:
        return None
    counts = jax.vmap(lambda b: _counted_targets(b, settings))(micro_batches).astype(jnp.float32)
    return counts / jnp.maximum(counts.sum(), 1.0)


def _counted_targets(batch: Int[Array, "batch row"], settings: LossSettings) -> Int[Array, ""]:
    """How many of a batch's targets its loss counts (as `training_loss` weighs them)."""
    tokens, targets = split_rows(batch) if settings.weighted else (batch, None)
    weights = counted(loss_weights(tokens[:, :-1], settings.documents), targets)
    return jnp.asarray(tokens[:, 1:].size) if weights is None else weights.sum()


def _sinking_loss(
    model_and_sinks: tuple[AbstractLanguageModel, list[Any]],
    batch: Int[Array, "batch seq_plus_one"],
    settings: LossSettings,
    share: Float[Array, ""] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """`batch_loss` differentiated by the model and the stacks' sinks together; its loss and
    statistics scaled by the micro batch's `share` of the counted targets, if given."""
    model, sinks = model_and_sinks
    out = batch_loss(model, batch, settings, sinks)
    return out if share is None else jax.tree.map(lambda x: x * share, out)


def _float32_gradients(value_and_grad: Callable[..., Any]) -> Callable[..., Any]:
    """Gradients in float32 (accumulated in it) also for weights the model reads as their
    compute-dtype copies (master weights on host); a no-op for float32 leaves."""

    def call(*args: Any) -> Any:
        value, grads = value_and_grad(*args)
        return value, jax.tree.map(lambda g: g.astype(jnp.float32) if eqx.is_inexact_array(g) else g, grads)

    return call


def _after_step(model: eqx.Module, stats: dict[str, Array]) -> eqx.Module:
    """The model's update outside the gradient (router biases), which must leave host-resident
    weights alone: computing on them would need the GPU to compute in host memory."""
    after = cast(AbstractLanguageModel, model).after_step(stats)
    before_leaves, after_leaves = jax.tree.leaves(float_params(model)), jax.tree.leaves(float_params(after))
    pairs = enumerate(zip(before_leaves, after_leaves, strict=True))
    changed = [i for i, (a, b) in pairs if a is not b and on_host(a)]
    if changed:
        raise TypeError(
            f"{type(model).__name__}.after_step changes parameter leaves {changed}, which live on host with "
            "offload.params=host; only vectors (which stay in HBM) may be updated outside the gradient"
        )
    return after


def train_step_body(
    optimizer: optax.GradientTransformation,
    settings: LossSettings,
    learning_rate: optax.Schedule,
    micro_steps: int = 1,
    state_sharding: Any = None,
    on_nonfinite: str = "stop",
    stream: StreamedUpdate | None = None,
) -> Callable[[TrainState, Int[Array, "batch seq_plus_one"]], tuple[TrainState, dict[str, Array]]]:
    """The train step before jit: what `ferry.train.compiled_step` compiles, for runs, plans,
    benchmarks and tests alike (from the state's layout, its inputs donated).

    A step whose loss or gradient norm is not finite applies no update (the new state is the old
    one, selected on device: no host sync). With `on_nonfinite="stop"` every later step applies
    none either and the step counter stays, so the state stays the last good one until the loop,
    which reads `nonfinite` a step later, checkpoints it; with "skip" training goes on.

    With `stream` (part of the state on host, `ferry.train.state_memory`) the forward pass reads
    the compute copies of the host-resident weights, and the update streams the state through HBM
    a layer at a time, selecting each leaf there."""

    def train_step(state: TrainState, batch: Int[Array, "batch seq_plus_one"]) -> tuple[TrainState, dict[str, Array]]:
        (loss, stats), grads = accumulated_loss_and_grad(state.forward_model, batch, settings, micro_steps)
        metrics = {name: value for name, value in stats.items() if value.ndim == 0}
        metrics |= {
            "total_loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": learning_rate(state.step),
        }
        finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
        apply = finite if on_nonfinite == "skip" else finite & (state.nonfinite_steps == 0)
        model, opt_state, compute = _updated(optimizer, stream, state, grads, apply)
        model = _after_step(model, stats)  # e.g. router biases
        metrics["nonfinite"] = ~finite
        nonfinite_steps = state.nonfinite_steps + (~finite).astype(jnp.int32)
        metrics["nonfinite_steps"] = nonfinite_steps
        step = state.step + (1 if on_nonfinite == "skip" else apply.astype(jnp.int32))
        model, opt_state = _selected(apply, (model, opt_state), (state.model, state.opt_state))
        new_state = TrainState(model, opt_state, step, nonfinite_steps, compute)
        return _constrained(new_state, state_sharding), metrics

    return train_step


def _updated(
    optimizer: optax.GradientTransformation,
    stream: StreamedUpdate | None,
    state: TrainState,
    grads: Any,
    apply: Array,
) -> tuple[eqx.Module, optax.OptState, Any]:
    """The model, optimizer state and compute copies after the optimizer's update: optax's on
    the whole tree, or streamed layer by layer when part of the state lives on host."""
    params = float_params(state.model)
    if stream is None:
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        return eqx.apply_updates(state.model, updates), opt_state, None
    clip_state, adam_state = state.opt_state  # make_optimizer's chain: clipping, then AdamW
    new_params, adam_state, compute = stream(params, adam_state, grads, apply)
    return eqx.combine(new_params, state.model), (clip_state, adam_state), compute


def _selected(apply: Array, new: Any, old: Any) -> Any:
    """`new` where the step applies, else `old`, leaf by leaf in HBM (the stream selected the
    host-resident leaves in HBM already)."""
    updated = jax.tree.map(
        lambda n, o: n if on_host(n) else jnp.where(apply, n, o),
        eqx.filter(new, eqx.is_array),
        eqx.filter(old, eqx.is_array),
    )
    return eqx.combine(updated, eqx.filter(new, eqx.is_array, inverse=True))


def _constrained(state: TrainState, state_sharding: Any) -> TrainState:
    """The new state pinned to the old one's layout (host-resident leaves are placed already)."""
    if state_sharding is None:
        return state
    arrays, static = eqx.partition(state, eqx.is_array)
    pin = lambda x, sh: x if on_host(x) else jax.lax.with_sharding_constraint(x, sh)
    return eqx.combine(jax.tree.map(pin, arrays, state_sharding), static)


def make_eval_step(settings: LossSettings) -> Callable[[eqx.Module, Int[Array, "batch seq_plus_one"]], Array]:
    @eqx.filter_jit
    def eval_step(model: eqx.Module, batch: Int[Array, "batch seq_plus_one"]) -> Array:
        eval_settings = dataclasses.replace(settings, policy=SAVE_ALL)
        return batch_loss(cast(AbstractLanguageModel, model), batch, eval_settings)[1]["loss"]

    return eval_step
