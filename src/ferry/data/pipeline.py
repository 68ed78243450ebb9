"""Batches as a Grain pipeline: packed windows of a token stream, shuffled with a seed, the rows a
process needs built in a background thread, and the position checkpointable.

The token stream (documents joined by end-of-document ids; an array, or memory-mapped shards) is
cut into non-overlapping windows of `seq_len + 1` tokens (inputs plus the shifted targets); a
batch reads only its own windows. Each epoch visits every window once in
an order Grain's `shuffle` derives from the seed and the epoch. Every process walks the same
global order of batches but builds only the rows its own devices hold, so the batches do not
depend on the number of processes; the iterator's state (a batch index) is the same everywhere.
"""

import dataclasses

import grain
import numpy as np
from jaxtyping import Int

from ferry.data.loss_weights import joined_rows
from ferry.data.shards import ShardedTokens


@dataclasses.dataclass(frozen=True)
class PackedWindows:
    """A split's windows; with `weights` (a chat corpus), each row carries its tokens' loss weights
    after its ids (`ferry.data.loss_weights`)."""

    tokens: np.ndarray | ShardedTokens
    seq_len: int
    weights: np.ndarray | ShardedTokens | None = None  # one per token, aligned with `tokens`

    @property
    def num_windows(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def rows(self, windows: Int[np.ndarray, " rows"]) -> Int[np.ndarray, "rows row_width"]:
        starts = np.asarray(windows, np.int64) * self.seq_len
        ids = self._cut(self.tokens, starts)
        if self.weights is None:
            return ids
        return joined_rows(ids, self._cut(self.weights, starts))

    def _cut(self, stream: np.ndarray | ShardedTokens, starts: np.ndarray) -> Int[np.ndarray, "rows seq_plus_one"]:
        if not len(starts):
            return np.zeros((0, self.seq_len + 1), np.int32)
        return np.stack([stream[start : start + self.seq_len + 1] for start in starts]).astype(np.int32)


def window_batches(
    windows: PackedWindows, batch_size: int, seed: int, shuffle: bool = True, where: str = "train"
) -> grain.MapDataset:
    """The window ids of every global batch, endlessly: element i is batch i's [batch_size] ids."""
    if windows.num_windows < batch_size:
        raise ValueError(
            f"the {where} split's {len(windows.tokens):,} tokens make {windows.num_windows} windows of "
            f"seq_len {windows.seq_len}, fewer than one batch of {batch_size}; use more data, a shorter "
            "train.seq_len or a smaller train.global_batch_size"
        )
    ids = grain.MapDataset.range(windows.num_windows)
    if shuffle:
        ids = ids.shuffle(seed)  # reseeded with the epoch by `repeat`
    return ids.repeat(None).batch(batch_size, drop_remainder=True)


@dataclasses.dataclass(frozen=True)
class LocalRows:
    """Builds the rows `local_rows` (of the global batch) that this process's devices hold."""

    windows: PackedWindows
    local_rows: np.ndarray

    def __call__(self, batch_windows: Int[np.ndarray, " batch"]) -> Int[np.ndarray, "local seq_plus_one"]:
        return self.windows.rows(batch_windows[self.local_rows])


def local_batches(
    windows: PackedWindows,
    batch_size: int,
    seed: int,
    local_rows: np.ndarray,
    prefetch: int,
    shuffle: bool = True,
    where: str = "train",
) -> grain.DatasetIterator:
    """An iterator over this process's rows of each global batch, `prefetch` batches built ahead
    in a background thread; `get_state()` / `set_state()` save and restore its position."""
    dataset = window_batches(windows, batch_size, seed, shuffle, where).map(LocalRows(windows, local_rows))
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)
    return dataset.to_iter_dataset(options).__iter__()
