"""Next-token cross-entropy with an optional z-loss, in float32: from whole logits
(`next_token_loss`), or from the output head's input and weight (`LossHead`), which by default
never makes the batch's logits whole (`ferry.head.chunked`)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from ferry.errors import ConfigError
from ferry.head.chunked import OutputHead, chunks_under_mesh, logsumexp_and_target_logit
from ferry.head.fused import chunks_under_mesh as sequence_chunks_under_mesh
from ferry.head.fused import fused_loss, kernel_for

AUTO = "auto"  # train.loss_head=auto: chosen per step from the candidates' compiled programs (`ferry.head.auto`)
LOSS_HEADS = (AUTO, "chunked", "fused", "logits")
WEIGHT_GRADS = ("late", "early")
LOSS_KERNELS = ("auto", "xla", "pallas")
MIB = 1 << 20


def next_token_loss(
    logits: Float[Array, "batch seq vocab"],
    targets: Int[Array, "batch seq"],
    z_loss_weight: float = 0.0,
    weights: Bool[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean cross-entropy, and the same plus `z_loss_weight * mean(logsumexp^2)` (PaLM's z-loss,
    which keeps the softmax normaliser near 1). `weights`: which predictions count (the means are
    over those; None: all)."""
    logits = logits.astype(jnp.float32)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mean = jnp.mean if weights is None else lambda x: _weighted_mean(x, weights)
    cross_entropy = mean(per_token)
    if z_loss_weight == 0.0:
        return cross_entropy, cross_entropy
    z = jax.nn.logsumexp(logits, axis=-1)
    return cross_entropy + z_loss_weight * mean(z * z), cross_entropy


def _weighted_mean(values: Float[Array, "batch seq"], weights: Bool[Array, "batch seq"]) -> Float[Array, ""]:
    counted = weights.astype(jnp.float32)
    return jnp.sum(values * counted) / jnp.maximum(jnp.sum(counted), 1.0)


@dataclasses.dataclass(frozen=True)
class LossHead:
    """How the loss reads the output head (`train.loss_head`, `train.loss_chunk_mib`,
    `train.loss_weight_grad`).

    `chunked` (the default) never holds the batch's logits: they are made a vocabulary chunk at a
    time, forward and backward, each chunk's float32 logits within `chunk_mib` MiB per device
    (`ferry.head.chunked`); `weight_grad` says whether the head's weight gradient gets a backward
    walk of its own (`late`: scheduled after the layers' backward, one more logits-sized matmul)
    or shares the hidden state's (`early`). `fused` makes the loss and both gradients in one walk
    of the forward pass, a chunk of the sequence at a time within `chunk_mib` (`ferry.head.fused`):
    the whole logits' three matmuls, none of their memory. `logits` makes them whole, as the model's `__call__`
    returns them, and takes today's cross-entropy of them (`next_token_loss`): the reference, and
    what the chunked head must equal. `kernel` says who makes the fused head's chunks: XLA, or the
    Pallas kernel that keeps their logits in VMEM (`train.loss_kernel`, `ferry.head.kernel_choice`).
    `auto` is one of these chosen for the step it runs in (`ferry.head.auto`, by `StepRecipe`); a
    loss taken outside a train step (evaluation) computes it as `chunked`, which never holds the
    logits and gives the same loss."""

    kind: str = "chunked"
    chunk_mib: float = 256.0
    weight_grad: str = "late"
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in LOSS_HEADS:
            raise ConfigError(f"train.loss_head is {self.kind!r}; use one of {', '.join(LOSS_HEADS)}")
        if not 0 < self.chunk_mib < math.inf:  # inf: int(inf) would fail deep in the step's trace
            raise ConfigError(
                f"train.loss_chunk_mib={self.chunk_mib} must be a positive number (MiB of logits per chunk)"
            )
        if self.weight_grad not in WEIGHT_GRADS:
            raise ConfigError(f"train.loss_weight_grad is {self.weight_grad!r}; use one of {', '.join(WEIGHT_GRADS)}")
        if self.kernel not in LOSS_KERNELS:
            raise ConfigError(f"train.loss_kernel is {self.kernel!r}; use one of {', '.join(LOSS_KERNELS)}")
        if self.kernel == "pallas" and self.kind not in ("fused", AUTO):
            raise ConfigError(
                f"train.loss_kernel=pallas makes the fused head's chunks, and train.loss_head is {self.kind}; "
                "set train.loss_head=fused"
            )

    @property
    def budget_bytes(self) -> int:
        return max(1, int(self.chunk_mib * MIB))

    def __call__(
        self,
        hidden: Float[Array, "batch seq dim"],
        head: OutputHead,
        targets: Int[Array, "batch seq"],
        z_loss_weight: float = 0.0,
        weights: Bool[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, ""], Float[Array, ""]]:
        """`next_token_loss` of the logits `hidden @ head` (the loss with z-loss, and the
        cross-entropy), with the logits made as `kind` says."""
        if self.kind == "logits":
            return next_token_loss(whole_logits(hidden, head), targets, z_loss_weight, weights)
        if self.kind == AUTO:  # outside a step (evaluation): the head that never holds the logits
            return dataclasses.replace(self, kind="chunked", kernel="auto")(
                hidden, head, targets, z_loss_weight, weights
            )
        if self.kind == "fused":
            return fused_loss(hidden, head, targets, self.budget_bytes, z_loss_weight, weights, self.kernel)
        logsumexp, target_logit = logsumexp_and_target_logit(hidden, head, targets, self.budget_bytes, self.weight_grad)
        mean = jnp.mean if weights is None else lambda x: _weighted_mean(x, weights)
        cross_entropy = mean(logsumexp - target_logit)
        if z_loss_weight == 0.0:
            return cross_entropy, cross_entropy
        return cross_entropy + z_loss_weight * mean(logsumexp * logsumexp), cross_entropy

    def kernel_line(self, batch: int, seq: int, vocab: int, dim: int, itemsize: int, mesh=None) -> str:
        """Who makes the fused head's chunks, and why (refusing a kernel that cannot run under `mesh`)."""
        choice = kernel_for(self.kernel, batch, seq, vocab, dim, itemsize, self.budget_bytes, mesh)
        who = "XLA"
        if choice.tiles is not None:  # the kernel's choice names its blocks
            who = f"the Pallas kernel, its logits only in VMEM, in blocks of {choice.tiles.rows:,} tokens"
        return f"each chunk by {who} [train.loss_kernel={self.kernel}: {choice.why}]"

    def describe(
        self, batch: int, seq: int, vocab: int, dim: int, itemsize: int = 2, mesh=None, why: str | None = None
    ) -> str:
        """The start-up line: which head, and for the chunked and fused ones their chunks for a
        micro batch of `batch` x `seq` tokens of width `dim` (the compute dtype `itemsize` bytes)
        over `mesh`. `why`: the head was chosen by `train.loss_head=auto`, for this reason
        (`ferry.head.auto.HeadChoice.why`); the chunk's MiB are then auto's too."""
        setting = f"train.loss_head={self.kind}" if why is None else f"train.loss_head={why}"
        chunk = f"train.loss_chunk_mib={self.chunk_mib:g} MiB" if why is None else f"{self.chunk_mib:g} MiB"
        if self.kind == "logits":
            return (
                f"loss head: logits ({setting}): the whole {batch} x {seq} x {vocab:,} logits "
                "in float32, and their gradient"
            )
        if self.kind == "fused":
            positions = sequence_chunks_under_mesh(batch, seq, vocab, self.budget_bytes, mesh)
            count = positions.count
            return (
                f"loss head: fused ({setting}): the loss and both gradients in one walk of the forward "
                f"pass, {count} chunk{'s' if count > 1 else ''} of {positions.size:,} of the {seq:,} "
                f"positions, within {chunk} of float32 logits per chunk; "
                + self.kernel_line(batch, seq, vocab, dim, itemsize, mesh)
            )
        if self.kind == AUTO:
            return "loss head: auto (train.loss_head=auto): chosen per step from the compiled heads (ferry.head.auto)"
        chunks = chunks_under_mesh(batch, seq, vocab, self.budget_bytes, mesh)
        return (
            f"loss head: chunked ({setting}): the logits are never whole; {chunks.count} "
            f"chunk{'s' if chunks.count > 1 else ''} of {chunks.size:,} of each device's {chunks.columns:,} "
            f"vocabulary columns, within {chunk} of float32 logits per chunk; "
            f"the head's weight gradient {WEIGHT_GRAD_LINES[self.weight_grad]} "
            f"(train.loss_weight_grad={self.weight_grad})"
        )


WEIGHT_GRAD_LINES = {
    "late": "in a walk of its own, after the layers' backward",
    "early": "in the hidden state's walk",
}
# a loss's head where none is given (a model's `training_loss`, evaluation): chunked, 256 MiB of logits
# per chunk, late; a run's default is train.loss_head=auto, which its StepRecipe resolves
DEFAULT_HEAD = LossHead()


def whole_logits(hidden: Float[Array, "batch seq dim"], head: OutputHead) -> Float[Array, "batch seq vocab"]:
    """The logits of every token at once, in the compute dtype (as a model's `__call__` makes them)."""
    if head.vocab_axis == 1:
        return hidden @ head.weight.astype(hidden.dtype)
    return jnp.einsum("bsd,vd->bsv", hidden, head.weight.astype(hidden.dtype))
