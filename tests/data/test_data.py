"""Data: every source, both tokenizers, the errors raised before training, and the Grain pipeline
(packing, seeded shuffling, per-process rows, a checkpointed position)."""

import json

import numpy as np
import pytest

from ferry.data.config import DataConfig
from ferry.data.corpus import check_vocab, load_corpus
from ferry.data.pipeline import PackedWindows, local_batches, window_batches
from ferry.data.sources import DataSourceError, stdlib_files
from ferry.data.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    """Raw sources cache their tokens under $XDG_CACHE_HOME: a fresh one per test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ferry" / "tokens"


TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1) for i in range(40)]


def corpus_of(tokenizer=None, vocab_size=256, **data):
    return load_corpus(DataConfig(**{"eval_fraction": 0.25, **data}), tokenizer or ByteTokenizer(), vocab_size)


def documents_of(corpus, end_of_document=0):
    """The documents of both splits, as byte strings (byte tokenizer)."""
    splits = (np.asarray(corpus.train), np.asarray(corpus.eval))
    return {d for split in splits for d in bytes(split).split(bytes([end_of_document])) if d}


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode_document("def f(x):\n    return 'é'\n".encode())
    assert ids[-1] == tokenizer.end_of_document
    assert tokenizer.decode(ids[:-1]) == "def f(x):\n    return 'é'\n"


def test_stdlib_corpus_split_is_disjoint_and_deterministic(tmp_path):
    for name, text in {"a.py": "x = 1\n", "b.py": "y = 2\n", "pkg/c.py": "z = 3\n", "d.py": "w = 4\n"}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert len(stdlib_files(tmp_path)) == 4
    corpus = load_corpus(DataConfig(path=str(tmp_path), eval_fraction=0.5), ByteTokenizer(), 256)
    again = load_corpus(DataConfig(path=str(tmp_path), eval_fraction=0.5), ByteTokenizer(), 256)
    np.testing.assert_array_equal(corpus.train, again.train)
    assert len(corpus.train) + len(corpus.eval) == 4 * 7
    train, held_out = bytes(np.asarray(corpus.train)), bytes(np.asarray(corpus.eval))
    assert not set(train.split(b"\0")) - {b""} & set(held_out.split(b"\0"))


def test_text_jsonl_parquet_and_arrayrecord_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    expected = {t.encode() for t in TEXTS}
    (tmp_path / "text" / "sub").mkdir(parents=True)
    for i, text in enumerate(TEXTS):
        (tmp_path / "text" / ("sub" if i % 2 else "") / f"{i}.txt").write_text(text)
    for i in range(8):
        (tmp_path / "text" / f"notes{i}.md").write_text(f"note {i}, not matched by *.txt")
    assert documents_of(corpus_of(source="text", path=str(tmp_path / "text"))) == expected
    assert corpus_of(source="text", path=str(tmp_path / "text"), pattern="*.md", eval_fraction=0.5).num_documents == 8

    lines = [json.dumps({"body": t, "id": i}) for i, t in enumerate(TEXTS)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n\n")
    assert documents_of(corpus_of(source="jsonl", path=str(tmp_path / "docs.jsonl"), field="body")) == expected
    with pytest.raises(DataSourceError, match="docs.jsonl:1 has no field 'text'; set data.field"):
        corpus_of(source="jsonl", path=str(tmp_path / "docs.jsonl"))

    pq.write_table(pa.table({"content": TEXTS}), tmp_path / "docs.parquet")
    assert documents_of(corpus_of(source="parquet", path=str(tmp_path / "docs.parquet"), field="content")) == expected
    with pytest.raises(DataSourceError, match=r"no column 'text' \(columns: content\)"):
        corpus_of(source="parquet", path=str(tmp_path / "docs.parquet"))

    writer = ArrayRecordWriter(str(tmp_path / "docs.array_record"), "group_size:1")
    for text in TEXTS:
        writer.write(text.encode())
    writer.close()
    assert documents_of(corpus_of(source="arrayrecord", path=str(tmp_path))) == expected


def test_synthetic_tokens_cover_the_model_vocabulary():
    corpus = load_corpus(DataConfig(source="synthetic", synthetic_tokens=50_000, seed=3), ByteTokenizer(), 1000)
    assert len(corpus.train) == 50_000 and len(corpus.eval) == 2500 and corpus.train.dtype == np.uint16
    assert corpus.train.max() == 999 and corpus.train.min() == 0
    again = load_corpus(DataConfig(source="synthetic", synthetic_tokens=50_000, seed=3), ByteTokenizer(), 1000)
    np.testing.assert_array_equal(corpus.train, again.train)


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory):
    """A small byte-level BPE tokenizer.json, trained here (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXTS, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_hugging_face_tokenizer(hf_tokenizer_file, tmp_path):
    tokenizer = load_tokenizer(str(hf_tokenizer_file.parent))  # a directory holding tokenizer.json
    assert tokenizer.vocab_size == 300 and tokenizer.end_of_document == 0  # <|endoftext|>
    (ids,) = tokenizer.encode_documents([TEXTS[3].encode()])
    assert ids[-1] == 0 and len(ids) < len(TEXTS[3]) / 2  # merges learnt: fewer ids than bytes
    assert tokenizer.decode(ids[:-1]) == TEXTS[3]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    corpus = corpus_of(tokenizer, 300, source="jsonl", path=str(tmp_path / "docs.jsonl"))
    train, held_out = np.asarray(corpus.train), np.asarray(corpus.eval)
    assert train.dtype == np.uint16 and train.max() < 300
    assert np.count_nonzero(train == 0) + np.count_nonzero(held_out == 0) == len(TEXTS)
    with pytest.raises(ValueError, match="has 300 ids but model llama_tiny has vocab_size 256"):
        check_vocab(tokenizer, 256, "llama_tiny")
    with pytest.raises(ValueError, match="no end-of-document token '<eos>'; set data.eos_token"):
        load_tokenizer(str(hf_tokenizer_file), eos_token="<eos>")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json there"):
        load_tokenizer(str(tmp_path))


def test_missing_path_and_empty_corpus_are_errors(tmp_path):
    with pytest.raises(DataSourceError, match="data.path=.*nowhere does not exist"):
        corpus_of(source="jsonl", path=str(tmp_path / "nowhere"))
    with pytest.raises(DataSourceError, match="needs data.path"):
        corpus_of(source="text")
    with pytest.raises(DataSourceError, match="holds no files matching '\\*.parquet'"):
        corpus_of(source="parquet", path=str(tmp_path))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="found no text in .*: the corpus is empty"):
        corpus_of(source="text", path=str(tmp_path))
    with pytest.raises(DataSourceError, match="the stdlib corpus is empty"):
        corpus_of(path=str(tmp_path))


def test_packed_windows_shuffle_per_epoch_and_seed():
    windows = PackedWindows(np.arange(1000) % 251, 16)
    assert windows.num_windows == 62
    rows = windows.rows(np.array([0, 5]))
    assert rows.shape == (2, 17) and rows.dtype == np.int32
    np.testing.assert_array_equal(rows[1], np.arange(80, 97))  # window 5: tokens 80..96 (inputs + shifted)
    batches = window_batches(windows, 4, seed=0)
    epoch = np.concatenate([batches[i] for i in range(15)])  # 60 of the 62 windows
    assert len(set(epoch)) == 60 and not np.array_equal(epoch, np.arange(60))
    second = np.concatenate([batches[i] for i in range(16, 30)])
    assert not np.array_equal(epoch[:56], second[:56])  # each epoch its own order
    np.testing.assert_array_equal(window_batches(windows, 4, seed=0)[3], batches[3])
    assert not np.array_equal(window_batches(windows, 4, seed=1)[3], batches[3])
    np.testing.assert_array_equal(window_batches(windows, 4, 0, shuffle=False)[1], [4, 5, 6, 7])
    with pytest.raises(ValueError, match="make 3 windows of seq_len 16, fewer than one batch of 4"):
        window_batches(PackedWindows(np.arange(50), 16), 4, seed=0)


def test_local_rows_and_a_restored_position():
    windows = PackedWindows(np.arange(5000) % 251, 8)
    everything = local_batches(windows, 4, 0, np.arange(4), prefetch=2)
    mine = local_batches(windows, 4, 0, np.array([1, 3]), prefetch=2)
    for _ in range(3):
        full, part = next(everything), next(mine)
        np.testing.assert_array_equal(part, full[[1, 3]])  # a process builds only its rows
    state = everything.get_state()
    expected = [next(everything) for _ in range(4)]
    resumed = local_batches(windows, 4, 0, np.arange(4), prefetch=2)
    resumed.set_state(state)
    for batch in expected:
        np.testing.assert_array_equal(next(resumed), batch)
