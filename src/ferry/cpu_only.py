"""On a machine with no accelerator, keep JAX to its CPU backend unless told otherwise.

JAX starts every PJRT plugin it finds on its first use. With ferry's `[plan]` extra installed
(the CUDA plugin and libtpu, for compiling without the chips), a CPU-only machine then prints the
CUDA plugin's traceback ("Jax plugin configuration error ... cuInit(0) failed") and libtpu's
`E0000` lines before every CPU run: the README's layer example and the CPU benchmarks included.
Importing ferry sets `JAX_PLATFORMS=cpu` there (or `jax_platforms`, where JAX is already
imported and its backends not yet chosen), as the tests do. A machine with a TPU or NVIDIA
device (`device_accelerator`), a `JAX_PLATFORMS` the user set, and the launcher's `platform=` (which sets
`jax_platforms` itself, `ferry.platform.apply_platform`) are left as they are; the plugins still
serve deviceless compiles (`mode=plan`).
"""

import glob
import os
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"  # a TPU chip's PCI vendor id, as /sys/bus/pci/devices/*/vendor reads it


def pci_vendors() -> list[str]:
    """The vendor id of every PCI device of this machine (none where /sys does not list them)."""
    return [Path(path).read_text().strip() for path in glob.glob("/sys/bus/pci/devices/*/vendor")]


def device_accelerator(
    devices: Callable[[str], list[str]] = glob.glob, vendors: Callable[[], list[str]] = pci_vendors
) -> str | None:
    """The accelerator this machine has, judged without starting JAX: `tpu` where a TPU's device
    file is (`/dev/accel<n>`, or `/dev/vfio/<n>` on v5e and newer) or a Google PCI device, `gpu`
    where an NVIDIA GPU's is (`/dev/nvidia<n>`), else None. Any number: a v5e VM's chip was
    `/dev/vfio/2`, which the check of `/dev/vfio/0` alone missed, so importing ferry kept JAX to
    the CPU there and `offload=auto` timed nothing on the chip (docs/results/tpu-v5e.md, run 5).
    `devices` lists the paths a glob pattern matches, `vendors` the PCI vendor ids."""
    if devices("/dev/accel[0-9]*") or devices("/dev/vfio/[0-9]*") or GOOGLE_PCI_VENDOR in vendors():
        return "tpu"
    if devices("/dev/nvidia[0-9]*"):
        return "gpu"
    return None


def cpu_only(devices: Callable[[str], list[str]] = glob.glob, vendors: Callable[[], list[str]] = pci_vendors) -> bool:
    """No TPU or NVIDIA GPU here (`device_accelerator`)."""
    return device_accelerator(devices, vendors) is None


def keep_jax_to_the_cpu(
    environ: MutableMapping[str, str] | None = None,
    devices: Callable[[str], list[str]] = glob.glob,
    vendors: Callable[[], list[str]] = pci_vendors,
) -> bool:
    """Choose JAX's CPU backend on a CPU-only machine where nothing chose a platform; whether it did."""
    environ = os.environ if environ is None else environ
    if "JAX_PLATFORMS" in environ or not cpu_only(devices, vendors):
        return False
    jax = sys.modules.get("jax")
    if jax is None:
        environ["JAX_PLATFORMS"] = "cpu"  # read when JAX is imported
        return True
    if jax.config.jax_platforms:  # chosen in code already
        return False
    jax.config.update("jax_platforms", "cpu")  # read when JAX starts its first backend
    return True
