"""`launch/export_hf.py`: a trained run's checkpoint becomes a Hugging Face checkpoint whose
parameters ferry's own reader (what `init.from_hf` uses) loads bit for bit; bad input is one line,
exit status 2, and nothing written."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from omegaconf import OmegaConf

from ferry.config.overrides import compose_node
from ferry.hf import load_pretrained
from ferry.run.checkpoint import Checkpoints
from ferry.sharding import MeshConfig, make_mesh
from ferry.train.state_layout import run_state_layout
from tests.conftest import CONFIGS, ROOT, SMALL_RUN, compose_config

SCRIPT = ROOT / "launch" / "export_hf.py"


def export_module():
    spec = importlib.util.spec_from_file_location("export_hf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained_run(finished_run, tmp_path_factory):
    """A copy of the finished run (checkpoints at steps 2 and 4) with the config.yaml the launcher
    writes (the fixture's run was started in-process, without one)."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    shutil.copytree(finished_run, run_dir)
    node = compose_node("train", [*SMALL_RUN, f"run.dir={run_dir}"], CONFIGS)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(node))
    return run_dir


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
    ]


def test_bad_input_is_one_line_exit_2_nothing_written(trained_run, tmp_path, capsys):
    module = export_module()
    for argv, expected in bad_inputs(trained_run, tmp_path):
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        assert module.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and expected in captured.err, (argv, captured)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, argv
