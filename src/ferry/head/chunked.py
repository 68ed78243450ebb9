"""The output head's log-sum-exp and target logit of every token, computed one vocabulary chunk
at a time under its own VJP, so the batch x seq x vocab logits never exist at once.

Forward: per chunk, the logits of its columns (float32), folded into a running log-sum-exp, and
the target's logit when the target lies in the chunk; only these two per-token scalars (and the
head's inputs) are kept for the backward pass. Backward: per chunk, the logits again, their
softmax against the saved log-sum-exp, and from them the chunk's columns of the head's gradient
(written once, where they belong) and its share of the hidden state's gradient (accumulated).

Why vocabulary chunks rather than token chunks: the one thing a chunked backward accumulates is
then the hidden state's gradient (rows x dim), not the head's (dim x vocab), and each column of the
head's gradient is reduced over the batch's devices once instead of once per chunk. For Llama 3.1
8B at 8,192 tokens that accumulator is 128 MiB instead of 2 GiB.

When the head's weight gradient is made (`weight_grad`): `late` (the default) walks the chunks
twice in the backward pass, once for the hidden state's gradient, which the layers' backward
needs at once, and once for the weight's, which only the optimizer reads; XLA schedules the
second walk after the layers' backward, so neither the head's gradient nor the logits' working set
is held while the layers' run. The second walk makes each chunk's logits again: one more
logits-sized matmul (five in all against today's three). `early` makes both gradients in one walk
(four). The weight is read in its stored dtype and cast a chunk at a time, so no compute-dtype copy
of the whole head exists either (`ferry.train.step.batch_loss` keeps a head of its own in float32;
a head tied to the embedding table arrives cast, as the embedding reads it too).

The chunk rule (`vocab_chunks`): a chunk's float32 logits on one device, (its tokens) x (its
columns) x 4 bytes, stay within a budget (`train.loss_chunk_mib`, 256 MiB by default). A device's
tokens are the batch rows it holds times the sequence; its columns are its share of the vocabulary
(split over the mesh's tensor axis, as the logits are). The columns that fit are rounded down to a
multiple of 128 (TPU lanes) when at least 128 fit; the device's vocabulary is then split into as
few chunks as needed, evenly, each rounded up to that multiple (the last chunk starts early and
ignores the columns its predecessor covered, so no weight is padded or copied). Below 128 columns
per chunk (more than 512K tokens per device at 256 MiB) a chunk is as many columns as fit, at
least one.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from ferry.sharding import PARAM_RULES, LogicalAxes, activation_spec, constrain, context_mesh, logical_spec, shard_shape

LANES = 128  # a chunk's columns are a multiple of this when at least this many fit the budget
LOGIT_BYTES = 4  # float32


class OutputHead(NamedTuple):
    """The weight the logits read, as the loss needs to know it: the array, its logical axes (as
    its layer declares them) and which of its two axes is the vocabulary (1 for a head [dim,
    vocab], 0 for an embedding table [vocab, dim] the head is tied to)."""

    weight: Float[Array, "..."]
    axes: LogicalAxes
    vocab_axis: int = 1

    @property
    def tied(self) -> bool:
        """The head is the embedding table (which the embedding's gather reads too)."""
        return self.vocab_axis == 0


@dataclasses.dataclass(frozen=True)
class VocabChunks:
    """How a device's share of the vocabulary is walked: `shards` devices split the vocabulary
    (the tensor axis), each holding `columns`; a chunk is `size` of those, `count` chunks in all."""

    shards: int
    columns: int
    size: int
    count: int

    def start(self, index: Array) -> Array:
        """Chunk `index`'s first column (the last chunk starts early to stay inside the shard)."""
        return chunk_start(index, self.size, self.columns)

    def owned(self, index: Array, start: Array) -> Array:
        """Which of the chunk's columns are its own (not covered by the chunk before)."""
        return chunk_owned(index, start, self.size)


def chunk_start(index: Array, size: int, length: int) -> Array:
    """Chunk `index`'s first element along an axis of `length` walked in chunks of `size`: the
    last chunk starts early to stay inside it, so no array is padded."""
    return jnp.minimum(index * size, length - size)


def chunk_owned(index: Array, start: Array, size: int) -> Array:
    """Which of a chunk's elements are its own (not covered by the chunk before it)."""
    return start + jnp.arange(size) >= index * size


def even_chunks(length: int, unit_bytes: int, budget_bytes: int, align: int) -> tuple[int, int]:
    """(size, count): as few chunks of an axis of `length` as keep a chunk's `unit_bytes` per
    element within `budget_bytes`, evened out, each a multiple of `align` where `align` fit (else
    as many as fit, at least one). The rule of both heads' chunks."""
    fits = max(1, budget_bytes // unit_bytes)
    align = align if fits >= align else 1
    fits -= fits % align
    count = math.ceil(length / fits)
    return min(length, align * math.ceil(math.ceil(length / count) / align)), count


def vocab_chunks(tokens_per_device: int, vocab: int, shards: int, budget_bytes: int) -> VocabChunks:
    """The chunk rule (module docstring): as few chunks as keep a chunk's float32 logits on a
    device within `budget_bytes`."""
    columns = vocab // shards
    size, count = even_chunks(columns, LOGIT_BYTES * tokens_per_device, budget_bytes, LANES)
    return VocabChunks(shards, columns, size, count)


def logits_share(batch: int, seq: int, vocab: int, mesh=None) -> tuple[int, int]:
    """(batch rows, vocabulary columns) of the `batch` x `seq` x `vocab` logits one device holds
    under `mesh` (default: the context mesh; everything outside one): the batch split as
    activations are (`ACTIVATION_RULES`' batch axes), the vocabulary as logits are (its tensor
    axis, when that divides it)."""
    mesh = context_mesh() if mesh is None else mesh
    if mesh is None:
        return batch, vocab
    shape = (batch, seq, vocab)
    spec = activation_spec(jax.ShapeDtypeStruct(shape, jnp.float32), ("batch", None, "vocab"), mesh)
    rows, _, columns = shard_shape(shape, spec, mesh)
    return rows, columns


def chunks_under_mesh(batch: int, seq: int, vocab: int, budget_bytes: int, mesh=None) -> VocabChunks:
    """The chunks of a head over `batch` x `seq` tokens under `mesh`, each device's own tokens
    and vocabulary columns (`logits_share`)."""
    rows, columns = logits_share(batch, seq, vocab, mesh)
    return vocab_chunks(rows * seq, vocab, vocab // columns, budget_bytes)


def pinned(array: Array, spec_of: Callable[[Any], PartitionSpec]) -> Array:
    """`array` constrained to `spec_of(mesh)` on the context mesh, where one of several devices
    with automatic axes is set (elsewhere there is nothing to pin)."""
    mesh = context_mesh()
    if mesh is None or mesh.size == 1 or any(t != AxisType.Auto for t in mesh.axis_types):
        return array
    return jax.lax.with_sharding_constraint(array, NamedSharding(mesh, spec_of(mesh)))


def logsumexp_and_target_logit(
    hidden: Float[Array, "batch seq dim"],
    head: OutputHead,
    targets: Int[Array, "batch seq"],
    budget_bytes: int,
    weight_grad: str = "late",
) -> tuple[Float[Array, "batch seq"], Float[Array, "batch seq"]]:
    """Per token, logsumexp of the logits `hidden @ head` and the logit of its target, both
    float32, with the logits made a chunk at a time (`budget_bytes` per chunk and device);
    `weight_grad`: late or early (module docstring)."""
    batch, seq, _ = hidden.shape
    vocab = head.weight.shape[head.vocab_axis]
    chunks = chunks_under_mesh(batch, seq, vocab, budget_bytes)
    layout = _Layout(chunks, head.vocab_axis, tuple(head.axes), weight_grad == "late")
    return _chunked(hidden, head.weight, targets, layout)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The static half of a chunked head: its chunks, the weight's layout, and whether the
    weight's gradient gets a walk of its own (`late`)."""

    chunks: VocabChunks
    vocab_axis: int
    axes: LogicalAxes
    late: bool = True

    def split(self, weight: Array) -> Array:
        """The weight with its vocabulary axis split into (shard, column): [dim, shards, columns]
        or [shards, columns, dim]; the shard axis carries the tensor split."""
        chunks = self.chunks
        if self.vocab_axis == 1:
            return weight.reshape(weight.shape[0], chunks.shards, chunks.columns)
        return weight.reshape(chunks.shards, chunks.columns, weight.shape[1])

    @property
    def column_axis(self) -> int:
        return 2 if self.vocab_axis == 1 else 1

    def weight_subscripts(self) -> str:
        return "dtc" if self.vocab_axis == 1 else "tcd"

    def slice(self, split_weight: Array, start: Array) -> Array:
        return jax.lax.dynamic_slice_in_dim(split_weight, start, self.chunks.size, self.column_axis)

    def pin_weight(self, split_weight: Array) -> Array:
        """A split weight (or its gradient) pinned to the sharding its layer declares, so the
        gradient accumulated across chunks stays sharded as the weight is."""

        def spec_of(mesh: Any) -> PartitionSpec:
            dim_entry, vocab_entry = _entries(self.axes, self.vocab_axis, mesh)
            entries = (dim_entry, vocab_entry, None) if self.vocab_axis == 1 else (vocab_entry, None, dim_entry)
            return PartitionSpec(*entries)

        return pinned(split_weight, spec_of)


def _entries(axes: LogicalAxes, vocab_axis: int, mesh) -> tuple:
    """(the dim axis's, the vocabulary axis's) mesh axes of a weight declared `axes`."""
    spec = logical_spec(axes, PARAM_RULES, mesh)
    return spec[1 - vocab_axis], spec[vocab_axis]


def _chunk_logits(hidden: Array, split_weight: Array, layout: _Layout, index: Array) -> tuple[Array, Array, Array]:
    """Chunk `index`'s float32 logits [batch, seq, shards, size] (columns it does not own at
    -inf), its weight slice and its start."""
    start = layout.chunks.start(index)
    weight = layout.slice(split_weight, start).astype(hidden.dtype)  # a tied table may be stored wider
    logits = jnp.einsum(f"bsd,{layout.weight_subscripts()}->bstc", hidden, weight, preferred_element_type=jnp.float32)
    # split as whole logits are: rows over the batch axes, columns over the tensor axis (through the
    # shard axis, or the chunk's columns when the vocabulary is not split)
    split = ("batch", None, "vocab", None) if layout.chunks.shards > 1 else ("batch", None, None, "vocab")
    logits = constrain(logits, split)
    owned = layout.chunks.owned(index, start)
    return jnp.where(owned, logits, -jnp.inf), weight, start


def _is_target(targets: Array, chunks: VocabChunks, start: Array) -> Array:
    """[batch, seq, shards, size]: whether each of the chunk's columns is the token's target."""
    shard, column = targets // chunks.columns, targets % chunks.columns
    in_shard = shard[..., None] == jnp.arange(chunks.shards)
    at_column = column[..., None] == start + jnp.arange(chunks.size)
    return in_shard[..., :, None] & at_column[..., None, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked(hidden: Array, weight: Array, targets: Array, layout: _Layout) -> tuple[Array, Array]:
    return _forward(hidden, weight, targets, layout)[0]


def _forward(hidden: Array, weight: Array, targets: Array, layout: _Layout) -> tuple[tuple[Array, Array], tuple]:
    split_weight = layout.split(weight)

    def chunk(carry: tuple[Array, Array], index: Array) -> tuple[tuple[Array, Array], None]:
        logsumexp, target_logit = carry
        logits, _, start = _chunk_logits(hidden, split_weight, layout, index)
        logsumexp = jnp.logaddexp(logsumexp, jax.nn.logsumexp(logits, axis=(2, 3)))
        hit = _is_target(targets, layout.chunks, start) & layout.chunks.owned(index, start)
        target_logit = target_logit + jnp.sum(jnp.where(hit, logits, 0.0), axis=(2, 3))
        return (logsumexp, target_logit), None

    rows = targets.shape
    init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32))
    (logsumexp, target_logit), _ = jax.lax.scan(chunk, init, jnp.arange(layout.chunks.count))
    return (logsumexp, target_logit), (hidden, weight, targets, logsumexp)


def _backward(layout: _Layout, residuals: tuple, cotangents: tuple[Array, Array]) -> tuple[Array, Array, None]:
    hidden, weight, targets, logsumexp = residuals
    d_logsumexp, d_target_logit = cotangents
    split_weight = layout.split(weight)
    subscripts = layout.weight_subscripts()
    indices = jnp.arange(layout.chunks.count)

    def d_logits_of(index: Array) -> tuple[Array, Array, Array]:
        """Chunk `index`'s logits again, and their gradient in the compute dtype (as autodiff of
        the whole logits in it has it), its weight slice and its start."""
        logits, weight_chunk, start = _chunk_logits(hidden, split_weight, layout, index)
        softmax = jnp.exp(logits - logsumexp[..., None, None])  # 0 at columns the chunk does not own
        hit = _is_target(targets, layout.chunks, start) & layout.chunks.owned(index, start)
        d_logits = d_logsumexp[..., None, None] * softmax + jnp.where(hit, d_target_logit[..., None, None], 0.0)
        return d_logits.astype(hidden.dtype), weight_chunk, start

    def add_d_hidden(d_hidden: Array, d_logits: Array, weight_chunk: Array) -> Array:
        product = jnp.einsum(f"bstc,{subscripts}->bsd", d_logits, weight_chunk, preferred_element_type=jnp.float32)
        return constrain(d_hidden + product)

    def write_d_weight(d_weight: Array, d_logits: Array, index: Array, start: Array) -> Array:
        """The chunk's columns of the weight's gradient, written once (a clamped last chunk keeps
        the columns its predecessor wrote)."""
        d_chunk = jnp.einsum(f"bsd,bstc->{subscripts}", hidden, d_logits, preferred_element_type=jnp.float32)
        owned = layout.chunks.owned(index, start)
        owned = owned[None, None, :] if layout.vocab_axis == 1 else owned[None, :, None]
        d_chunk = jnp.where(owned, d_chunk.astype(d_weight.dtype), layout.slice(d_weight, start))
        return layout.pin_weight(jax.lax.dynamic_update_slice_in_dim(d_weight, d_chunk, start, layout.column_axis))

    # the weight's gradient in the compute dtype, as autodiff of a compute-dtype head makes it
    zero_hidden = constrain(jnp.zeros(hidden.shape, jnp.float32))
    zero_weight = layout.pin_weight(jnp.zeros(split_weight.shape, hidden.dtype))
    if layout.late:

        def hidden_step(d_hidden: Array, index: Array) -> tuple[Array, None]:
            d_logits, weight_chunk, _ = d_logits_of(index)
            return add_d_hidden(d_hidden, d_logits, weight_chunk), None

        def weight_step(d_weight: Array, index: Array) -> tuple[Array, None]:
            d_logits, _, start = d_logits_of(index)
            return write_d_weight(d_weight, d_logits, index, start), None

        d_hidden, _ = jax.lax.scan(hidden_step, zero_hidden, indices)
        d_weight, _ = jax.lax.scan(weight_step, zero_weight, indices)
    else:

        def both_step(carry: tuple[Array, Array], index: Array) -> tuple[tuple[Array, Array], None]:
            d_hidden, d_weight = carry
            d_logits, weight_chunk, start = d_logits_of(index)
            return (
                add_d_hidden(d_hidden, d_logits, weight_chunk),
                write_d_weight(d_weight, d_logits, index, start),
            ), None

        (d_hidden, d_weight), _ = jax.lax.scan(both_step, (zero_hidden, zero_weight), indices)
    return d_hidden.astype(hidden.dtype), d_weight.reshape(weight.shape).astype(weight.dtype), None


_chunked.defvjp(_forward, _backward)
