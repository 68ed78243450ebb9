"""On a machine with no accelerator, keep JAX to its CPU backend unless told otherwise.

JAX starts every PJRT plugin it finds on its first use. With ferry's `[plan]` extra installed
(the CUDA plugin and libtpu, for compiling without the chips), a CPU-only machine then prints the
CUDA plugin's traceback ("Jax plugin configuration error ... cuInit(0) failed") and libtpu's
`E0000` lines before every CPU run: the README's layer example and the CPU benchmarks included.
Importing ferry sets `JAX_PLATFORMS=cpu` there (or `jax_platforms`, where JAX is already
imported and its backends not yet chosen), as the tests do. A machine with a TPU or NVIDIA
device file, a `JAX_PLATFORMS` the user set, and the launcher's `platform=` (which sets
`jax_platforms` itself, `ferry.platform.apply_platform`) are left as they are; the plugins still
serve deviceless compiles (`mode=plan`).
"""

import os
import sys
from collections.abc import Callable, MutableMapping

# the device files of the accelerators ferry runs on (as `ferry.plan.measure.accelerator_present`)
DEVICE_FILES = ("/dev/accel0", "/dev/vfio/0", "/dev/nvidia0")


def cpu_only(exists: Callable[[str], bool] = os.path.exists) -> bool:
    """No TPU (`/dev/accel0`, `/dev/vfio/0` on v5e and newer) or NVIDIA GPU (`/dev/nvidia0`) here."""
    return not any(exists(path) for path in DEVICE_FILES)


def keep_jax_to_the_cpu(
    environ: MutableMapping[str, str] | None = None, exists: Callable[[str], bool] = os.path.exists
) -> bool:
    """Choose JAX's CPU backend on a CPU-only machine where nothing chose a platform; whether it did."""
    environ = os.environ if environ is None else environ
    if "JAX_PLATFORMS" in environ or not cpu_only(exists):
        return False
    jax = sys.modules.get("jax")
    if jax is None:
        environ["JAX_PLATFORMS"] = "cpu"  # read when JAX is imported
        return True
    if jax.config.jax_platforms:  # chosen in code already
        return False
    jax.config.update("jax_platforms", "cpu")  # read when JAX starts its first backend
    return True
