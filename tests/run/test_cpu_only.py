"""CPU runs on a machine without an accelerator print no plugin's traceback (`ferry.cpu_only`)."""

import fnmatch
import os
import re
import subprocess
import sys

import pytest

from ferry.cpu_only import cpu_only, device_accelerator, keep_jax_to_the_cpu
from tests.conftest import ROOT

NOISE = ("Traceback", "plugin configuration error", "E0000", "cuInit")


def matching(*paths: str):
    """`glob.glob` on a machine with these device files."""
    return lambda pattern: fnmatch.filter(paths, pattern)


def test_device_files_and_pci_ids_decide():
    """A TPU VM's chip under any number (a v5e VM's was /dev/vfio/2, which the check of /dev/vfio/0
    alone missed: importing ferry kept JAX to the CPU there), or a Google PCI device."""
    none = lambda: []  # noqa: E731
    assert cpu_only(matching("/dev/vfio/vfio", "/dev/nvidiactl"), lambda: ["0x8086"])
    for device in ("/dev/accel0", "/dev/vfio/0", "/dev/vfio/2", "/dev/nvidia0", "/dev/nvidia3"):
        assert not cpu_only(matching(device), none), device
    assert device_accelerator(matching("/dev/vfio/2", "/dev/vfio/vfio"), none) == "tpu"
    assert device_accelerator(matching("/dev/vfio/vfio"), lambda: ["0x8086", "0x1ae0"]) == "tpu"
    assert device_accelerator(matching("/dev/nvidia0", "/dev/nvidiactl"), lambda: ["0x10de"]) == "gpu"
    assert not keep_jax_to_the_cpu({"JAX_PLATFORMS": "cuda"}, matching(), none)  # the user's choice stands
    assert not keep_jax_to_the_cpu({}, matching("/dev/nvidia0"), none)  # a GPU machine: JAX picks
    assert not keep_jax_to_the_cpu({}, matching("/dev/vfio/2"), none)  # the v5e VM


def without_platform_choice() -> dict:
    return {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}


@pytest.mark.skipif(not cpu_only(), reason="this machine has an accelerator")
@pytest.mark.parametrize("first", ["import jax, ferry", "import ferry, jax"])
def test_a_program_starting_as_the_launchers_do_keeps_a_cpu_machine_quiet(first):
    """Importing ferry sets nothing (tests/test_layers.py); a program that calls
    `keep_jax_to_the_cpu` first, as the launchers and benchmarks do, starts JAX on the CPU quietly,
    whether JAX was imported before or after ferry."""
    start = "from ferry.cpu_only import keep_jax_to_the_cpu; keep_jax_to_the_cpu()"
    result = subprocess.run(
        [sys.executable, "-c", f"{first}; {start}; print(jax.devices()[0].platform)"],
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
