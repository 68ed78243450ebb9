"""The one compile of the train step: runs, plans, benchmarks and tests all compile it here,
from the train state's layout alone (so its memory can be checked before the state is
allocated), with one donation rule: the state's arrays and the batch are donated."""

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
from jax.typing import ArrayLike
from jaxtyping import Array, Int

from ferry.train.state_layout import StateLayout
from ferry.train.train_state import TrainState
from ferry.xla.compile_oom import CompileTimeOom, StepOverHbm, argument_bytes
from ferry.xla.scheduler_costs import ProfileCache, compile_with_costs
from ferry.xla.targets import GpuTarget

DONATED = (0, 1)  # the state's arrays (updated in place) and the batch (consumed: place a fresh one each step)

StepBody = Callable[[TrainState, Int[Array, "batch seq_plus_one"]], tuple[TrainState, dict[str, Array]]]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """The compiled train step: (state arrays, batch) -> (next state's arrays, metrics), both
    inputs donated."""

    compiled: Any  # jax.stages.Compiled
    layout: StateLayout
    seconds: float  # lowering and compiling on this machine
    priced: bool = False  # XLA's scheduler timed the ops with ferry's cost model
    profile_cached: bool = False  # the cost model's profile came from its cache (one compile)

    def run(
        self, state: TrainState, batch: Int[ArrayLike, "batch seq_plus_one"]
    ) -> tuple[TrainState, dict[str, Array]]:
        """One step on a TrainState (its arrays and the batch donated; a host batch is placed as
        the step was compiled for)."""
        arrays, metrics = self.compiled(eqx.filter(state, eqx.is_array), batch)
        return self.layout.assemble(arrays), metrics


def compile_from_layout(
    body: StepBody,
    layout: StateLayout,
    batch_spec: jax.ShapeDtypeStruct,
    scheduler: GpuTarget | None = None,
    costs_cache: ProfileCache | None = None,
    options: Mapping[str, object] | None = None,
    where: str | None = None,
) -> CompiledStep:
    """The train step `body` (`ferry.train.step.train_step_body`) compiled for the state of
    `layout` and a batch of `batch_spec`, its inputs donated (`DONATED`), with the per-compile
    XLA `options`. With a `scheduler` target, XLA's scheduler times the step's ops with ferry's
    cost model of it (`ferry.xla.scheduler_costs`; its profile kept in `costs_cache`). A step
    XLA refuses to compile over HBM (libtpu checks at compile time) is a `StepOverHbm` on
    `where` (default: this process's devices)."""

    def step(arrays: Any, batch: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        new_state, metrics = body(layout.assemble(arrays), batch)
        return eqx.filter(new_state, eqx.is_array), metrics

    started = time.perf_counter()
    with warnings.catch_warnings():  # the batch's buffer cannot be reused for an output; that is fine
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = jax.jit(step, donate_argnums=DONATED).lower(layout.abstract(), batch_spec)
        try:
            compiled, cached = compile_lowered(lowered, scheduler, costs_cache, options)
        except jax.errors.JaxRuntimeError as error:  # libtpu checks HBM at compile time
            oom = CompileTimeOom.of(error)
            if oom is None:
                raise
            device, host = argument_bytes((layout.abstract(), batch_spec))
            if where is None:
                devices = jax.devices()
                where = f"{len(devices)} x {devices[0].device_kind}"
            raise StepOverHbm(oom, device, host, time.perf_counter() - started, where) from error
    seconds = time.perf_counter() - started
    return CompiledStep(compiled, layout, seconds, scheduler is not None, cached)


def compile_step(
    body: StepBody,
    layout: StateLayout,
    batch_spec: jax.ShapeDtypeStruct,
    scheduler: GpuTarget | None = None,
    costs_cache: ProfileCache | None = None,
) -> tuple[Any, Callable]:
    """A run's view of `compile_from_layout`: the compiled step (for its memory analysis) and the
    function running it on a TrainState."""
    step = compile_from_layout(body, layout, batch_spec, scheduler, costs_cache)
    return step.compiled, step.run


def compile_lowered(
    lowered: Any,
    scheduler: GpuTarget | None,
    costs_cache: ProfileCache | None,
    options: Mapping[str, object] | None = None,
) -> tuple[Any, bool]:
    """XLA's compile of the lowered step with the per-compile `options`, its scheduler pricing the
    ops with ferry's costs where a `scheduler` target is given; and whether that profile came
    from its cache."""
    if scheduler is not None:
        compiled, _, cached = compile_with_costs(lowered, dict(options or {}), scheduler, costs_cache)
        return compiled, cached
    return (lowered.compile(dict(options)) if options else lowered.compile()), False


def layout_of(state: TrainState) -> StateLayout:
    """The layout of a state already built (tests, benchmarks): its arrays' shapes and shardings
    as they are."""
    arrays, static = eqx.partition(state, eqx.is_array)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    sharding = jax.tree.map(lambda x: x.sharding, arrays)
    model = eqx.combine(shapes.model, static.model)
    return StateLayout(lambda: state, shapes, static, sharding, model)


def batch_spec_of(batch: Any) -> jax.ShapeDtypeStruct:
    """The spec of a batch already placed (its sharding kept) or of a host array."""
    return jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=getattr(batch, "sharding", None))
