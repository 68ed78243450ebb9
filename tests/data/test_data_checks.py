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
