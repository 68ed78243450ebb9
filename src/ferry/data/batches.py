"""Packing a token stream into [batch, seq_len + 1] windows, shuffled deterministically."""

from collections.abc import Iterator

import numpy as np


class PackedBatches:
    """Non-overlapping windows of `seq_len + 1` tokens (inputs plus the shifted targets),
    crossing document boundaries; every epoch visits each window once in a seeded order."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, shuffle: bool = True):
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < batch_size:
            raise ValueError(
                f"{len(tokens)} tokens make {self.num_windows} windows of seq_len {seq_len}, "
                f"fewer than one batch of {batch_size}"
            )

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_windows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def window_ids(self) -> Iterator[np.ndarray]:
        """The windows of each batch, in order: cheap, so every process walks the same order and
        builds only its own rows with `window_batch`."""
        epoch = 0
        while True:
            order = self._order(epoch)
            for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
                yield order[start : start + self.batch_size]
            epoch += 1

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.window_batch(windows) for windows in self.window_ids())

    def window_batch(self, windows: np.ndarray) -> np.ndarray:
        offsets = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        return self.tokens[offsets].astype(np.int32)
