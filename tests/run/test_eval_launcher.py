"""`launch/eval.py`: a run's checkpoint scored on datasets: the run's own held-out split gives the
eval loss the run logged at that step, every dataset form reads the same data, bits per byte
count the text's bytes, each record is appended to RUN/eval.jsonl, and bad input is one line."""

import io
import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf
from rich.console import Console

from ferry.config.overrides import hydra_compose
from ferry.config.root import load_config
from ferry.data.tokenizer import ByteTokenizer, load_tokenizer
from tests.conftest import CONFIGS, ROOT, SMALL_RUN
from tests.launcher_cases import load_script
from tests.old_default import with_old_default

SCRIPT = ROOT / "launch" / "eval.py"
CHAT_FIXTURE = ROOT / "tests" / "data" / "chat"


def launcher():
    return load_script("eval.py")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """SMALL_RUN (synthetic tokens, checkpoints 2 and 4, eval_batches=1) trained once, with the
    config.yaml the launcher writes."""
    from ferry.run.preflight import prepare
    from ferry.run.training import train

    run_dir = tmp_path_factory.mktemp("eval") / "run"
    node = hydra_compose(CONFIGS, "train", list(with_old_default((*SMALL_RUN, f"run.dir={run_dir}"))))
    console = Console(file=io.StringIO(), width=200)
    config = load_config(OmegaConf.to_container(node, resolve=True))
    return train(prepare(config, console), OmegaConf.to_yaml(node, resolve=True), console)


@pytest.fixture
def run_copy(small_run, tmp_path):
    """The small run, copied: evaluating appends to its eval.jsonl."""
    copy = tmp_path / "run"
    shutil.copytree(small_run, copy)
    return copy


def logged_eval_loss(run_dir, step: int) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["eval_loss"] for r in records if r.get("step") == step and "eval_loss" in r)


def test_the_runs_own_held_out_split_gives_its_logged_eval_loss(run_copy, capsys):
    (record,) = launcher().evaluate(run_copy, ["run"], batches=1)
    assert record["step"] == 4 and record["split"] == "held-out" and record["tokens"] == 4 * 32
    assert record["loss"] == pytest.approx(logged_eval_loss(run_copy, 4), rel=1e-6)
    assert record["perplexity"] == pytest.approx(math.exp(record["loss"]))
    assert record["bytes"] == record["tokens"]  # the byte tokenizer: a byte a token
    assert record["bits_per_byte"] == pytest.approx(record["loss"] / math.log(2))
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("step 4 run (held-out, 1 batches, 128 tokens): loss ")
    (earlier,) = launcher().evaluate(run_copy, ["run"], step=2, batches=1)
    assert earlier["step"] == 2 and earlier["loss"] != record["loss"]
    logged = [json.loads(line) for line in (run_copy / "eval.jsonl").read_text().splitlines()]
    assert logged == [record, earlier]


def test_every_form_of_a_text_dataset_reads_the_same_data(run_copy, tmp_path, monkeypatch):
    """A directory of text files named as text:DIR and as a bare DIR, and a JSONL file of the same
    documents, score alike; a byte run's bits per byte are its loss in bits."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    texts = tmp_path / "texts"
    texts.mkdir()
    documents = [(f"doc{n}.txt", f"The quick brown fox {n} jumps over the lazy dog. " * 12) for n in range(60)]
    for name, text in documents:
        (texts / name).write_text(text)
    records = launcher().evaluate(run_copy, [f"text:{texts}", str(texts)], split="train", batches=2)
    assert records[0]["loss"] == records[1]["loss"] and records[0]["tokens"] == 2 * 4 * 32
    assert records[0]["loss"] != pytest.approx(logged_eval_loss(run_copy, 4), rel=1e-3)
    assert [r["dataset"] for r in records] == [f"text:{texts}", str(texts)]


def test_bits_per_byte_count_the_decoded_texts_bytes():
    """A Hugging Face tokenizer's counted tokens are decoded run by run: their bytes are the
    text's (non-ASCII too), each end-of-document id one byte; uncounted tokens add none."""
    eval_launcher = launcher()
    tokenizer = load_tokenizer(str(CHAT_FIXTURE))
    texts = ["What is 3 plus 4? 7.", "héllo wörld ∑", "12 times 3 is 36."]
    pieces = tokenizer.encode_documents([t.encode() for t in texts])
    targets = np.concatenate(pieces)
    everything = np.ones(len(targets), bool)
    expected = sum(len(t.encode()) + 1 for t in texts)
    assert eval_launcher.text_bytes(tokenizer, targets, everything) == expected
    first_only = np.zeros(len(targets), bool)
    first_only[: len(pieces[0]) - 1] = True  # the first text, not its end-of-document id
    assert eval_launcher.text_bytes(tokenizer, targets, first_only) == len(texts[0].encode())
    assert eval_launcher.text_bytes(ByteTokenizer(), targets, first_only) == len(pieces[0]) - 1


def refusal(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and not done.stdout
    return line


def test_bad_input_is_one_line(run_copy, tmp_path):
    assert "does not exist; name a dataset as run, stdlib, SOURCE:PATH" in refusal(str(run_copy), str(tmp_path / "no"))
    assert "has no checkpoint of step 3; its checkpoints are steps [2, 4]" in refusal(
        str(run_copy), "run", "--step", "3"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no source read off it" in refusal(str(run_copy), "run", str(empty))
    assert "is not a directory; pass a run directory" in refusal(str(tmp_path / "nowhere"), "run")
    assert not (run_copy / "eval.jsonl").exists()  # nothing scored before every dataset was read
