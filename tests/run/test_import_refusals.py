"""Refusals found once something was made: an `init.from_hf` checkpoint that is malformed (a
config.json that is no object, a value of the wrong kind in it, a weight that is not finite,
found after the run directory was claimed and the step compiled) and a `prepare_data.py` into a
directory of the user's own files leave nothing behind, neither the run directory and the parents
made for it nor a lock file. A sequence beyond the checkpoint's positions is noted."""

import io
import json
from pathlib import Path

import jax
import pytest
from rich.console import Console
from safetensors.numpy import load_file, save_file

from ferry.hf import save_pretrained
from ferry.models.registry import build_model
from ferry.run.preflight import prepare
from tests.conftest import SMALL_RUN, compose_config, load_model_config
from tests.launcher_cases import load_script
from tests.run.test_bad_inputs import assert_refused, run_cases


def hf_checkpoint(directory: Path, **changes) -> Path:
    """llama_tiny as a Hugging Face checkpoint in `directory`, its config.json's keys changed
    (`config_json` replaces the whole file)."""
    save_pretrained(build_model(load_model_config("llama_tiny"), jax.random.key(0)), directory)
    config = json.loads((directory / "config.json").read_text())
    whole = changes.pop("config_json", None)
    (directory / "config.json").write_text(json.dumps(whole if whole is not None else config | changes))
    return directory


def from_hf_cases(root: Path) -> dict[str, list[str]]:
    """init.from_hf at malformed checkpoints (a config.json that is a list, a rope_scaling that
    is, a weight that is not finite), each run.dir new and two levels below `root`."""
    inf = hf_checkpoint(root / "hf_inf")
    tensors = load_file(inf / "model.safetensors")
    tensors["lm_head.weight"][0, 0] = float("inf")
    save_file(tensors, str(inf / "model.safetensors"))
    checkpoints = {
        "from_hf a list": hf_checkpoint(root / "hf_list", config_json=[1, 2]),
        "from_hf rope a list": hf_checkpoint(root / "hf_rope", rope_scaling=[1, 2]),
        "from_hf inf": inf,
    }
    return {
        name: [f"init.from_hf={path}", f"run.dir={root / path.name / 'new' / 'run'}"]
        for name, path in checkpoints.items()
    }


@pytest.fixture(scope="module")
def from_hf_refusals(tmp_path_factory):
    """The from_hf cases through the launcher, in one process; their root."""
    root = tmp_path_factory.mktemp("from_hf")
    cases = from_hf_cases(root)
    results = run_cases([[*SMALL_RUN, *overrides] for overrides in cases.values()])
    return dict(zip(cases, results, strict=True)), root


def test_a_malformed_hugging_face_checkpoint_is_refused_leaving_nothing_behind(from_hf_refusals):
    """A config.json that is no object, a value of the wrong kind in it, a weight that is not
    finite (found once the run directory was claimed and the step compiled): one line each, and
    neither the run directory nor the parent made for it stays behind."""
    by_dir, root = from_hf_refusals
    assert_refused(by_dir["from_hf a list"], f"{root / 'hf_list' / 'config.json'} holds a JSON array, not an object")
    assert_refused(by_dir["from_hf rope a list"], "has a value ferry cannot read as a Llama config")
    assert_refused(by_dir["from_hf inf"], "tensor lm_head.weight holds 1 non-finite value")
    for name in ("hf_list", "hf_rope", "hf_inf"):
        assert sorted(p.name for p in (root / name).iterdir()) == ["config.json", "model.safetensors"], name


def test_a_sequence_longer_than_the_checkpoints_positions_is_noted(tmp_path):
    checkpoint = hf_checkpoint(tmp_path / "hf", max_position_embeddings=16)
    console = Console(file=io.StringIO(), width=400)
    config = compose_config(*SMALL_RUN, f"init.from_hf={checkpoint}", f"run.dir={tmp_path / 'run'}")
    prepare(config, console).release()
    assert f"note: train.seq_len=32 is longer than init.from_hf={checkpoint}'s max_position_embeddings=16" in (
        console.file.getvalue()
    )


def test_a_refused_prepare_leaves_the_users_directory_as_it_was(tmp_path, capsys):
    """data.prepared at a directory of the user's own files is refused, and the lock file the
    preparation took there goes with the refusal."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text\n" * 20)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    argv = ["data.source=text", f"data.path={tmp_path / 'corpus'}", f"data.prepared={tmp_path / 'mine'}"]
    assert load_script("prepare_data.py").main(argv) == 2
    assert "holds files that are not a prepared corpus (notes.txt)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
