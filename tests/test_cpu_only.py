"""CPU runs on a machine without an accelerator print no plugin's traceback (`ferry.cpu_only`)."""

import os
import re
import subprocess
import sys

import pytest

from ferry.cpu_only import cpu_only, keep_jax_to_the_cpu
from tests.conftest import ROOT

NOISE = ("Traceback", "plugin configuration error", "E0000", "cuInit")


def test_device_files_decide():
    assert cpu_only(lambda path: False)
    for device in ("/dev/accel0", "/dev/vfio/0", "/dev/nvidia0"):
        assert not cpu_only(lambda path, device=device: path == device)
    assert not keep_jax_to_the_cpu({"JAX_PLATFORMS": "cuda"}, lambda path: False)  # the user's choice stands
    assert not keep_jax_to_the_cpu({}, lambda path: path == "/dev/nvidia0")  # a GPU machine: JAX picks


def without_platform_choice() -> dict:
    return {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}


@pytest.mark.skipif(not cpu_only(), reason="this machine has an accelerator")
@pytest.mark.parametrize("first", ["import jax, ferry", "import ferry, jax"])
def test_importing_ferry_keeps_a_cpu_machine_quiet(first):
    result = subprocess.run(
        [sys.executable, "-c", f"{first}; print(jax.devices()[0].platform)"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=without_platform_choice(),
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "cpu", result.stderr
    assert not [word for word in NOISE if word in result.stderr], result.stderr


@pytest.mark.skipif(not cpu_only(), reason="this machine has an accelerator")
def test_the_layer_guide_example_prints_no_plugin_traceback(tmp_path):
    guide = (ROOT / "docs" / "guides" / "own-layer.md").read_text()  # the layer example, moved from the README
    example = tmp_path / "example.py"
    example.write_text(re.search(r"```python\n(.*?)```", guide, re.S).group(1))
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, env=without_platform_choice(), timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert not [word for word in NOISE if word in result.stderr], result.stderr
