"""The train step compiled from the train state's layout alone, so that its memory can be
checked before the state is allocated."""

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ferry.plan.scheduler_costs import ProfileCache, compile_with_costs
from ferry.plan.targets import GpuTarget
from ferry.train.state import StateLayout
from ferry.train.step import TrainState


def compile_step(
    body: Callable,
    layout: StateLayout,
    batch_spec: jax.ShapeDtypeStruct,
    scheduler: GpuTarget | None = None,
    costs_cache: ProfileCache | None = None,
) -> tuple[Any, Callable]:
    """The train step compiled from the state's shapes alone (so its memory can be checked
    before the state is allocated), and a function running it on a TrainState. The state's
    arrays and the batch are donated: parameters and moments are updated in place. With a
    `scheduler` target, XLA's scheduler times the step's ops with ferry's cost model of it
    (`ferry.plan.scheduler_costs`, as the plan does; its profile kept in `costs_cache`)."""

    def step(arrays: Any, batch: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        new_state, metrics = body(layout.assemble(arrays), batch)
        return eqx.filter(new_state, eqx.is_array), metrics

    with warnings.catch_warnings():  # the batch's buffer cannot be reused for an output; that is fine
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(layout.abstract(), batch_spec)
        if scheduler is None:
            compiled = lowered.compile()
        else:
            compiled = compile_with_costs(lowered, {}, scheduler, costs_cache).compiled

    def run(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        arrays, metrics = compiled(eqx.filter(state, eqx.is_array), batch)
        return layout.assemble(arrays), metrics

    return compiled, run
