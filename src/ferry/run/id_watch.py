"""The lagged check of every training batch's token ids: the device reduces each batch to its
smallest and largest id beside the step (`ferry.data.token_range.batch_id_range`, dispatched before
the step, which donates the batch), and the pair is read a step late, as the non-finite flag is
(`ferry.run.nonfinite`), so that reading it never waits for the step in flight. It is read at once
before anything leaves the device (a log, an evaluation, a save, a stop): a batch with an id
outside the vocabulary stops the run before any checkpoint of the state it reached is written, and
the refusal names where in the data the id lies."""

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ferry.data.pipeline import PackedWindows, window_batches
from ferry.data.token_range import TokenIdError, batch_id_range, first_outside, outside_vocabulary, token_place


@dataclasses.dataclass(frozen=True)
class BadBatch:
    step: int
    low: int  # the batch's smallest id
    high: int  # and its largest


@dataclasses.dataclass
class TokenIdWatch:
    """The first training batch found with an id outside [0, vocab_size) (`bad`)."""

    vocab_size: int
    bad: BadBatch | None = None
    _unread: tuple[int, jax.Array] | None = None  # a step whose batch's range is not read yet

    def issued(self, step: int, batch: jax.Array) -> None:
        """Step `step`'s batch is about to be stepped on: read the batch before it, and reduce this one."""
        self._read()
        self._unread = (step, batch_id_range(batch))

    def settle(self) -> None:
        """Read the batch not yet read, if any (blocks on its reduction, not on the step)."""
        self._read()

    def _read(self) -> None:
        pending, self._unread = self._unread, None
        if pending is None or self.bad is not None:
            return
        low, high = (int(value) for value in np.asarray(pending[1]))
        if low < 0 or high >= self.vocab_size:
            self.bad = BadBatch(pending[0], low, high)


def batch_index(data_state: Any) -> int | None:
    """The index in the training stream of the batch taken last, from the iterator's state (Grain's
    `next_index`), or None where the state says nothing of it."""
    next_index = data_state.get("next_index") if isinstance(data_state, dict) else None
    return int(next_index) - 1 if isinstance(next_index, int) else None


def bad_batch_error(
    bad: BadBatch,
    index: int | None,
    windows: PackedWindows,
    batch_size: int,
    seed: int,
    vocab_size: int,
    model_name: str,
    checkpoints: Path,
) -> TokenIdError:
    """The refusal of training batch `index` (step `bad.step`'s): the batch's windows are read
    again on the host to say where its first id outside the vocabulary lies."""
    token = bad.high if bad.high >= vocab_size else bad.low
    place = f"step {bad.step}'s batch (ids {bad.low:,} to {bad.high:,})"
    if index is not None:
        ids = np.asarray(window_batches(windows, batch_size, seed)[index])
        rows = windows.rows(ids)
        found = first_outside(rows.reshape(-1), vocab_size)
        if found is not None:
            row, column = divmod(found, rows.shape[1])
            where = token_place(windows.tokens, int(ids[row]) * windows.seq_len + column, "train")
            place = f"step {bad.step}'s batch (batch {index:,} of the training stream, row {row}): {where}"
            token = int(rows[row, column])
    return TokenIdError(
        outside_vocabulary(place, token, vocab_size, model_name)
        + f". Training stopped before saving the state it reached: the checkpoints in {checkpoints} are of earlier "
        "steps"
    )
