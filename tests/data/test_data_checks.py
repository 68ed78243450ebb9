"""Data that would train on the wrong thing is refused (issue 64): a manifest whose `dtype` reads
other ids than were written, shards that do not match their manifest, files that are not text, and
token ids outside the model's vocabulary."""

import json
import re

import numpy as np
import pytest

from ferry.data.config import DataConfig
from ferry.data.corpus import open_prepared
from ferry.data.prepare import prepare_corpus
from ferry.data.shards import MANIFEST, PreparedDataError, read_manifest
from ferry.data.tokenizer import ByteTokenizer

DOCUMENTS = [f"doc {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 8) for i in range(300)]


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def text_config(path, **overrides):
    keys = {"source": "text", "path": str(path), "separator": "\\n\\n", "shard_bytes": 4000, "eval_fraction": 0.1}
    return DataConfig(**{**keys, "workers": 1, **overrides})


@pytest.fixture
def prepared(tmp_path):
    """A corpus prepared with the byte tokenizer (uint8 shards)."""
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(DOCUMENTS) + "\n")
    directory = tmp_path / "prepared"
    prepare_corpus(text_config(text), directory, ByteTokenizer())
    return directory


def edit_manifest(directory, **keys):
    manifest = json.loads((directory / MANIFEST).read_text())
    (directory / MANIFEST).write_text(json.dumps({**manifest, **keys}))


@pytest.mark.parametrize(
    "dtype, problem",
    [
        ("int8", '"dtype": "int8" is signed: ids in the top half of its range would be read as negative ones'),
        ("banana", '"dtype": "banana" is not a numpy integer type'),
        ("float32", '"dtype": "float32" is not an unsigned integer type'),
        (None, '"dtype": null is not an unsigned integer type'),
        (">u2", '"dtype": ">u2" is big-endian'),
    ],
)
def test_a_manifest_dtype_that_reads_other_ids_is_refused_naming_the_key_and_fix(prepared, dtype, problem):
    edit_manifest(prepared, dtype=dtype)
    with pytest.raises(PreparedDataError) as refused:
        open_prepared(prepared, ByteTokenizer(), "byte", 256)
    message = str(refused.value)
    assert message.startswith(f"{prepared / MANIFEST}: {problem}"), message
    assert 'set "dtype" to "uint8" if the shards were written by prepare_data' in message
    assert "\n" not in message
    with pytest.raises(PreparedDataError, match=re.escape(problem)):
        prepare_corpus(text_config(prepared.parent / "corpus.txt"), prepared, ByteTokenizer())  # nor resumed over


def test_a_dtype_too_narrow_for_the_vocabulary_is_refused(prepared):
    """Once the manifest's vocabulary is the tokenizer's (an edited vocab_size is refused as such
    first), its dtype must hold every id of it."""
    from ferry.data.shards import check_dtype_width

    tokenizer = json.loads((prepared / MANIFEST).read_text())["tokenizer"]
    edit_manifest(prepared, tokenizer={**tokenizer, "vocab_size": 300})
    with pytest.raises(PreparedDataError, match="records tokenizer vocab_size 300, but the tokenizer it names"):
        open_prepared(prepared, ByteTokenizer(), "byte", 1000)
    manifest = read_manifest(prepared)
    with pytest.raises(
        PreparedDataError,
        match=f'{prepared / MANIFEST}: "dtype": "uint8" holds ids up to 255, but the vocabulary has 300 ids; '
        'set "dtype" to "uint16"',
    ):
        check_dtype_width(prepared / MANIFEST, manifest)


def test_a_wider_unsigned_dtype_is_read_as_written(prepared):
    """Any unsigned type that holds the vocabulary reads: the shards' sizes then say whether it is
    the one they were written in."""
    for shard in sorted(prepared.glob("*/*.bin")):
        shard.write_bytes(np.fromfile(shard, np.uint8).astype("<u2").tobytes())
    edit_manifest(prepared, dtype="uint16")
    open_prepared(prepared, ByteTokenizer(), "byte", 256)
    edit_manifest(prepared, dtype="uint32")
    with pytest.raises(PreparedDataError, match=r"holds [\d,]+ bytes, the manifest says [\d,]+ \(cut short\)"):
        open_prepared(prepared, ByteTokenizer(), "byte", 256)


def test_a_shard_cut_short_or_grown_is_refused_naming_it(prepared):
    shard = prepared / "train" / "000001.bin"
    whole = shard.read_bytes()
    shard.write_bytes(whole + b"\1\2\3")
    with pytest.raises(
        PreparedDataError,
        match=rf"{shard} holds {len(whole) + 3:,} bytes, the manifest says {len(whole):,} \(grown\): the shards do "
        rf"not match {prepared / MANIFEST}\. Run python launch/prepare_data.py data.prepared={prepared}",
    ):
        open_prepared(prepared, ByteTokenizer(), "byte", 256)
    shard.write_bytes(whole[:-1])
    with pytest.raises(PreparedDataError, match=rf"{shard} holds [\d,]+ bytes, the manifest says [\d,]+ \(cut short\)"):
        open_prepared(prepared, ByteTokenizer(), "byte", 256)


# --- files that are not text -------------------------------------------------------------------


def test_text_is_told_from_binary_by_its_unreadable_bytes(tmp_path):
    from ferry.data.text_check import NOT_TEXT_FRACTION, SNIFF_BYTES, is_text, unreadable_bytes

    text = "naïve café, 東京: the quick brown fox\n".encode() * 1000
    assert unreadable_bytes(text, whole=True) == 0
    cut = text + "東京".encode()[:-1]
    assert unreadable_bytes(cut, whole=False) == 0  # a character cut by the end of what was read
    assert unreadable_bytes(cut, whole=True) == 2  # ... or by the end of the file
    assert unreadable_bytes(b"a\0b\xffc", whole=True) == 2
    samples = {
        "utf-8.txt": (text, True),
        "a stray latin-1 byte.txt": (text + "Zoë\n".encode("latin-1"), True),
        "latin-1 throughout.txt": ("déjà vu, où êtes-vous? ".encode("latin-1") * 500, False),
        "utf-16.txt": ("the quick brown fox\n".encode("utf-16") * 100, False),
        "random.bin": (np.random.default_rng(0).integers(0, 256, 100_000, np.uint8).tobytes(), False),
        "empty.txt": (b"", True),
        # judged on its first MiB: what follows costs a character where it is read
        "binary after the first MiB.txt": (b"x" * SNIFF_BYTES + bytes(range(256)) * 100, True),
    }
    for name, (data, text_like) in samples.items():
        (tmp_path / name).write_bytes(data)
        assert is_text(tmp_path / name) == text_like, name
    assert NOT_TEXT_FRACTION == 0.01


def test_files_that_are_not_text_are_skipped_with_one_line_or_refused_when_none_is_left(tmp_path):
    import io

    from rich.console import Console

    from ferry.data.corpus import load_corpus
    from ferry.data.sources import DataSourceError

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number, text in enumerate(DOCUMENTS[:40]):
        (corpus / f"{number:02d}.txt").write_text(text)
    (corpus / "program.txt").write_bytes(bytes(range(256)) * 64)
    (corpus / "wide.txt").write_text("the quick brown fox\n" * 50, encoding="utf-16")
    config = DataConfig(source="text", path=str(corpus), eval_fraction=0.2)
    for start in ("tokenized", "cached"):
        out = io.StringIO()
        loaded = load_corpus(config, ByteTokenizer(), 256, Console(file=out, width=100, soft_wrap=True))
        notes = [line for line in out.getvalue().splitlines() if line.startswith("note:")]
        assert notes == [
            f"note: skipped 2 of the 42 files in data.path={corpus} that are not text (NUL bytes or invalid UTF-8 in "
            "over 1% of the first MiB): program.txt, wide.txt"
        ], (start, out.getvalue())
        assert loaded.num_documents == 40
    read = b"".join(np.asarray(split).tobytes() for split in (loaded.train, loaded.eval))
    assert b"fox" not in read and bytes(range(1, 256)) not in read

    binary = tmp_path / "binary"
    binary.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (binary / name).write_bytes(bytes(range(256)) * 8)
    with pytest.raises(
        DataSourceError,
        match=rf"data.source=jsonl: none of the 2 files in data.path={binary} is text \(a.jsonl, b.jsonl\): NUL bytes",
    ):
        load_corpus(DataConfig(source="jsonl", path=str(binary)), ByteTokenizer(), 256)
    with pytest.raises(DataSourceError, match=rf"data.source=text: {corpus / 'program.txt'} is not text: NUL bytes"):
        load_corpus(DataConfig(source="text", path=str(corpus / "program.txt")), ByteTokenizer(), 256)
