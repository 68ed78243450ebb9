"""The train state's layout on a mesh (shapes, static parts and shardings, known from shapes
alone) and the state itself, built on the devices in that layout from a random init or a
Hugging Face checkpoint. `TrainState` is in `ferry.train.train_state`."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh

from ferry.config.root import FerryConfig
from ferry.config.train import DEVICE_STATE, StatePlacement, TrainConfig
from ferry.hf import load_pretrained
from ferry.models.registry import build_model
from ferry.sharding import tree_shardings
from ferry.train.optimizer import make_optimizer, streamed_update
from ferry.train.state_memory import state_map, state_on_host, with_memory_kinds
from ferry.train.streamed_update import StreamedUpdate
from ferry.train.train_state import TrainState, init_state


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a train state is built and laid out on a mesh, known from shapes alone."""

    make: Callable[[], TrainState]  # builds the whole state
    shapes: Any  # its arrays as ShapeDtypeStructs (None elsewhere)
    static: Any  # everything else
    sharding: Any  # a NamedSharding per array, by the parameter rules, in its memory kind
    model: Any  # the model, abstract
    placement: StatePlacement = DEVICE_STATE  # where the moments and master weights live

    def abstract(self) -> Any:
        """The arrays as ShapeDtypeStructs in their shardings: what a checkpoint restores into."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), self.shapes, self.sharding
        )

    def assemble(self, arrays: Any) -> TrainState:
        """The state from its arrays (a checkpoint's, a compiled step's output) and the static rest."""
        return eqx.combine(arrays, self.static)

    def streamed_update(self, train: TrainConfig) -> StreamedUpdate | None:
        """The update that streams the host-resident part through HBM (None: all in HBM)."""
        return streamed_update(train, self.model, self.placement, self.sharding.model)

    def host_bytes(self) -> int:
        """Bytes of the state that live in pinned host memory (all devices together)."""
        on_host = [s for s, sh in zip(jax.tree.leaves(self.shapes), self._host_flags(), strict=True) if sh]
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in on_host)

    def _host_flags(self) -> list[bool]:
        if not self.placement.streams:
            return [False] * len(jax.tree.leaves(self.shapes))
        return jax.tree.leaves(state_on_host(self.shapes, state_map(self.model, self.placement)))


def state_layout(
    model_config: Any,
    optimizer: Any,
    mesh: Mesh,
    seed: int = 0,
    placement: StatePlacement = DEVICE_STATE,
    compute_dtype: str = "bfloat16",
) -> StateLayout:
    """The layout of the state that `seed`'s random init of `model_config` and `optimizer` make,
    traced once (no array is allocated); the planner compiles from it too. With `placement`
    (`offload.optimizer`, `offload.params`) part of it lives in pinned host memory."""

    def make() -> TrainState:
        return init_state(build_model(model_config, jax.random.key(seed)), optimizer, placement, compute_dtype)

    shapes, static = eqx.partition(eqx.filter_eval_shape(make), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    model = eqx.combine(shapes.model, static.model)
    sharding = tree_shardings(shapes, mesh)
    if placement.streams:
        sharding = with_memory_kinds(sharding, state_on_host(shapes, state_map(model, placement)))
    return StateLayout(make, shapes, static, sharding, model, placement)


def run_state_layout(config: FerryConfig, mesh: Mesh, model_config: Any = None) -> StateLayout:
    """The layout a run of `config` uses (its optimizer, seed, compute dtype and the placement
    of `offload.optimizer` and `offload.params`); `model_config` as the run would build it."""
    optimizer = make_optimizer(config.train)
    model_config = config.model if model_config is None else model_config
    tc = config.train
    return state_layout(model_config, optimizer, mesh, tc.seed, config.state_placement, tc.compute_dtype)


def random_init(layout: StateLayout) -> jax.stages.Wrapped:
    """The jitted random init of the state's arrays, built in their sharding: one program per
    layout, which `mode=compile` compiles ahead into the cache the run then reads."""

    def initial_arrays() -> Any:
        return eqx.partition(layout.make(), eqx.is_array)[0]

    return jax.jit(initial_arrays, out_shardings=layout.sharding)


def initial_state(
    config: FerryConfig, optimizer: Any, mesh: Mesh, layout: StateLayout | None = None
) -> tuple[TrainState, Any]:
    """The train state built on the devices in its sharding (no host copy of the whole model),
    and that sharding; the random init is the same on every mesh. With `init.from_hf` the
    parameters are read from the checkpoint straight into their sharding."""
    layout = layout or run_state_layout(config, mesh)
    if config.init.from_hf is None:
        arrays = random_init(layout)()
    else:
        params, static = eqx.partition(load_pretrained(config.init.from_hf, config.model, mesh), eqx.is_array)
        placement, dtype = layout.placement, config.train.compute_dtype
        wrap = lambda p: eqx.partition(init_state(eqx.combine(p, static), optimizer, placement, dtype), eqx.is_array)[0]
        arrays = jax.jit(wrap, out_shardings=layout.sharding, donate_argnums=0)(params)
    return layout.assemble(arrays), layout.sharding
