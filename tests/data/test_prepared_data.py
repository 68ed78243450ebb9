"""Prepared data: token shards written once (a process pool, resumable, idempotent), read by random
access, checked against tokenizer and model, the raw-source cache, one large text file as a corpus,
and an exact data position across a change of process count."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

import ferry.data.prepare as prepare_module
from ferry.data.config import DataConfig
from ferry.data.corpus import load_corpus, open_prepared
from ferry.data.pipeline import PackedWindows, local_batches
from ferry.data.prepare import cache_directory, prepare_corpus
from ferry.data.shards import MANIFEST, PreparedDataError, ShardedTokens, read_manifest
from ferry.data.sources import DataSourceError, TextSplit, documents
from ferry.data.tokenizer import ByteTokenizer, load_tokenizer
from ferry.run.preemption import SigtermStop
from ferry.run.preflight import prepare
from ferry.run.training import train
from tests.conftest import ROOT, compose_config

# 300 documents of 40 to 240 bytes, in one file, separated by blank lines
DOCUMENTS = [f"doc {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 8) for i in range(300)]


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def big_text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(DOCUMENTS) + "\n")
    return path


def text_config(path, **overrides):
    keys = {"source": "text", "path": str(path), "separator": "\\n\\n", "shard_bytes": 4000, "eval_fraction": 0.1}
    keys["workers"] = 1  # no processes to start, except where a test says
    return DataConfig(**{**keys, **overrides})


def split_documents(tokens):
    """The documents of a byte-token stream (each ends with id 0)."""
    return [bytes(d).decode() for d in bytes(np.asarray(tokens)).split(b"\0")[:-1]]


def test_one_large_text_file_splits_by_separator_or_size(big_text, tmp_path):
    texts = [text.decode() for _, text in documents("text", str(big_text), "text", split=TextSplit.of("\\n\\n", None))]
    assert texts == DOCUMENTS[:-1] + [DOCUMENTS[-1] + "\n"]
    keys = [key for key, _ in documents("text", str(big_text), "text", split=TextSplit.of("\\n\\n", None))]
    assert keys[:2] == ["corpus.txt#0", "corpus.txt#1"] and len(set(keys)) == 300

    text = ("é" * 1500 + "\n") * 4 + "ü" * 5000  # 2-byte characters; newlines every 3,001 bytes
    (tmp_path / "one.txt").write_text(text)
    pieces = [t for _, t in documents("text", str(tmp_path / "one.txt"), "text", split=TextSplit(None, 4000))]
    assert b"".join(pieces).decode() == text  # nothing lost, every piece whole UTF-8
    assert all(len(p) <= 4000 for p in pieces) and len(pieces) >= 6
    assert all(p.endswith(b"\n") for p in pieces[:4])  # cut after a newline in the piece's second half

    with pytest.raises(ValueError, match="data.separator or data.document_bytes, not both"):
        DataConfig(source="text", separator="x", document_bytes=10)
    with pytest.raises(ValueError, match="split text files; data.source is jsonl"):
        DataConfig(source="jsonl", separator="\\n")


def test_a_single_text_file_without_a_separator_is_refused_with_the_fix(big_text):
    with pytest.raises(
        ValueError, match="held-out split of 1 documents empty.*unless data.separator or data.document_bytes"
    ):
        load_corpus(DataConfig(source="text", path=str(big_text)), ByteTokenizer(), 256)


def test_prepare_with_two_processes_equals_one_and_a_rerun_does_nothing(big_text, tmp_path):
    pooled = prepare_corpus(text_config(big_text, workers=2), tmp_path / "pooled", ByteTokenizer())
    alone = prepare_corpus(text_config(big_text, workers=1), tmp_path / "alone", ByteTokenizer())
    manifest = pooled.manifest
    assert pooled.units_written == len({s.unit for s in manifest.shards["train"] + manifest.shards["eval"]}) > 4
    assert manifest.documents("train") + manifest.documents("eval") == 300
    for split in ("train", "eval"):
        tokens = ShardedTokens.of(tmp_path / "pooled", manifest, split)
        np.testing.assert_array_equal(
            np.asarray(tokens), np.asarray(ShardedTokens.of(tmp_path / "alone", alone.manifest, split))
        )
    train = split_documents(ShardedTokens.of(tmp_path / "pooled", manifest, "train"))
    held_out = split_documents(ShardedTokens.of(tmp_path / "pooled", manifest, "eval"))
    assert sorted(train + held_out) == sorted(DOCUMENTS[:-1] + [DOCUMENTS[-1] + "\n"]) and held_out
    assert train == [d for d in DOCUMENTS[:-1] + [DOCUMENTS[-1] + "\n"] if d in train]  # the source's order

    on_disk = json.loads((tmp_path / "pooled" / MANIFEST).read_text())
    assert on_disk["tokenizer"] == {"spec": "byte", "identity": "byte", "vocab_size": 256, "end_of_document": 0}
    assert on_disk["documents"]["train"] == len(train) and on_disk["source"]["separator"] == "\\n\\n"
    assert on_disk["source"]["files"] == 1 and len(on_disk["source_hash"]) == 64
    assert not (tmp_path / "pooled" / ".progress").exists()

    again = prepare_corpus(text_config(big_text, workers=2), tmp_path / "pooled", ByteTokenizer())
    assert again.units_written == 0 and again.manifest == manifest


def test_an_interrupted_preparation_resumes_from_the_shards_written(big_text, tmp_path, monkeypatch):
    clean = prepare_corpus(text_config(big_text, workers=1), tmp_path / "clean", ByteTokenizer())
    units = len({s.unit for s in clean.manifest.shards["train"]})
    real, calls = prepare_module.tokenize_unit, []

    def interrupted_at_unit_3(task):
        calls.append(task.unit)
        if task.unit == 3:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(prepare_module, "tokenize_unit", interrupted_at_unit_3)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(text_config(big_text, workers=1), tmp_path / "resumed", ByteTokenizer())
    assert not (tmp_path / "resumed" / MANIFEST).exists() and (tmp_path / "resumed" / ".progress").is_dir()
    with pytest.raises(
        PreparedDataError, match="preparation has not finished; run python launch/prepare_data.py again"
    ):
        open_prepared(tmp_path / "resumed", ByteTokenizer(), "byte", 256)

    calls.clear()
    monkeypatch.setattr(prepare_module, "tokenize_unit", lambda task: calls.append(task.unit) or real(task))
    resumed = prepare_corpus(text_config(big_text, workers=1), tmp_path / "resumed", ByteTokenizer())
    assert calls == list(range(3, units)) and resumed.units_written == units - 3
    assert resumed.manifest == clean.manifest
    with pytest.raises(PreparedDataError, match="holds a corpus prepared from other data.\\* keys"):
        prepare_corpus(text_config(big_text, eval_fraction=0.2), tmp_path / "resumed", ByteTokenizer())


def test_damaged_prepared_directories_are_refused_naming_the_file_and_fix(big_text, tmp_path, hf_tokenizer_file):
    directory = tmp_path / "prepared"
    prepare_corpus(text_config(big_text), directory, ByteTokenizer())
    open_prepared(directory, ByteTokenizer(), "byte", 256)

    with pytest.raises(PreparedDataError, match="tokenized with data.tokenizer=byte .* pass data.tokenizer=byte"):
        open_prepared(directory, load_tokenizer(str(hf_tokenizer_file)), str(hf_tokenizer_file), 300)
    with pytest.raises(PreparedDataError, match="a 256-id vocabulary but model llama_x has vocab_size 200"):
        open_prepared(directory, ByteTokenizer(), "byte", 200, "llama_x")

    shard = directory / "train" / "000002.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(PreparedDataError, match=r"000002.bin holds [\d,]+ bytes, the manifest says .* data.prepared="):
        open_prepared(directory, ByteTokenizer(), "byte", 256)
    (directory / "eval" / sorted(os.listdir(directory / "eval"))[0]).unlink()
    with pytest.raises(
        PreparedDataError, match=r"000002.bin holds .* \(and 1 more\): the shards do not match .*manifest.json"
    ):
        open_prepared(directory, ByteTokenizer(), "byte", 256)
    repaired = prepare_corpus(text_config(big_text), directory, ByteTokenizer())
    assert repaired.units_written == 2  # only the units of the two damaged shards
    open_prepared(directory, ByteTokenizer(), "byte", 256)

    manifest = json.loads((directory / MANIFEST).read_text())
    (directory / MANIFEST).write_text(json.dumps({**manifest, "format": 2}))
    with pytest.raises(PreparedDataError, match="format 2, written by a newer ferry .* upgrade ferry"):
        read_manifest(directory)
    (directory / MANIFEST).write_text("{\n  broken")
    with pytest.raises(PreparedDataError, match="manifest.json:2 is not JSON"):
        read_manifest(directory)
    with pytest.raises(PreparedDataError, match="has no manifest.json: it is not a prepared corpus"):
        open_prepared(tmp_path, ByteTokenizer(), "byte", 256)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(PreparedDataError, match="holds files that are not a prepared corpus \\(todo.txt\\)"):
        prepare_corpus(text_config(big_text), tmp_path / "notes", ByteTokenizer())
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_a_raw_source_is_tokenized_once_into_its_cache(big_text, tmp_path, monkeypatch):
    config = text_config(big_text)
    first = load_corpus(config, ByteTokenizer(), 256)
    assert "tokenized into" in first.description
    monkeypatch.setattr(prepare_module, "tokenize_unit", lambda task: pytest.fail("tokenized again"))
    second = load_corpus(config, ByteTokenizer(), 256)
    assert "cached in" in second.description
    np.testing.assert_array_equal(np.asarray(first.train), np.asarray(second.train))
    before = cache_directory(config, ByteTokenizer())
    big_text.write_text(big_text.read_text() + "\n\none more document\n")
    assert cache_directory(config, ByteTokenizer()) != before  # a changed file is another source


def test_sharded_tokens_read_windows_across_shard_boundaries(tmp_path):
    sizes = [7, 1, 12, 5]
    whole = np.arange(sum(sizes), dtype=np.uint16)
    paths = []
    for index, (start, size) in enumerate(zip(np.cumsum([0, *sizes[:-1]]), sizes, strict=True)):
        paths.append(tmp_path / f"{index}.bin")
        whole[start : start + size].tofile(paths[-1])
    tokens = ShardedTokens(paths, sizes, np.dtype(np.uint16))
    assert len(tokens) == 25
    for start in range(25):
        for stop in range(start, 26):
            np.testing.assert_array_equal(tokens[start:stop], whole[start:stop])
    windows = PackedWindows(tokens, 4)
    np.testing.assert_array_equal(windows.rows(np.array([1, 4])), PackedWindows(whole, 4).rows(np.array([1, 4])))


def test_resume_on_prepared_data_is_exact_across_a_change_of_process_count(big_text, tmp_path):
    directory = tmp_path / "prepared"
    prepare_corpus(text_config(big_text), directory, ByteTokenizer())
    corpus = load_corpus(DataConfig(prepared=str(directory)), ByteTokenizer(), 256)
    windows = PackedWindows(corpus.train, 16)
    one_process = local_batches(windows, 8, 0, np.arange(8), prefetch=2)
    for _ in range(5):
        next(one_process)
    state = one_process.get_state()
    expected = [next(one_process) for _ in range(6)]  # crosses an epoch (38 windows: 4 batches each)
    processes = [local_batches(windows, 8, 0, rows, prefetch=2) for rows in (np.arange(4), np.arange(4, 8))]
    for iterator in processes:
        iterator.set_state(json.loads(json.dumps(state)))  # as a checkpoint stores it
    for batch in expected:
        np.testing.assert_array_equal(np.concatenate([next(iterator) for iterator in processes]), batch)


def test_prepare_data_command(big_text, tmp_path):
    directory = tmp_path / "prepared"
    command = [
        sys.executable,
        str(ROOT / "launch" / "prepare_data.py"),
        f"data.prepared={directory}",
        "data.source=text",
        f"data.path={big_text}",
        "data.separator=\\n\\n",
        "data.shard_bytes=4000",
        "data.workers=1",
    ]
    env = {**os.environ, "COLUMNS": "200"}
    first = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "tokens/s" in first.stdout and f"into {directory}" in first.stdout
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    missing = subprocess.run(command[:2] + ["data.source=text"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert missing.returncode == 2 and "data.prepared=DIR" in missing.stdout and "Traceback" not in missing.stderr


def test_hugging_face_saved_dataset_source(tmp_path):
    """The layout `datasets`' save_to_disk writes: state.json naming Arrow stream files, and for a
    DatasetDict a dataset_dict.json naming one such directory per split."""
    import pyarrow as pa

    def save(directory, texts, files=2):
        directory.mkdir(parents=True)
        names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
        for i, name in enumerate(names):
            table = pa.table({"content": texts[i::files], "id": list(range(len(texts[i::files])))})
            with pa.ipc.new_stream(directory / name, table.schema) as writer:
                writer.write_table(table, max_chunksize=3)
        state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None}
        (directory / "state.json").write_text(json.dumps(state))

    save(tmp_path / "dict" / "train", DOCUMENTS[:200])
    save(tmp_path / "dict" / "test", DOCUMENTS[200:], files=1)
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    corpus = load_corpus(
        DataConfig(source="hf_dataset", path=str(tmp_path / "dict"), field="content"), ByteTokenizer(), 256
    )
    assert sorted(split_documents(corpus.train) + split_documents(corpus.eval)) == sorted(DOCUMENTS)
    with pytest.raises(DataSourceError, match=r"no column 'text' \(columns: content, id\); set data.field"):
        load_corpus(DataConfig(source="hf_dataset", path=str(tmp_path / "dict")), ByteTokenizer(), 256)
    with pytest.raises(DataSourceError, match="holds neither state.json nor dataset_dict.json"):
        load_corpus(DataConfig(source="hf_dataset", path=str(tmp_path)), ByteTokenizer(), 256)


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory):
    """A small byte-level BPE tokenizer.json, trained here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(DOCUMENTS, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_training_on_prepared_documents_resumes_bit_for_bit(big_text, tmp_path, monkeypatch):
    """A run on a prepared corpus with document masking, preempted after step 2 and resumed,
    logs the losses of the uninterrupted run exactly."""
    directory = tmp_path / "prepared"
    prepare_corpus(text_config(big_text), directory, ByteTokenizer())
    common = (
        f"data.prepared={directory}",
        "data.document_mask=true",
        "data.loss_across_documents=false",
        "train.steps=4",
        "train.warmup_steps=1",
        "train.log_every=1",
        "train.eval_batches=0",
        "train.global_batch_size=4",
        "train.seq_len=32",
        "checkpoint.every=0",
        "log.tensorboard=false",
    )

    def run(run_dir):
        out = io.StringIO()
        console = Console(file=out, width=200)
        train(prepare(compose_config(*common, f"run.dir={run_dir}"), console), "config: test\n", console)
        return out.getvalue()

    def losses(run_dir):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    output = run(tmp_path / "whole")
    assert f"300 text documents prepared in {directory}" in " ".join(output.split())
    with monkeypatch.context() as preempted:
        preempted.setattr(SigtermStop, "requested", lambda self, step: step == 2)
        run(tmp_path / "resumed")
    assert [step for step, _ in losses(tmp_path / "resumed")] == [1, 2]
    assert "resuming from step 2" in run(tmp_path / "resumed")
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")  # floats from JSON: bitwise
