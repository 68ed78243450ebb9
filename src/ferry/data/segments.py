"""Document-aware packing (`data.document_mask=true`): each token's document (segment id) and its
position inside it, derived on device from the end-of-document ids a window already holds.

A window is cut from the joined token stream, so it holds the end of one document, whole
documents, and the start of another. A token's segment is the count of end-of-document ids before
it; the id itself belongs to the document it ends. Positions count from each document's first
token (from the window's first token for the document it began in). Attention then stays inside
a segment, and rotary embeddings see the positions, as if each document were run alone.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


@dataclasses.dataclass(frozen=True)
class DocumentMask:
    """How a model treats the documents packed into a window (static under jit)."""

    end_of_document: int
    loss_across_documents: bool = True  # False: no loss for predicting a document's first token


def document_segments(
    tokens: Int[Array, "batch seq"], end_of_document: int
) -> tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]:
    """(segment ids, positions inside each segment) of a batch of packed windows."""
    seq = tokens.shape[1]
    ends = tokens == end_of_document
    starts = jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], axis=1)  # after an end
    segment_ids = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    index = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), tokens.shape)
    segment_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return segment_ids, index - segment_start


def loss_weights(inputs: Int[Array, "batch seq"], mask: DocumentMask | None) -> Bool[Array, "batch seq"] | None:
    """Which predictions count: all (None), or, with `loss_across_documents=False`, not those made
    from an end-of-document id (the next document's first token)."""
    if mask is None or mask.loss_across_documents:
        return None
    return inputs != mask.end_of_document
