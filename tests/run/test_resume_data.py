"""A resume continues the same data and a verified checkpoint: changed data-affecting keys are
refused naming them (opt in with run.allow_data_change=true, which says what changes), a
checkpoint of this ferry that lost its checksums is refused, a prepared manifest must agree with
the tokenizer it names, and a run directory whose members are of the wrong kind is refused before
anything in it is touched."""

import io
import json
import shutil

import pytest
from rich.console import Console

from ferry.data.corpus import open_prepared
from ferry.data.prepare import prepare_corpus
from ferry.data.shards import MANIFEST, PreparedDataError
from ferry.data.tokenizer import ByteTokenizer
from ferry.run.data_identity import data_difference
from ferry.run.preflight import prepare
from ferry.run.training import train
from tests.conftest import SMALL_RUN, compose_config
from tests.data.test_prepared_data import DOCUMENTS, text_config
from tests.run.test_bad_inputs import run_cases, tree_digest


def copy_run(finished_run, root, name, damage=None):
    run_dir = root / name
    shutil.copytree(finished_run, run_dir)
    if damage is not None:
        damage(run_dir)
    return run_dir


def replace_with_directory(path):
    path.unlink()
    path.mkdir()


def replace_with_file(path):
    shutil.rmtree(path)
    path.write_text("not a directory\n")


# name: (damage to a copy of the finished run, extra overrides, what the one line must hold)
CASES = {
    "data keys": (
        None,
        ["train.global_batch_size=8", "train.seq_len=64", "data.seed=1"],
        [
            "trained on other data",
            "train.global_batch_size: 4 -> 8",
            "train.seq_len: 32 -> 64",
            "data.seed: 0 -> 1",
            "run.allow_data_change=true",
        ],
    ),
    "synthetic tokens": (None, ["data.synthetic_tokens=30000"], ["data.synthetic_tokens: 20000 -> 30000"]),
    "checksums gone": (
        lambda d: shutil.rmtree(d / "checkpoints" / "4" / "checksums"),
        [],
        ["checkpoint step 4", "saved with checksums, which are gone", "resume from step 2"],
    ),
    "metrics a directory": (
        lambda d: replace_with_directory(d / "metrics.jsonl"),
        [],
        ["metrics.jsonl is a directory, where ferry keeps a file"],
    ),
    "lock a directory": (
        lambda d: replace_with_directory(d / "ferry.lock"),
        [],
        ["ferry.lock is a directory, where ferry keeps a file"],
    ),
    "config a directory": (
        lambda d: replace_with_directory(d / "config.yaml"),
        [],
        ["config.yaml is a directory"],
    ),
    "tensorboard a file": (
        lambda d: (d / "tensorboard").write_text("x"),
        ["log.tensorboard=true"],
        ["tensorboard is a file, where ferry keeps a directory"],
    ),
    "newest step a file": (
        lambda d: replace_with_file(d / "checkpoints" / "4"),
        [],
        ["checkpoint step 4", "is not a directory, so it holds no checkpoint"],
    ),
}


def test_resumes_onto_other_data_or_damaged_run_directories_are_refused_untouched(finished_run, tmp_path):
    """Each case against its own copy of the finished run, all in one launcher process: exit 2,
    one line naming what differs or is wrong, and every byte of the copy as it was (no lock
    rewritten, no metrics.tmp, no config.yaml)."""
    runs, digests, cases = {}, {}, []
    for name, (damage, overrides, _) in CASES.items():
        runs[name] = copy_run(finished_run, tmp_path, name.replace(" ", "_"), damage)
        digests[name] = tree_digest(runs[name])
        cases.append([*SMALL_RUN, "train.steps=6", *overrides, f"run.dir={runs[name]}"])
    for (name, (_, _, wanted)), result in zip(CASES.items(), run_cases(cases), strict=True):
        assert result["code"] == 2, (name, result["stdout"][-2000:], result["stderr"][-2000:])
        assert "Traceback" not in result["stderr"], (name, result["stderr"][-2000:])
        (error,) = [line for line in result["stdout"].splitlines() if line.startswith("error:")]
        for part in wanted:
            assert part in error, (name, error)
        assert tree_digest(runs[name]) == digests[name], name
        assert not (runs[name] / "metrics.tmp").exists()


def test_allow_data_change_resumes_and_says_what_changes(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path, "run")
    out = io.StringIO()
    console = Console(file=out, width=300)
    allow = ("data.seed=1", "run.allow_data_change=true")
    config = compose_config(*SMALL_RUN, "train.steps=6", *allow, f"run.dir={run_dir}")
    train(prepare(config, console), "config: test\n", console)
    output = out.getvalue()
    assert "run.allow_data_change=true: resuming step 4 on other data (data.seed: 0 -> 1)" in output, output
    assert "resuming from step 4" in output
    saved = json.loads((run_dir / "checkpoints" / "6" / "model" / "metadata").read_text())
    assert saved["data"]["data.seed"] == 1  # the new checkpoints record the data they were trained on


def test_data_difference_of_an_earlier_ferrys_checkpoint_is_unknown():
    current = {"train.seq_len": 32, "data.seed": 0}
    assert data_difference(None, current) == []
    assert data_difference({"train.seq_len": 32, "data.seed": 0}, current) == []
    assert data_difference({"train.seq_len": 16, "data.source": "text"}, current) == [
        "train.seq_len: 16 -> 32",
        "data.seed: None -> 0",
        "data.source: text -> None",
    ]


def test_a_manifest_must_agree_with_the_tokenizer_it_names(tmp_path):
    """vocab_size or the end-of-document id edited in manifest.json: refused naming the field,
    before the model's vocabulary is compared with it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(DOCUMENTS) + "\n")
    directory = tmp_path / "prepared"
    prepare_corpus(text_config(corpus), directory, ByteTokenizer())
    open_prepared(directory, ByteTokenizer(), "byte", 256)
    manifest = json.loads((directory / MANIFEST).read_text())
    for field, value in (("vocab_size", 200), ("vocab_size", 100_000), ("end_of_document", 10)):
        edited = {**manifest, "tokenizer": {**manifest["tokenizer"], field: value}}
        (directory / MANIFEST).write_text(json.dumps(edited))
        with pytest.raises(PreparedDataError, match=rf"records tokenizer {field} {value}, but the tokenizer it names"):
            open_prepared(directory, ByteTokenizer(), "byte", 256)
