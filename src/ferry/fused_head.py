"""The loss and both of the output head's gradients made in one walk of the forward pass, a chunk
of the sequence at a time (`train.loss_head=fused`): three logits-sized matmuls a step, as the
whole logits take, where the vocabulary-chunked head (`ferry.chunked_head`) takes four or five,
and the batch's logits are never whole.

Why the forward pass can make the gradients: the loss is a weighted mean over tokens of
`logsumexp - target logit`, plus the z-loss `z * logsumexp^2`; its gradient by a token's logits,
`s * (1 + 2 z logsumexp) * softmax - s * onehot(target)` (s: the token's share of the mean), reads
only that token's row of logits. A chunk of tokens that holds whole rows (every vocabulary column
of its tokens) therefore gives its exact share of both gradients: the hidden state's rows are
written, the weight's gradient is summed over the chunks in float32. The custom VJP keeps the two
and scales them by the loss's cotangent in the backward pass. A chunk of columns, as the chunked
head walks, cannot: a token's softmax needs its log-sum-exp over all the columns first.

What it holds: the weight's gradient (the weight's size, summed in float32) from the head's
forward pass on, where autodiff of the whole logits makes it too (the backward pass starts at the
loss), and a compute-dtype copy of the weight while it walks (every chunk reads all of it). The
cross-entropy returned beside the loss is a figure to report: its gradient is not made
(`stop_gradient`); a train step differentiates the loss.

Measured on one TPU v5e at batch 8 x 2,048 tokens, dim 2,048, vocabulary 32,768
(`benchmarks/loss_head_tpu.py`, 2026-12-07), loss and gradients: 47.5 ms in 256 MiB chunks, the
whole logits 40.7 ms, the vocabulary-chunked head 57.8 to 71.3 ms, the three matmuls alone 36.1
ms; in one chunk of 2,048 MiB (the whole sequence) 40.6 against the whole logits' 41.0 ms, in a
third of their temporaries (each chunk more reads and writes the weight gradient's float32 sum);
a train step of full_remat ran 1.077x faster with it than with the chunked head. Not the
default: on an H200 plan of 2 layers of Llama 3.1 8B at 1 x 8,192 it needs 5.48 GiB of
temporaries against the chunked head's 3.59 (the weight's gradient held through the layers'
backward, 2 GiB at a vocabulary of 128,256).

The chunk rule (`sequence_chunks`): a chunk's float32 logits on one device, its batch rows x its
positions x its vocabulary columns x 4 bytes, stay within `budget_bytes` (`train.loss_chunk_mib`).
The sequence is split in as few chunks as fit, evenly, each a multiple of 8 positions (TPU
sublanes) when at least 8 fit; the last chunk starts early and counts only the positions its
predecessor left (no row is padded or copied).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ferry.chunked_head import LOGIT_BYTES, OutputHead, chunk_owned, chunk_start, even_chunks, logits_share, pinned
from ferry.sharding import PARAM_RULES, LogicalAxes, constrain, logical_spec

SUBLANES = 8  # a chunk's positions are a multiple of this when at least this many fit the budget


@dataclasses.dataclass(frozen=True)
class SequenceChunks:
    """How a device's tokens are walked: chunks of `size` of the sequence's `length` positions
    (all of the device's batch rows), `count` chunks in all."""

    length: int
    size: int
    count: int

    def start(self, index: Array) -> Array:
        """Chunk `index`'s first position (the last chunk starts early to stay inside the sequence)."""
        return chunk_start(index, self.size, self.length)

    def owned(self, index: Array, start: Array) -> Array:
        """Which of the chunk's positions are its own (not covered by the chunk before)."""
        return chunk_owned(index, start, self.size)


def sequence_chunks(rows: int, length: int, columns: int, budget_bytes: int) -> SequenceChunks:
    """The chunk rule (module docstring) for `rows` batch rows and `columns` vocabulary columns
    on one device."""
    size, count = even_chunks(length, LOGIT_BYTES * rows * columns, budget_bytes, SUBLANES)
    return SequenceChunks(length, size, count)


def chunks_under_mesh(batch: int, seq: int, vocab: int, budget_bytes: int, mesh=None) -> SequenceChunks:
    """The chunks of a fused head over `batch` x `seq` tokens under `mesh` (default: the context
    mesh): the batch rows and vocabulary columns one device holds of the logits (`logits_share`)."""
    rows, columns = logits_share(batch, seq, vocab, mesh)
    return sequence_chunks(rows, seq, columns, budget_bytes)


def fused_loss(
    hidden: Float[Array, "batch seq dim"],
    head: OutputHead,
    targets: Int[Array, "batch seq"],
    budget_bytes: int,
    z_loss_weight: float = 0.0,
    weights: Bool[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The mean cross-entropy of the logits `hidden @ head` plus `z_loss_weight * mean(logsumexp^2)`,
    and the cross-entropy alone (not differentiated), both float32; `weights`: which tokens count
    (the means are over those; None: all). The gradients are made as the loss is (module docstring)."""
    batch, seq, _ = hidden.shape
    vocab = head.weight.shape[head.vocab_axis]
    counted = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    share = counted / jnp.maximum(jnp.sum(counted), 1.0)
    walk = _Walk(chunks_under_mesh(batch, seq, vocab, budget_bytes), head.vocab_axis, tuple(head.axes), z_loss_weight)
    loss, cross_entropy = _fused(hidden, head.weight, targets, share, walk)
    return loss, jax.lax.stop_gradient(cross_entropy)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """The static half of a fused head: its chunks, the weight's layout and the z-loss weight."""

    chunks: SequenceChunks
    vocab_axis: int
    axes: LogicalAxes
    z_loss_weight: float

    @property
    def weight_subscripts(self) -> str:
        return "dv" if self.vocab_axis == 1 else "vd"

    def pin(self, weight_like: Array) -> Array:
        """The weight's gradient pinned to the sharding its layer declares for the weight, so the
        sum over chunks stays split as the weight is."""
        return pinned(weight_like, lambda mesh: logical_spec(self.axes, PARAM_RULES, mesh))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(hidden: Array, weight: Array, targets: Array, share: Array, walk: _Walk) -> tuple[Array, Array]:
    return _forward(hidden, weight, targets, share, walk)[0]


def _forward(hidden: Array, weight: Array, targets: Array, share: Array, walk: _Walk) -> tuple[tuple, tuple]:
    chunks, subscripts, z = walk.chunks, walk.weight_subscripts, walk.z_loss_weight
    compute_weight = weight.astype(hidden.dtype)  # cast once: every chunk reads all of it
    columns = jnp.arange(weight.shape[walk.vocab_axis])

    def chunk(carry: tuple[Array, Array, Array], index: Array) -> tuple[tuple[Array, Array, Array], None]:
        sums, d_hidden, d_weight = carry
        start = chunks.start(index)
        owned = chunks.owned(index, start)

        def positions(array: Array) -> Array:
            return jax.lax.dynamic_slice_in_dim(array, start, chunks.size, 1)

        rows, row_targets = positions(hidden), positions(targets)
        row_share = jnp.where(owned, positions(share), 0.0)
        # in the compute dtype, then float32, as the whole logits are (half the bytes of float32 out of the MXU)
        logits = jnp.einsum(f"bsd,{subscripts}->bsv", rows, compute_weight).astype(jnp.float32)
        logits = constrain(logits, ("batch", None, "vocab"))
        logsumexp = jax.nn.logsumexp(logits, axis=-1)
        hit = row_targets[..., None] == columns
        target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        sums = sums + jnp.stack(
            [jnp.sum(row_share * (logsumexp - target_logit)), jnp.sum(row_share * logsumexp * logsumexp)]
        )
        scale = row_share * (1.0 + 2.0 * z * logsumexp)
        d_logits = scale[..., None] * jnp.exp(logits - logsumexp[..., None]) - jnp.where(hit, row_share[..., None], 0.0)
        d_logits = d_logits.astype(hidden.dtype)  # the compute dtype, as autodiff of the whole logits has it
        d_rows = jnp.einsum(f"bsv,{subscripts}->bsd", d_logits, compute_weight)
        d_rows = jnp.where(owned[None, :, None], d_rows, positions(d_hidden))
        d_hidden = constrain(jax.lax.dynamic_update_slice_in_dim(d_hidden, d_rows, start, 1))
        d_chunk = jnp.einsum(f"bsd,bsv->{subscripts}", rows, d_logits, preferred_element_type=jnp.float32)
        return (sums, d_hidden, walk.pin(d_weight + d_chunk)), None

    zero_weight = walk.pin(jnp.zeros(weight.shape, jnp.float32))
    init = (jnp.zeros(2, jnp.float32), constrain(jnp.zeros_like(hidden)), zero_weight)
    (sums, d_hidden, d_weight), _ = jax.lax.scan(chunk, init, jnp.arange(chunks.count))
    cross_entropy, mean_square = sums[0], sums[1]
    # the weight's gradient rounded to the compute dtype, as autodiff of a compute-dtype head has it
    d_weight = d_weight.astype(hidden.dtype).astype(weight.dtype)
    return (cross_entropy + z * mean_square, cross_entropy), (d_hidden, d_weight, share)


def _backward(walk: _Walk, residuals: tuple, cotangents: tuple[Array, Array]) -> tuple:
    """The forward pass's gradients times the loss's cotangent (the cross-entropy's is zero: its
    gradient is stopped in `fused_loss`)."""
    d_hidden, d_weight, share = residuals
    d_loss, _ = cotangents
    return (
        (d_loss * d_hidden).astype(d_hidden.dtype),
        (d_loss * d_weight).astype(d_weight.dtype),
        None,
        jnp.zeros_like(share),
    )


_fused.defvjp(_forward, _backward)
