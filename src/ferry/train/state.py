"""The train state's layout on a mesh (shapes, static parts and shardings, known from shapes
alone) and the state itself, built on the devices in that layout from a random init or a
Hugging Face checkpoint. `TrainState` is in `ferry.train.step`, with the step that updates it."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh

from ferry.hf import load_pretrained
from ferry.models.registry import build_model
from ferry.sharding import tree_shardings
from ferry.train.config import FerryConfig
from ferry.train.step import TrainState, init_state


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a train state is built and laid out on a mesh, known from shapes alone."""

    make: Callable[[], TrainState]  # builds the whole state
    shapes: Any  # its arrays as ShapeDtypeStructs (None elsewhere)
    static: Any  # everything else
    sharding: Any  # a NamedSharding per array, by the parameter rules

    def abstract(self) -> Any:
        """The arrays as ShapeDtypeStructs in their shardings: what a checkpoint restores into."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), self.shapes, self.sharding
        )

    def assemble(self, arrays: Any) -> TrainState:
        """The state from its arrays (a checkpoint's, a compiled step's output) and the static rest."""
        return eqx.combine(arrays, self.static)


def state_layout(model_config: Any, optimizer: Any, mesh: Mesh, seed: int = 0) -> StateLayout:
    """The layout of the state that `seed`'s random init of `model_config` and `optimizer` make,
    traced once (no array is allocated); the planner compiles from it too."""

    def make() -> TrainState:
        return init_state(build_model(model_config, jax.random.key(seed)), optimizer)

    shapes, static = eqx.partition(eqx.filter_eval_shape(make), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return StateLayout(make, shapes, static, tree_shardings(shapes, mesh))


def initial_state(
    config: FerryConfig, optimizer: Any, mesh: Mesh, layout: StateLayout | None = None
) -> tuple[TrainState, Any]:
    """The train state built on the devices in its sharding (no host copy of the whole model),
    and that sharding; the random init is the same on every mesh. With `init.from_hf` the
    parameters are read from the checkpoint straight into their sharding."""
    layout = layout or state_layout(config.model, optimizer, mesh, config.train.seed)
    if config.init.from_hf is None:
        arrays = jax.jit(lambda: eqx.partition(layout.make(), eqx.is_array)[0], out_shardings=layout.sharding)()
    else:
        params, static = eqx.partition(load_pretrained(config.init.from_hf, config.model, mesh), eqx.is_array)
        wrap = lambda p: eqx.partition(init_state(eqx.combine(p, static), optimizer), eqx.is_array)[0]
        arrays = jax.jit(wrap, out_shardings=layout.sharding, donate_argnums=0)(params)
    return layout.assemble(arrays), layout.sharding
