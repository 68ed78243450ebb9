"""The lagged non-finite check (`train.on_nonfinite=stop`): each step's non-finite flag is read
one step late, so that reading it never waits for the step just issued and one step is always
in flight; it is read at once before anything leaves the device (a log, an evaluation, a save,
a stop) and when the loop ends."""

import dataclasses

import jax

from ferry.config.root import FerryConfig
from ferry.errors import FerryError


class NonFiniteLossError(FerryError, RuntimeError):
    """Training stopped at a step whose loss or gradient was not finite."""


@dataclasses.dataclass
class NonFiniteWatch:
    """The first step found with a non-finite loss or gradient (`bad_step`), from the steps'
    `nonfinite` metrics; `enabled` False (on_nonfinite=skip) reads nothing."""

    enabled: bool
    bad_step: int | None = None
    _unread: tuple[int, jax.Array] | None = None  # a step whose flag is not read yet

    def issued(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """Step `step` was issued: read the step before it, and keep this one for later."""
        if self.enabled:
            self._read()
            self._unread = (step, metrics["nonfinite"])

    def settle(self) -> None:
        """Read the step not yet read, if any (blocks on it)."""
        if self.enabled and self.bad_step is None:
            self._read()

    def _read(self) -> None:
        pending, self._unread = self._unread, None
        if pending is not None and bool(pending[1]):
            self.bad_step = pending[0]


def likely_causes(config: FerryConfig) -> list[str]:
    """The settings of this run that make a non-finite loss likely, most likely first, each with
    its fix; the learning rate is named only when it is high (or when nothing else is)."""
    tc = config.train
    causes = []
    if tc.warmup_steps == 0:
        causes.append("no warmup (train.warmup_steps=0): Adam's first steps are full size; warm up over a few steps")
    if tc.learning_rate > HIGH_LEARNING_RATE:
        causes.append(
            f"train.learning_rate={tc.learning_rate:g} is high for Adam (at most {HIGH_LEARNING_RATE:g} is usual; "
            "lower it for a large model or a fine-tune)"
        )
    if tc.grad_clip_norm > LOOSE_CLIP:
        causes.append(f"train.grad_clip_norm={tc.grad_clip_norm:g} hardly clips; 1.0 is usual")
    if tc.adam_eps < TINY_ADAM_EPS:
        causes.append(f"train.adam_eps={tc.adam_eps:g} lets updates grow where gradients are near 0; 1e-8 is usual")
    if tc.adam_b2 < LOW_ADAM_B2:
        causes.append(f"train.adam_b2={tc.adam_b2:g} forgets gradients fast, so one large gradient is a large step")
    norm_eps = getattr(config.model, "norm_eps", None)
    if norm_eps is not None and norm_eps < TINY_NORM_EPS:
        causes.append(f"model.norm_eps={norm_eps:g} lets a norm divide by nearly 0; 1e-6 or 1e-5 is usual")
    if tc.z_loss_weight > HIGH_Z_LOSS:
        causes.append(f"train.z_loss_weight={tc.z_loss_weight:g} outweighs the loss it regularises; 1e-4 is usual")
    if tc.compute_dtype == "bfloat16" and tc.z_loss_weight == 0:
        causes.append(
            "bfloat16 compute without z-loss: logits can grow until the softmax overflows; set "
            "train.z_loss_weight=1e-4 or train.compute_dtype=float32"
        )
    if config.init.from_hf is not None and tc.learning_rate > FINE_TUNE_LEARNING_RATE:
        causes.append(
            f"a fine-tune of init.from_hf at train.learning_rate={tc.learning_rate:g}; "
            f"{FINE_TUNE_LEARNING_RATE:g} or less is usual"
        )
    if not causes:
        causes.append(
            f"none of the usual settings (learning rate {tc.learning_rate:g}, warmup {tc.warmup_steps}, clipping "
            f"{tc.grad_clip_norm:g}) looks wrong: try a lower train.learning_rate, or look at the data of that step"
        )
    return causes


# what `likely_causes` counts as out of the usual range
HIGH_LEARNING_RATE = 3e-3
FINE_TUNE_LEARNING_RATE = 1e-4
LOOSE_CLIP = 10.0
TINY_ADAM_EPS = 1e-12
LOW_ADAM_B2 = 0.9
TINY_NORM_EPS = 1e-8
HIGH_Z_LOSS = 1e-2


def nonfinite_error(bad_step: int, checkpoint_directory: object, causes: list[str] | None = None) -> NonFiniteLossError:
    """What stops the run at `bad_step`, saying where the last good state is, what in the run's
    config likely caused it (`likely_causes`) and how to go on."""
    where = f"the state of step {bad_step - 1} is checkpointed in {checkpoint_directory}"
    causes = causes or ["a learning rate too high for the model: lower train.learning_rate"]
    listed = "; ".join(f"({number}) {cause}" for number, cause in enumerate(causes, start=1))
    return NonFiniteLossError(
        f"the loss or gradient is not finite at step {bad_step}; training stopped and {where} "
        f"(nothing of step {bad_step} was applied). Likely causes here: {listed}. Or set "
        "train.on_nonfinite=skip to skip such steps"
    )
