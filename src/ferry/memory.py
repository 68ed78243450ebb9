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


def check_fits(model_name: str, num_parameters: int, size: str, suggestion: str) -> None:
    """Refuse a model whose training state alone exceeds memory; `size` describes its size."""
    needed = num_parameters * TRAINING_BYTES_PER_PARAMETER
    have, where = available_bytes()
    if needed > have:
        raise InsufficientMemoryError(
            f"model {model_name} has {size}: its fp32 parameters, "
            f"gradients, AdamW state and bf16 compute copy need {needed / 2**30:,.1f} GiB "
            f"({TRAINING_BYTES_PER_PARAMETER} B per parameter, before activations), but this machine "
            f"has {have / 2**30:,.1f} GiB ({where}). {suggestion}"
        )
