"""Run directories for the launchers that read a trained run (`launch/sample.py`,
`launch/export_hf.py`): the session's finished run with the config.yaml `launch/run.py` writes,
optionally naming a tokenizer.json; and a small BPE tokenizer.json, trained here."""

import shutil
from pathlib import Path

from omegaconf import OmegaConf

from ferry.config.overrides import compose_node
from tests.conftest import CONFIGS, SMALL_RUN

TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1) for i in range(40)]


def run_copy(finished_run: Path, run_dir: Path, *overrides: str) -> Path:
    """A copy of the finished run (checkpoints at steps 2 and 4) with the config.yaml the launcher
    writes for SMALL_RUN and `overrides` (the fixture's run was started in-process, without one)."""
    shutil.copytree(finished_run, run_dir)
    node = compose_node("train", [*SMALL_RUN, f"run.dir={run_dir}", *overrides], CONFIGS)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(node))
    return run_dir


def bpe_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer.json of 200 ids (fewer than llama_tiny's 256, so the finished
    run's model can read its ids), `<|endoftext|>` (id 0) ending a document."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>"]))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def trained_run_of(finished_run: Path, tmp_path_factory) -> Path:
    """A test module's copy of the finished run, with its config.yaml (byte-level tokenizer)."""
    return run_copy(finished_run, tmp_path_factory.mktemp("trained") / "run")


def tokenizer_run_of(finished_run: Path, tmp_path_factory) -> Path:
    """The finished run, its config naming a BPE tokenizer.json of 200 ids (the model reads 256)."""
    tokenizer = bpe_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return run_copy(finished_run, tmp_path_factory.mktemp("trained_bpe") / "run", f"data.tokenizer={tokenizer}")
