"""Per-token loss weights in a batch (`data.format=chat`): which targets count in the loss.

A weighted batch row is its window's `seq_len + 1` token ids followed by the same tokens' `seq_len
+ 1` weights (1: the token counts as a target, 0: it does not), so a batch stays one int32 array
of shape [batch, 2 * (seq_len + 1)]: placed, sharded by rows, split into micro batches and
donated exactly as a text batch is. A text batch carries no weights and its loss is computed as
before weights existed (every target counts)."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, Integer


def joined_rows(
    ids: Integer[np.ndarray, "rows seq_plus_one"],
    weights: Integer[np.ndarray, "rows seq_plus_one"] | Bool[np.ndarray, "rows seq_plus_one"],
) -> Int[np.ndarray, "rows row_width"]:
    """Rows of ids, each followed by its tokens' loss weights (0 or 1)."""
    return np.concatenate([ids, (np.asarray(weights) != 0).astype(ids.dtype)], axis=1).astype(np.int32)


def weighted_width(seq_len: int) -> int:
    """The width of a weighted batch's row."""
    return 2 * (seq_len + 1)


def split_rows(
    batch: Int[Array, "batch row_width"],
) -> tuple[Int[Array, "batch seq_plus_one"], Bool[Array, "batch seq"]]:
    """A weighted batch's token ids, and which of its targets (`tokens[:, 1:]`) count."""
    width = batch.shape[1] // 2
    tokens, weights = batch[:, :width], batch[:, width:]
    return tokens, weights[:, 1:] != 0


def counted(
    document_weights: Bool[Array, "batch seq"] | None, target_weights: Bool[Array, "batch seq"] | None
) -> Bool[Array, "batch seq"] | None:
    """The targets that count under both the document mask's weights and the data's (None: all)."""
    if document_weights is None:
        return target_weights
    if target_weights is None:
        return document_weights
    return jnp.logical_and(document_weights, target_weights)
