"""The stdlib corpus, the byte tokenizer and packed batches."""

import numpy as np
import pytest

from ferry.data.batches import PackedBatches
from ferry.data.stdlib_corpus import load_stdlib_corpus, stdlib_files
from ferry.data.tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode_document("def f(x):\n    return 'é'\n".encode())
    assert ids[-1] == tokenizer.end_of_document
    assert tokenizer.decode(ids[:-1]) == "def f(x):\n    return 'é'\n"


def test_stdlib_corpus_split_is_disjoint_and_deterministic(tmp_path):
    for name, text in {"a.py": "x = 1\n", "b.py": "y = 2\n", "pkg/c.py": "z = 3\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert len(stdlib_files(tmp_path)) == 3
    corpus = load_stdlib_corpus(0.5, ByteTokenizer(), tmp_path)
    again = load_stdlib_corpus(0.5, ByteTokenizer(), tmp_path)
    np.testing.assert_array_equal(corpus.train, again.train)
    assert len(corpus.train) + len(corpus.eval) == 3 * 7
    assert not set(bytes(corpus.train).split(b"\0")) - {b""} & set(bytes(corpus.eval).split(b"\0"))


def test_empty_corpus_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="empty"):
        load_stdlib_corpus(0.1, ByteTokenizer(), tmp_path)


def test_packed_batches_shift_and_shuffle():
    tokens = np.arange(1000) % 251
    batches = iter(PackedBatches(tokens, 4, 16, seed=0))
    first = next(batches)
    assert first.shape == (4, 17) and first.dtype == np.int32
    for row in first:  # each row is a contiguous window of the stream
        start = int(np.flatnonzero(tokens == row[0])[0])
        np.testing.assert_array_equal(row, tokens[start : start + 17])
    same = next(iter(PackedBatches(tokens, 4, 16, seed=0)))
    other = next(iter(PackedBatches(tokens, 4, 16, seed=1)))
    np.testing.assert_array_equal(first, same)
    assert not np.array_equal(first, other)


def test_too_few_tokens_for_a_batch():
    with pytest.raises(ValueError, match="fewer than one batch"):
        PackedBatches(np.arange(50), 4, 16, seed=0)
