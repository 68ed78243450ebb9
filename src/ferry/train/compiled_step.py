"""The train step compiled from the train state's layout alone, so that its memory can be
checked before the state is allocated."""

import time
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ferry.train.state import StateLayout
from ferry.train.step import TrainState
from ferry.xla.compile_oom import CompileTimeOom, StepOverHbm, argument_bytes
from ferry.xla.scheduler_costs import ProfileCache, compile_with_costs
from ferry.xla.targets import GpuTarget


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
    (`ferry.xla.scheduler_costs`, as the plan does; its profile kept in `costs_cache`). A step
    XLA refuses to compile over HBM (libtpu checks at compile time) is a `StepOverHbm`."""

    def step(arrays: Any, batch: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        new_state, metrics = body(layout.assemble(arrays), batch)
        return eqx.filter(new_state, eqx.is_array), metrics

    started = time.perf_counter()
    with warnings.catch_warnings():  # the batch's buffer cannot be reused for an output; that is fine
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(layout.abstract(), batch_spec)
        try:
            compiled = compile_lowered(lowered, scheduler, costs_cache)
        except jax.errors.JaxRuntimeError as error:  # libtpu checks HBM at compile time
            oom = CompileTimeOom.of(error)
            if oom is None:
                raise
            device, host = argument_bytes((layout.abstract(), batch_spec))
            devices = jax.devices()
            where = f"{len(devices)} x {devices[0].device_kind}"
            raise StepOverHbm(oom, device, host, time.perf_counter() - started, where) from error

    def run(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        arrays, metrics = compiled(eqx.filter(state, eqx.is_array), batch)
        return layout.assemble(arrays), metrics

    return compiled, run


def compile_lowered(lowered: Any, scheduler: GpuTarget | None, costs_cache: ProfileCache | None) -> Any:
    """XLA's compile of the lowered step, its scheduler pricing the ops with ferry's costs where a
    `scheduler` target is given."""
    if scheduler is None:
        return lowered.compile()
    return compile_with_costs(lowered, {}, scheduler, costs_cache).compiled
