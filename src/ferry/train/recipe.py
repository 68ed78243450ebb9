"""The one recipe for a run's train step: from a config and a mesh, everything the step is built
of (the offload policy, the state's layout, the optimizer, the loss settings with the document
mask, the micro steps and the batch), and the step compiled from them.

Runs, `mode=compile`, `mode=plan`, the plan's measurements and the benchmarks all build their step
here, so the step that was planned is the step that trains: nothing a run adds (the non-finite
guard, the document mask, the streamed update) can be left out of a plan."""

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from ferry.config.root import FerryConfig
from ferry.data.corpus import document_mask_of
from ferry.head.auto import HeadChoice
from ferry.models.base import AbstractModelConfig
from ferry.models.registry import abstract_model
from ferry.offload.policy import Policy
from ferry.sharding import batch_sharded
from ferry.train.compiled_step import CompiledStep, StepBody, compile_from_layout
from ferry.train.head_choice import step_head_choice
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.state_layout import StateLayout, run_state_layout
from ferry.train.step import LossSettings, train_step_body
from ferry.xla.scheduler_costs import ProfileCache
from ferry.xla.targets import GpuTarget


@dataclasses.dataclass(frozen=True)
class StepRecipe:
    """What one run's train step is made of, on `mesh`."""

    config: FerryConfig
    mesh: Mesh
    policy: Policy
    layout: StateLayout  # the train state's shapes and shardings, part maybe on host
    optimizer: optax.GradientTransformation
    settings: LossSettings  # its head as run: train.loss_head=auto's choice resolved
    head_choice: HeadChoice | None = None  # train.loss_head=auto's choice, and why (None: the head was set)

    @classmethod
    def of(
        cls,
        config: FerryConfig,
        mesh: Mesh,
        model_config: AbstractModelConfig | None = None,
        policy: Policy | None = None,
    ) -> "StepRecipe":
        """The step of `config` on `mesh`; `model_config`: the model as it runs on a compile
        target (`ferry.plan.planner.for_target`; default the config's), `policy`: a candidate
        placement the planner weighs (default the config's preset). `train.loss_head=auto` is
        resolved here, for this mesh's devices (`ferry.train.head_choice`)."""
        model_config = config.model if model_config is None else model_config
        if policy is None:
            policy = config.offload.policy(abstract_model(model_config).tagged_names())
        layout = run_state_layout(config, mesh, model_config)
        settings = LossSettings.of(config.train, policy, document_mask_of(config.data), config.data.format == "chat")
        choice = step_head_choice(config, mesh, model_config, policy, layout)
        if choice is not None:
            settings = dataclasses.replace(settings, head=choice.head)
        return cls(config, mesh, policy, layout, make_optimizer(config.train), settings, choice)

    def head_line(self) -> str:
        """The start-up line of the loss head the step runs, and why (auto's reasons where it chose)."""
        train = self.config.train
        with jax.set_mesh(self.mesh):  # the kernel choice reads the platform from the mesh's devices
            return self.settings.head.describe(
                train.rows_per_micro_step(self.config.mesh.data_parallel),
                train.seq_len,
                self.config.model.vocab_size,
                self.config.model.dim,
                jnp.dtype(train.compute_dtype).itemsize,
                self.mesh,
                None if self.head_choice is None else self.head_choice.why(),
            )

    @property
    def micro_steps(self) -> int:
        return self.config.micro_steps

    @property
    def batch_shape(self) -> tuple[int, int]:
        return self.config.batch_shape

    def batch_spec(self) -> jax.ShapeDtypeStruct:
        """The global batch's shape, dtype and sharding, for compiling before any batch exists."""
        return jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=batch_sharded(self.mesh))

    def body(self) -> StepBody:
        """The step before jit (`ferry.train.step.train_step_body`) with every setting a run has."""
        train = self.config.train
        return train_step_body(
            self.optimizer,
            self.settings,
            learning_rate_schedule(train),
            self.micro_steps,
            self.layout.sharding,
            train.on_nonfinite,
            self.layout.streamed_update(train),
        )

    def compile(
        self,
        scheduler: GpuTarget | None = None,
        costs_cache: ProfileCache | None = None,
        options: Mapping[str, object] | None = None,
        where: str | None = None,
    ) -> CompiledStep:
        """The step compiled from the state's layout alone (`compile_from_layout`), traced under
        the mesh so the engine sees whether its devices have memory kinds."""
        with jax.set_mesh(self.mesh):
            return compile_from_layout(
                self.body(), self.layout, self.batch_spec(), scheduler, costs_cache, options, where
            )
