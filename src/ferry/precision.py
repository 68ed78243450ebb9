"""Mixed precision: float32 master parameters, a compute-dtype copy for the forward pass."""

from typing import Any

import equinox as eqx
import jax


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast every floating-point array in `tree`; gradients flow back to the float32 originals."""
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree)
