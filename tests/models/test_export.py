"""`launch/export_hf.py`: a trained run's checkpoint becomes a Hugging Face checkpoint whose
parameters ferry's own reader (what `init.from_hf` uses) loads bit for bit, with the run's
tokenizer (`AutoTokenizer` reads text to the run's ids) and generation_config.json, every file
in the mode an ordinary file gets; `transformers` generates from it what `launch/sample.py` does;
bad input is one line, exit status 2, and nothing written."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from omegaconf import OmegaConf

from ferry.data.tokenizer import ByteTokenizer, load_tokenizer
from ferry.hf import load_pretrained
from ferry.hf.safetensors_io import ShardedWriter
from ferry.run.checkpoint import Checkpoints
from ferry.sharding import MeshConfig, make_mesh
from ferry.train.state_layout import run_state_layout
from tests.conftest import ROOT, SMALL_RUN, compose_config
from tests.generate.saved_runs import TEXTS
from tests.generate.test_sample_launcher import sample_module
from tests.launcher_cases import load_script

SCRIPT = ROOT / "launch" / "export_hf.py"


def export_module():
    return load_script("export_hf.py")


def checkpoint_params(run_dir, step):
    """The model's parameters of checkpoint `step`, restored as a resume restores them."""
    config = compose_config(*SMALL_RUN, f"run.dir={run_dir}")
    layout = run_state_layout(config, make_mesh(MeshConfig()))
    checkpoints = Checkpoints(run_dir / "checkpoints", config.checkpoint)
    arrays, _ = checkpoints.restore(step, layout.abstract())
    checkpoints.manager.close()
    return jax.tree.leaves(layout.assemble(arrays).model)


def assert_bitwise_equal(left, right):
    assert len(left) == len(right) > 0
    for a, b in zip(left, right, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_export_latest_checkpoint_loads_bit_for_bit(trained_run, tmp_path):
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(trained_run), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    exported = jax.tree.leaves(load_pretrained(out))
    assert_bitwise_equal(exported, checkpoint_params(trained_run, 4))
    assert not all(np.array_equal(a, b) for a, b in zip(exported, checkpoint_params(trained_run, 2), strict=True))


def test_export_a_given_step(trained_run, tmp_path):
    module = export_module()
    out = tmp_path / "step2"
    out.mkdir()  # an empty directory is accepted
    module.export(trained_run, out, step=2)
    assert_bitwise_equal(jax.tree.leaves(load_pretrained(out)), checkpoint_params(trained_run, 2))


def bad_inputs(trained_run, tmp_path):
    (tmp_path / "a_file").write_text("x")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine\n")
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    shutil.copy(trained_run / "config.yaml", empty_run / "config.yaml")
    broken = {}
    for name, text in {"unparsed": "model: [1, 2\n", "a_number": "5\n", "unresolved": "a: ${nope}\n"}.items():
        broken[name] = tmp_path / f"run_{name}"
        shutil.copytree(trained_run, broken[name])
        (broken[name] / "config.yaml").write_text(text)
    lost_tokenizer = tmp_path / "lost_tokenizer"
    shutil.copytree(trained_run, lost_tokenizer)
    text = (trained_run / "config.yaml").read_text().replace("tokenizer: byte", f"tokenizer: {tmp_path}/gone.json")
    (lost_tokenizer / "config.yaml").write_text(text)
    unwritable = [([str(trained_run), f"/proc/ferry-{os.getpid()}/out"], "cannot be made")]
    return [
        *(unwritable if Path("/proc/self").is_dir() else []),
        ([str(trained_run), str(tmp_path / ("o" * 300))], "is longer than the file system allows"),
        ([str(trained_run), str(tmp_path / "a_file" / "out")], "a part of its path is a file"),
        ([str(broken["unparsed"]), str(tmp_path / "out6")], "config.yaml is not valid YAML (expected ',' or ']'"),
        ([str(broken["a_number"]), str(tmp_path / "out7")], "config.yaml holds no run config"),
        ([str(broken["unresolved"]), str(tmp_path / "out8")], "config.yaml holds no run config (Interpolation key"),
        ([str(tmp_path / "missing"), str(tmp_path / "out1")], "is not a directory"),
        ([str(tmp_path), str(tmp_path / "out2")], "has no config.yaml"),
        ([str(empty_run), str(tmp_path / "out3")], "holds no checkpoint"),
        ([str(trained_run), str(tmp_path / "out4"), "--step", "3"], "no checkpoint of step 3"),
        ([str(trained_run), str(occupied)], "not an empty directory"),
        ([str(trained_run), str(tmp_path / "out5"), "--dtype", "int8"], "--dtype int8"),
        ([str(lost_tokenizer), str(tmp_path / "out9")], "the run's tokenizer cannot be loaded"),
    ]


def test_bad_input_is_one_line_exit_2_nothing_written(trained_run, tmp_path, capsys):
    module = export_module()
    for argv, expected in bad_inputs(trained_run, tmp_path):
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        assert module.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and expected in captured.err, (argv, captured)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, argv


def ordinary_mode() -> int:
    """The permissions `open()` gives a new file under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def test_export_writes_the_tokenizer_and_generation_config_in_ordinary_modes(trained_run, tmp_path):
    """The byte-level run's export: a tokenizer.json `AutoTokenizer` reads any text with to ferry's
    byte ids and back, generation ending at id 0; every file 0644 under umask 022 (safetensors
    alone writes its files 0600)."""
    transformers = pytest.importorskip("transformers", reason="the export is read by transformers")
    out = tmp_path / "hf"
    exported = export_module().export(trained_run, out)
    expected = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in exported.files) == sorted(p.name for p in out.iterdir()) == expected
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {ordinary_mode()}
    assert "byte-level" in exported.tokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in [*TEXTS[:3], "h\u00e9llo w\u00f6rld \U0001f642\n\ttabs  and \u0100 \r\n", "  "]:
        ids = tokenizer.encode(text)
        assert ids == ByteTokenizer().encode_document(text.encode())[:-1].tolist()
        assert tokenizer.decode(ids) == text
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 0


def test_a_runs_tokenizer_json_is_copied_for_auto_tokenizer(tokenizer_run, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the export is read by transformers")
    out = tmp_path / "hf"
    exported = export_module().export(tokenizer_run, out)
    source = OmegaConf.load(tokenizer_run / "config.yaml").data.tokenizer
    assert (out / "tokenizer.json").read_bytes() == Path(source).read_bytes() and "copied" in exported.tokenizer
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    ferry_tokenizer = load_tokenizer(source)
    for text in TEXTS[:5]:
        (ids,) = ferry_tokenizer.encode_documents([text.encode()])
        assert tokenizer.encode(text, add_special_tokens=False) == ids[:-1].tolist()
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 0


def test_transformers_generates_from_the_export_what_sample_does(trained_run, tmp_path):
    """The whole loop: what `transformers` generates greedily from the export, its prompt encoded
    by the exported tokenizer, its end by generation_config.json, is `launch/sample.py`'s text."""
    torch = pytest.importorskip("torch", reason="the export is run by transformers")
    transformers = pytest.importorskip("transformers", reason="the export is run by transformers")
    out = tmp_path / "hf"
    export_module().export(trained_run, out)
    prompt = "def main():\n    "
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    theirs = theirs[: theirs.index(0)] if 0 in theirs else theirs
    ours = sample_module().sample(trained_run, prompt, max_new_tokens=12)
    assert ours.ids == theirs and ours.text == tokenizer.decode(theirs)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002], ids=lambda umask: f"umask {umask:04o}")
def test_safetensors_shards_get_the_mode_of_an_ordinary_file(tmp_path, umask):
    previous = os.umask(umask)
    try:
        writer = ShardedWriter(tmp_path, max_shard_bytes=200)
        for name in "abc":
            writer.add(name, np.full(40, ord(name), np.float32))
        written = writer.close()
    finally:
        os.umask(previous)
    assert len([p for p in written if p.suffix == ".safetensors"]) == 3 and len(written) == 4  # and the index
    assert {stat.S_IMODE(p.stat().st_mode) for p in written} == {0o666 & ~umask}
