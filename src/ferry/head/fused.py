"""The loss and both of the output head's gradients made in one walk of the forward pass, a chunk
of the sequence at a time (`train.loss_head=fused`): three logits-sized matmuls a step, as the
whole logits take, where the vocabulary-chunked head (`ferry.head.chunked`) takes four or five,
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

On a TPU v5e it is faster than the vocabulary-chunked head, alone and in a train step, and in
one chunk (the whole sequence) as fast as the whole logits in a third of their temporaries; each
further chunk reads and writes the weight gradient's float32 sum once more. It is not the
default because it holds the weight's gradient through the layers' backward, so an H200 plan of
Llama 3.1 8B needs more temporaries with it than with the chunked head's late walk. The figures:
docs/results/loss-head.md.

Who makes a chunk (`train.loss_kernel`, `kernel_for`): XLA, which writes the chunk's float32
logits to HBM and reads them back, or a Pallas TPU kernel that keeps them in VMEM
(`ferry.head.kernel`; faster than XLA's whole logits on v5e, alone and in a step).
`auto`, the default, takes the kernel on a TPU whose devices each hold the whole vocabulary and
whose VMEM holds blocks of 512 tokens or more (`ferry.head.kernel_choice`).

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
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from ferry.head.chunked import LOGIT_BYTES, OutputHead, chunk_owned, chunk_start, even_chunks, logits_share, pinned
from ferry.head.kernel import head_chunk
from ferry.head.kernel_choice import KernelChoice, choose_kernel
from ferry.sharding import PARAM_RULES, LogicalAxes, activation_spec, constrain, context_mesh, logical_spec

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
    kernel: str = "auto",
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The mean cross-entropy of the logits `hidden @ head` plus `z_loss_weight * mean(logsumexp^2)`,
    and the cross-entropy alone (not differentiated), both float32; `weights`: which tokens count
    (the means are over those; None: all). The gradients are made as the loss is (module docstring),
    each chunk's by XLA or by the Pallas kernel of `ferry.head.kernel`, as `kernel_for` reads
    `kernel` ("auto", "xla" or "pallas")."""
    batch, seq, _ = hidden.shape
    vocab = head.weight.shape[head.vocab_axis]
    counted = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    share = counted / jnp.maximum(jnp.sum(counted), 1.0)
    chunks = chunks_under_mesh(batch, seq, vocab, budget_bytes)
    choice = kernel_for(kernel, batch, seq, vocab, hidden.shape[-1], hidden.dtype.itemsize, budget_bytes)
    walk = _Walk(chunks, head.vocab_axis, tuple(head.axes), z_loss_weight, choice)
    loss, cross_entropy = _fused(hidden, head.weight, targets, share, walk)
    return loss, jax.lax.stop_gradient(cross_entropy)


def kernel_for(
    setting: str, batch: int, seq: int, vocab: int, dim: int, itemsize: int, budget_bytes: int, mesh=None
) -> KernelChoice:
    """`train.loss_kernel`'s choice (`ferry.head.kernel_choice`) for a fused head over `batch` x `seq`
    tokens of width `dim` under `mesh` (default: the context's): one device's chunk."""
    rows, columns = logits_share(batch, seq, vocab, mesh)
    chunks = sequence_chunks(rows, seq, columns, budget_bytes)
    return choose_kernel(setting, rows * chunks.size, columns, vocab, dim, itemsize, mesh)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """The static half of a fused head: its chunks, the weight's layout and the z-loss weight."""

    chunks: SequenceChunks
    vocab_axis: int
    axes: LogicalAxes
    z_loss_weight: float
    maker: KernelChoice  # who makes a chunk's gradients: XLA, or the Pallas kernel in its blocks

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

    def chunk(carry: tuple[Array, Array, Array], index: Array) -> tuple[tuple[Array, Array, Array], None]:
        sums, d_hidden, d_weight = carry
        start = chunks.start(index)
        owned = chunks.owned(index, start)

        def positions(array: Array) -> Array:
            return jax.lax.dynamic_slice_in_dim(array, start, chunks.size, 1)

        rows, row_targets = positions(hidden), positions(targets)
        row_share = jnp.where(owned, positions(share), 0.0)
        gradients = _kernel_chunk if walk.maker.kernel == "pallas" else _xla_chunk
        logsumexp, target_logit, d_logits, d_rows = gradients(rows, compute_weight, row_targets, row_share, walk)
        sums = sums + jnp.stack(
            [jnp.sum(row_share * (logsumexp - target_logit)), jnp.sum(row_share * logsumexp * logsumexp)]
        )
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


def _xla_chunk(rows: Array, weight: Array, targets: Array, share: Array, walk: _Walk) -> tuple[Array, ...]:
    """A chunk's log-sum-exp and target logit, and the gradients of its logits and rows, as XLA
    makes them: the chunk's float32 logits written to HBM and read back."""
    subscripts, z = walk.weight_subscripts, walk.z_loss_weight
    # in the compute dtype, then float32, as the whole logits are (half the bytes of float32 out of the MXU)
    logits = jnp.einsum(f"bsd,{subscripts}->bsv", rows, weight).astype(jnp.float32)
    logits = constrain(logits, ("batch", None, "vocab"))
    logsumexp = jax.nn.logsumexp(logits, axis=-1)
    hit = targets[..., None] == jnp.arange(weight.shape[walk.vocab_axis])
    target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    scale = share * (1.0 + 2.0 * z * logsumexp)
    d_logits = scale[..., None] * jnp.exp(logits - logsumexp[..., None]) - jnp.where(hit, share[..., None], 0.0)
    d_logits = d_logits.astype(rows.dtype)  # the compute dtype, as autodiff of the whole logits has it
    return logsumexp, target_logit, d_logits, jnp.einsum(f"bsv,{subscripts}->bsd", d_logits, weight)


def _kernel_chunk(rows: Array, weight: Array, targets: Array, share: Array, walk: _Walk) -> tuple[Array, ...]:
    """The same from the Pallas kernel (`ferry.head.kernel`), the logits only in VMEM. A Pallas
    kernel has no partitioning rule: on a mesh it runs under shard_map on each device's batch
    rows, the weight whole on every device (the vocabulary unsplit: `ferry.head.kernel_choice`)."""

    def per_device(rows: Array, weight: Array, targets: Array, share: Array) -> tuple[Array, ...]:
        batch, positions, dim = rows.shape
        flat, maker = batch * positions, walk.maker
        assert maker.tiles is not None  # a choice of the kernel names its blocks
        outputs = head_chunk(
            rows.reshape(flat, dim), weight, targets.reshape(flat), share.reshape(flat),
            maker.tiles, walk.vocab_axis, walk.z_loss_weight, maker.interpret,
        )  # fmt: skip
        return tuple(out.reshape(batch, positions, *out.shape[1:]) for out in outputs)

    mesh = context_mesh()
    if mesh is None or mesh.size == 1:
        return per_device(rows, weight, targets, share)
    spec = activation_spec(rows, ("batch", None, None), mesh)
    per_token = PartitionSpec(*spec[:2])
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(spec, PartitionSpec(), per_token, per_token),
        out_specs=(per_token, per_token, spec, spec),
        check_vma=False,
    )(rows, weight, targets, share)


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
