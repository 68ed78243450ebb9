"""Will a model's training state fit on this machine? Answered from shapes alone, in seconds."""

import jax
import psutil

# float32 master params + float32 grads + AdamW's two float32 moments, + a bf16 compute copy.
TRAINING_BYTES_PER_PARAMETER = 4 + 4 + 8 + 2


class InsufficientMemoryError(RuntimeError):
    """The parameters and optimizer state alone exceed the memory of the devices."""


def available_bytes() -> tuple[int, str]:
    """Memory the training state can use, and where it is."""
    devices = jax.local_devices()
    stats = devices[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] * len(devices), f"{len(devices)} x {devices[0].device_kind} HBM"
    return psutil.virtual_memory().available, "host RAM available to the CPU backend"


def check_fits(model_name: str, parameters_per_device: int, size: str, suggestion: str) -> None:
    """Refuse a model whose training state alone exceeds this host's memory; `size` describes
    the model, `parameters_per_device` is what one device holds of it under the mesh."""
    devices = len(jax.local_devices())
    needed = parameters_per_device * TRAINING_BYTES_PER_PARAMETER * devices
    have, where = available_bytes()
    if needed > have:
        raise InsufficientMemoryError(
            f"model {model_name} has {size}: its fp32 parameters, "
            f"gradients, AdamW state and bf16 compute copy need {needed / 2**30:,.1f} GiB on this host's "
            f"{devices} device(s) with this mesh ({TRAINING_BYTES_PER_PARAMETER} B per parameter, before "
            f"activations), but this machine has {have / 2**30:,.1f} GiB ({where}). {suggestion}"
        )
