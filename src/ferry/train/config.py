"""Frozen configs for a training run (the `train`, `offload`, `data` and `run` config groups)."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from hydra.core.config_store import ConfigStore

from ferry.config import ConfigError, from_dict, require_finite
from ferry.data.config import DataConfig
from ferry.loss import LossHead
from ferry.models.registry import model_config
from ferry.offload import Policy
from ferry.platform import PlatformConfig
from ferry.sharding import MeshConfig, check_divisible
from ferry.train.state_memory import StatePlacement


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch_size: int = 8
    micro_batch_size: int | None = None  # per device; set to accumulate gradients; None: one micro step
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_learning_rate_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip_norm: float = 1.0
    z_loss_weight: float = 0.0
    loss_head: str = "chunked"  # chunked: the logits are never whole (a vocabulary chunk at a time); logits: whole
    loss_chunk_mib: float = 256.0  # loss_head=chunked: float32 logits per chunk and device, in MiB
    # loss_head=chunked: the head's weight gradient in a backward walk of its own, after the layers'
    # (late: less HBM, one more logits matmul) or with the hidden state's (early)
    loss_weight_grad: str = "late"
    compute_dtype: str = "bfloat16"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4  # held-out batches per evaluation; 0: no evaluation
    on_nonfinite: str = "stop"  # stop: checkpoint the last good state and stop; skip: skip the update
    # the gradient self-check of the offload policy before training (ferry.train.policy_check);
    # None: on for platform=gpu and tpu, off on cpu
    check_policy: bool | None = None

    @property
    def head(self) -> LossHead:
        """How the loss reads the output head (`loss_head`, `loss_chunk_mib`)."""
        return LossHead(self.loss_head, self.loss_chunk_mib, self.loss_weight_grad)

    def micro_steps(self, data_parallel: int = 1) -> int:
        """Micro batches accumulated per optimizer step when a batch is split `data_parallel` ways."""
        if self.micro_batch_size is None:
            return 1
        return self.global_batch_size // (self.micro_batch_size * data_parallel)

    def rows_per_micro_step(self, data_parallel: int = 1) -> int:
        """Rows of one micro step, over all devices."""
        return self.global_batch_size // self.micro_steps(data_parallel)

    def rows_per_device(self, data_parallel: int = 1) -> int:
        """Rows of one micro step on each of the `data_parallel` devices a batch is split over
        (`micro_batch_size` when it is set)."""
        return self.rows_per_micro_step(data_parallel) // data_parallel

    def check_batch(self, data_parallel: int, mesh_description: str) -> None:
        """The global batch must split into micro batches over the data-parallel devices."""
        per_step = (self.micro_batch_size or 1) * data_parallel
        if self.global_batch_size % per_step:
            what = (
                f"train.micro_batch_size {self.micro_batch_size} x data-parallel size {data_parallel}"
                if self.micro_batch_size is not None
                else f"the data-parallel size {data_parallel}"
            )
            raise ConfigError(
                f"train.global_batch_size {self.global_batch_size} is not a multiple of {what} "
                f"(data x fsdp x expert of mesh {mesh_description}); choose a global batch that is"
            )

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "seq_len", "log_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be at least 1, got {getattr(self, name)}")
        if self.eval_batches < 0:
            raise ConfigError(f"train.eval_batches must be 0 (no evaluation) or more, got {self.eval_batches}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError(f"train.micro_batch_size must be at least 1, got {self.micro_batch_size}")
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            raise ConfigError(
                f"train.warmup_steps {self.warmup_steps} must lie in [0, train.steps={self.steps}): "
                "the cosine decay needs at least one step after the warmup"
            )
        for name in ("learning_rate", "min_learning_rate_ratio", "weight_decay", "adam_b1", "adam_b2", "adam_eps"):
            require_finite(f"train.{name}", getattr(self, name))
        for name in ("grad_clip_norm", "z_loss_weight"):
            require_finite(f"train.{name}", getattr(self, name))
        if self.learning_rate < 0:
            raise ConfigError(f"train.learning_rate={self.learning_rate} is negative; use a learning rate > 0")
        if not 0 <= self.min_learning_rate_ratio <= 1:
            raise ConfigError(f"train.min_learning_rate_ratio={self.min_learning_rate_ratio} must lie in [0, 1]")
        for name in ("adam_b1", "adam_b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must lie in [0, 1)")
        for name in ("weight_decay", "adam_eps", "grad_clip_norm", "z_loss_weight"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must not be negative")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"train.on_nonfinite is {self.on_nonfinite!r}; use stop or skip")
        LossHead(
            self.loss_head, self.loss_chunk_mib, self.loss_weight_grad
        )  # refuses an unknown head or a chunk of no bytes
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"train.compute_dtype is {self.compute_dtype!r}; use float32 or bfloat16")


# The config holding TrainConfig's defaults as Hydra sees them; configs/train.yaml's defaults list loads it.
TRAIN_DEFAULTS = "train_defaults"


def register_train_defaults() -> None:
    """Give Hydra TrainConfig's defaults as the config `train_defaults`, so that the dataclass is
    their one source and every `train.*` key can be overridden on the command line."""
    ConfigStore.instance().store(name=TRAIN_DEFAULTS, node={"train": dataclasses.asdict(TrainConfig())})


register_train_defaults()  # on import: whatever composes configs/ imports this module to load the result


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """An offload preset: `tensors` maps tensor names to device | offload | remat; `default`, when
    set, places every other tensor the model tags (so one preset fits every model family)."""

    name: str = "custom"
    keep_all: bool = False
    default: str | None = None
    tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    optimizer: str = "device"  # AdamW's moments: device | host (pinned host, streamed a layer at a time)
    params: str = "device"  # the float32 master weights: device | host (a compute-dtype copy stays in HBM)
    pipelined: bool = True  # a scanned stack's copies one layer apart (ferry.offload_scan)
    peel: int = 0  # a pipelined stack's first and last `peel` layers outside its loop (Policy.peel)

    def __post_init__(self) -> None:
        self.state_placement  # noqa: B018  (refuses a placement other than device or host)
        if self.peel < 0:
            raise ConfigError(
                f"offload.peel={self.peel}: it counts a stack's last layers run outside its loop; use 0 (none) or more"
            )

    @property
    def state_placement(self) -> StatePlacement:
        return StatePlacement(self.optimizer, self.params)

    def policy(self, tagged: frozenset[str] = frozenset()) -> Policy:
        """The policy for a model that tags `tagged` (needed only when `default` is set)."""
        placements = dict(self.tensors)
        if self.default is not None:
            placements = {name: self.default for name in tagged if name not in placements} | placements
        return Policy.from_dict(placements, keep_all=self.keep_all, pipelined=self.pipelined, peel=self.peel)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str | None = None
    root: str = "runs"
    resume: bool = True  # a run.dir holding checkpoints of this model resumes from the latest


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in <run dir>/checkpoints: every `every` steps (0: only the final save and
    on preemption), the last `keep` kept, and also every `keep_every`-th step when set."""

    every: int = 100
    keep: int = 3
    keep_every: int | None = None
    async_save: bool = True  # write in a background thread; the step loop goes on

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every must be 0 (final save only) or more, got {self.every}")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep must be at least 1, got {self.keep}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"checkpoint.keep_every must be at least 1 or null, got {self.keep_every}")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where logged steps go besides the console and metrics.jsonl."""

    tensorboard: bool = True  # event files in <run dir>/tensorboard
    wandb: bool = False  # Weights & Biases (pip install wandb)
    wandb_project: str = "ferry"


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A jax.profiler trace of `steps` steps from `start_step` into <run dir>/profile."""

    start_step: int | None = None
    steps: int = 3

    def __post_init__(self) -> None:
        if self.start_step is not None and self.start_step < 1:
            raise ConfigError(f"profile.start_step must be at least 1 (or null: no profile), got {self.start_step}")
        if self.steps < 1:
            raise ConfigError(f"profile.steps must be at least 1, got {self.steps}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """One process per host (multi-controller JAX). Leave everything unset on one host; under
    SLURM `jax.distributed.initialize()` reads the job's environment by itself."""

    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self) -> None:
        given = [v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise ConfigError(
                "distributed.coordinator_address, distributed.num_processes and distributed.process_id "
                "go together: set all three, or none (single host, or SLURM)"
            )
        if all(given) and not 0 <= self.process_id < self.num_processes:
            raise ConfigError(
                f"distributed.process_id {self.process_id} must lie in [0, num_processes={self.num_processes})"
            )

    @property
    def explicit(self) -> bool:
        return self.coordinator_address is not None


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Where the first parameters come from: a random init (`train.seed`), or `from_hf`, a local
    Hugging Face checkpoint directory whose config.json the model config must match."""

    from_hf: str | None = None


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """`mode=plan`: the target to compile for, and the presets to compare (default: save_all,
    full_remat and the run's own `offload`). `capacity_gib` overrides the target's HBM.
    `extrapolate` plans a deep model from shallow compiles (`ferry.plan.extrapolate`) instead of
    compiling it whole: off by default, since a whole scanned stack compiles as fast as one probe
    and the probes' line under-estimated DeepSeek-V3's temporaries at the seed by 27 GB."""

    presets: tuple[str, ...] | None = None
    capacity_gib: float | None = None
    extrapolate: bool = False

    def __post_init__(self) -> None:
        if self.presets is not None:
            object.__setattr__(self, "presets", tuple(str(p) for p in self.presets))
        if self.capacity_gib is not None and self.capacity_gib <= 0:
            raise ConfigError(f"plan.capacity_gib must be positive, got {self.capacity_gib}")


@dataclasses.dataclass(frozen=True)
class FerryConfig:
    """A whole run, as resolved from Hydra: `model` is the family's own config dataclass."""

    model_name: str
    model: object
    train: TrainConfig
    offload: OffloadConfig
    data: DataConfig
    run: RunConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    profile: ProfileConfig = ProfileConfig()
    platform: PlatformConfig = PlatformConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    mode: str = "train"
    target: str | None = None
    plan: PlanConfig = PlanConfig()
    init: InitConfig = InitConfig()
    notes: tuple[str, ...] = ()  # what was adjusted or looks wrong, printed once at start-up

    def __post_init__(self) -> None:
        if self.mode not in ("train", "plan"):
            raise ConfigError(f"mode is {self.mode!r}; use train or plan")
        if self.mode == "plan" and self.target is None:
            raise ConfigError("mode=plan needs a target: target=h100|h200|b200|gb200|v5p|v5e|v6e")
        if self.mode == "train" and self.offload.name == "auto":
            raise ConfigError(
                "offload=auto is chosen for a target by the planner: run mode=plan target=<target> offload=auto, "
                "copy the offload_auto.yaml it writes into configs/offload/ and train with that preset"
            )


def check_mesh_shape(config: FerryConfig) -> None:
    """The mesh's axes divide the model's dimensions and the batch (no devices needed)."""
    axes = config.mesh.shape
    for what, size, axis in config.model.mesh_dims():
        check_divisible(what, size, axis, axes[axis], f"choose a mesh.{axis} that divides {size}")
    config.train.check_batch(config.mesh.data_parallel, config.mesh.describe())


def load_config(node: Mapping) -> FerryConfig:
    """Validate a resolved Hydra config (a plain dict) into frozen dataclasses."""
    known = {"model", "train", "offload", "data", "run", "checkpoint", "log", "profile", "init"}
    known |= {"platform", "mesh", "distributed", "mode", "target", "plan"}
    unknown = sorted(set(node) - known)
    if unknown:
        raise ConfigError(f"unknown top-level config key(s) {unknown}; known: {sorted(known)}")
    model = dict(node["model"])
    check_model_sizes(model)
    model_settings = model_config(model)
    train_node, notes = fit_warmup(dict(node.get("train", {})))
    train = from_dict(TrainConfig, train_node, "train")
    if train.learning_rate == 0:
        notes.append("train.learning_rate=0: the parameters will not change (the optimizer's steps are all zero)")
    return FerryConfig(
        model_name=str(model.get("name", "custom")),
        model=model_settings,
        train=train,
        offload=from_dict(OffloadConfig, node.get("offload", {}), "offload"),
        data=from_dict(DataConfig, node.get("data", {}), "data"),
        run=from_dict(RunConfig, node.get("run", {}), "run"),
        checkpoint=from_dict(CheckpointConfig, node.get("checkpoint", {}), "checkpoint"),
        log=from_dict(LogConfig, node.get("log", {}), "log"),
        profile=from_dict(ProfileConfig, node.get("profile", {}), "profile"),
        platform=from_dict(PlatformConfig, node.get("platform", {}), "platform"),
        mesh=from_dict(MeshConfig, node.get("mesh", {}), "mesh"),
        distributed=from_dict(DistributedConfig, node.get("distributed", {}), "distributed"),
        mode=str(node.get("mode", "train")),
        target=None if node.get("target") is None else str(node["target"]),
        plan=from_dict(PlanConfig, node.get("plan", {}), "plan"),
        init=from_dict(InitConfig, node.get("init", {}), "init"),
        notes=tuple(notes),
    )


# model sizes that may be 0: DeepSeek-V3 without dense layers, shared experts or MTP
_MAY_BE_ZERO = {"num_dense_layers", "num_shared_experts", "mtp_depth"}


def check_model_sizes(model: Mapping[str, Any]) -> None:
    """Every count in a `model` node is at least 1 (0 layers or a 0-token vocabulary fail deep
    inside the model's construction otherwise) and every float is finite; checked before the
    family's config is built, whose own checks divide by some of them."""
    for name, value in model.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and value < (0 if name in _MAY_BE_ZERO else 1):
            bound = "0 or more" if name in _MAY_BE_ZERO else "at least 1"
            raise ConfigError(f"model.{name}={value} must be {bound}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"model.{name}={value} is not a finite number")


def fit_warmup(train: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A warmup as long as the run (train.steps=10 with the default 20 warmup steps, the first
    override a newcomer tries) is shortened to a tenth of the run, with a note saying so."""
    steps, warmup = train.get("steps", TrainConfig.steps), train.get("warmup_steps", TrainConfig.warmup_steps)
    integers = all(isinstance(v, int) and not isinstance(v, bool) for v in (steps, warmup))
    if not integers or steps < 1 or warmup < steps:
        return train, []
    fitted = steps // 10
    note = (
        f"train.warmup_steps={warmup} does not fit a run of train.steps={steps}; warming up over {fitted} "
        f"step(s), a tenth of the run (set train.warmup_steps below {steps} to choose)"
    )
    return {**train, "warmup_steps": fitted}, [note]
