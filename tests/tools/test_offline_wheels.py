"""scripts/offline_wheels.py without the network: what it asks pip for, and the folder it clears."""

import importlib.util

import pytest

from tests.conftest import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("offline_wheels", ROOT / "scripts" / "offline_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_requirements_leave_jax_to_the_pin_and_add_extras():
    script = load_script()
    base = script.requirements([])
    assert not any(r.lower().startswith("jax") and not r.lower().startswith("jaxtyping") for r in base)
    assert any(r.startswith("equinox") for r in base) and any(r.startswith("hydra-core") for r in base)
    assert set(base) < set(script.requirements(["test"]))
    with pytest.raises(SystemExit, match="--extras names 'nope'"):
        script.requirements(["nope"])
    assert script._normal("antlr4-python3-runtime==4.9.*") == "antlr4_python3_runtime"
    assert "--python-version" in script.target_flags("3.11") and "3.11" in script.target_flags("3.11")


def test_out_folder_holding_other_files_is_refused(tmp_path):
    script = load_script()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="besides wheels"):
        script.clear_wheel_folder(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "old-1.0-py3-none-any.whl").write_text("")
    script.clear_wheel_folder(wheels)
    assert wheels.is_dir() and not any(wheels.iterdir())
