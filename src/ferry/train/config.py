"""Frozen configs for a training run (the `train`, `offload`, `data` and `run` config groups)."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from hydra.core.config_store import ConfigStore

from ferry.config import ConfigError, from_dict, require_finite, require_positive
from ferry.data.config import DataConfig
from ferry.loss import LossHead
from ferry.models.registry import model_config
from ferry.offload import ENGINES, PLACEMENTS, Policy
from ferry.platform import PlatformConfig
from ferry.sharding import MeshConfig, check_divisible
from ferry.train.state_memory import StatePlacement

MAX_SEED = 2**32 - 1  # seeds are 32-bit: Grain's shuffle refuses others, JAX folds larger ones


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
        for name in ("weight_decay", "z_loss_weight"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must not be negative")
        require_positive(
            "train.adam_eps",
            self.adam_eps,
            "Adam divides each update by the root of its second moment plus it, which is 0 for a weight "
            "whose gradient has been 0 (use 1e-8)",
        )
        require_positive(
            "train.grad_clip_norm",
            self.grad_clip_norm,
            "clipping scales the gradient to this norm, so 0 divides 0 by 0 (use a large value, e.g. 1e9, to not clip)",
        )
        if self.learning_rate * self.weight_decay >= 1:
            raise ConfigError(
                f"train.learning_rate x train.weight_decay = {self.learning_rate * self.weight_decay:g} "
                "must be below 1: "
                "decoupled weight decay multiplies every weight by 1 - their product each step, which then "
                "flips or zeroes the weights; lower train.weight_decay"
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(
                f"train.seed={self.seed} must lie in [0, {MAX_SEED}] (JAX's and Grain's seeds are 32-bit)"
            )
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
class AutoMeasureConfig:
    """`offload=auto` on a machine with the accelerator (`ferry.plan.auto_measure`): the search's
    `candidates` fastest-estimated placements that fit are each run on the real train step for
    `warmup_steps` untimed then `steps` timed steps, and the fastest measured that fits the device
    is chosen. The estimate does not time the chip's scheduler: on a TPU v5e it ranked offload
    presets above full_remat that ran 0.74x as fast. `measure`: null measures where an accelerator
    is present (a TPU's or an NVIDIA GPU's device file), and not on a CPU-only machine."""

    measure: bool | None = None
    candidates: int = 3
    warmup_steps: int = 1
    steps: int = 3

    def __post_init__(self) -> None:
        for name, least in (("candidates", 1), ("warmup_steps", 0), ("steps", 1)):
            if getattr(self, name) < least:
                raise ConfigError(f"offload.auto.{name} must be at least {least}, got {getattr(self, name)}")


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
    engine: str = "ferry"  # ferry | jax: JAX's own offload of the same tensors, for comparison (Policy.engine)
    auto: AutoMeasureConfig = AutoMeasureConfig()  # offload=auto: timing its best candidates on the device
    # offload=auto's record of the candidates it timed, written into the preset it chose (read by no run)
    measured: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state_placement  # noqa: B018  (refuses a placement other than device or host)
        choices = ", ".join(PLACEMENTS)
        if self.default is not None and self.default not in PLACEMENTS:
            raise ConfigError(
                f"offload.default={self.default}: a placement is one of {choices} (every tensor the model tags "
                "and offload.tensors does not list gets it; null: rematerialised)"
            )
        for name, placement in self.tensors.items():
            if placement not in PLACEMENTS:
                raise ConfigError(
                    f"offload.tensors.{name}={placement}: tensor {name!r} has placement {placement!r}; "
                    f"a placement is one of {choices}"
                )
        if self.engine not in ENGINES:
            raise ConfigError(
                f"offload.engine={self.engine}: use ferry (ferry's engine) or jax (JAX's own offload, for comparison)"
            )
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
        return Policy.from_dict(
            placements, keep_all=self.keep_all, pipelined=self.pipelined, peel=self.peel, engine=self.engine
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str | None = None
    root: str = "runs"
    resume: bool = True  # a run.dir holding checkpoints of this model resumes from the latest
    allow_data_change: bool = False  # resume although batch, sequence, seed or data differ from the checkpoint's


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in <run dir>/checkpoints: every `every` steps (0: only the final save and
    on preemption), the last `keep` kept, and also every `keep_every`-th step when set."""

    every: int = 100
    keep: int = 3
    keep_every: int | None = None
    async_save: bool = True  # write in a background thread; the step loop goes on
    final: bool = True  # save after the last step; false: a throwaway run (a benchmark) ends without one

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


def check_address(address: str) -> None:
    """host:port, the port a number from 1 to 65535 (an IPv6 host in brackets: [::1]:1234)."""
    host, colon, port = address.rpartition(":")
    fix = "give it as host:port, e.g. distributed.coordinator_address=node0:12345"
    if not colon or not host or host in ("[", "[]"):
        raise ConfigError(f"distributed.coordinator_address={address} has no port; {fix}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"distributed.coordinator_address={address}: the port {port!r} is not a number from 1 to 65535; {fix}"
        )
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigError(f"distributed.coordinator_address={address}: an IPv6 host goes in brackets, e.g. [::1]:12345")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """One process per host (multi-controller JAX). Leave everything unset on one host; under
    SLURM `jax.distributed.initialize()` reads the job's environment by itself."""

    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self) -> None:
        if self.coordinator_address is not None:
            check_address(self.coordinator_address)
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
        if self.capacity_gib is not None and not (math.isfinite(self.capacity_gib) and self.capacity_gib > 0):
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
        if self.mode == "train" and self.target is not None:
            raise ConfigError(
                f"target={self.target} is the hardware mode=plan compiles for; a training run uses this machine's. "
                f"Add mode=plan to plan for {self.target}, or drop target= to train here"
            )
        if self.mode == "train" and self.plan != PlanConfig():
            changed = [f.name for f in dataclasses.fields(PlanConfig) if getattr(self.plan, f.name) != f.default]
            raise ConfigError(
                f"plan.{changed[0]} is read by mode=plan only; add mode=plan target=<target> to plan, or drop "
                "the plan.* keys to train"
            )
        if self.profile.start_step is not None and self.profile.start_step > self.train.steps:
            raise ConfigError(
                f"profile.start_step={self.profile.start_step} is after the last step "
                f"(train.steps={self.train.steps}), "
                f"so nothing would be profiled; choose a step from 1 to {self.train.steps}"
            )
        check_peel(self.offload, self.model)
        if self.mode == "train" and self.offload.name == "auto":
            raise ConfigError(
                "offload=auto is chosen for a target by the planner: run mode=plan target=<target> offload=auto, "
                "copy the offload_auto.yaml it writes into configs/offload/ and train with that preset"
            )


def check_peel(offload: OffloadConfig, model: Any) -> None:
    """`offload.peel` takes layers out of a pipelined scanned stack's loop: refused where it would
    do nothing (no scanned stack, no pipelining, every tensor kept) or be cut to fit the stack."""
    if offload.peel == 0:
        return
    why = None
    if offload.keep_all:
        why = f"offload={offload.name} keeps every tensor on the device (keep_all), so there are no copies to peel"
    elif not offload.pipelined:
        why = "offload.pipelined=false: only a pipelined stack is peeled"
    elif not model.scan_layers:
        why = "model.scan_layers=false: the layers run one by one, not as a loop to peel"
    if why is not None:
        raise ConfigError(f"offload.peel={offload.peel} would do nothing: {why}; set offload.peel=0")
    depths = model.stack_depths()
    deepest = max(depths.values(), default=0)
    if offload.peel > deepest - 1:
        stacks = ", ".join(f"{name} {depth}" for name, depth in depths.items())
        raise ConfigError(
            f"offload.peel={offload.peel} peels more layers than a stack has after its first (layers per stack: "
            f"{stacks}); use at most {max(deepest - 1, 0)}"
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
    for key in sorted(known - {"mode", "target"}):
        if node.get(key) is not None and not isinstance(node[key], Mapping):
            raise ConfigError(f"{key}={node[key]!r}: {key} holds keys ({key}.NAME=VALUE), not a value of its own")
    if not isinstance(node.get("model"), Mapping):
        raise ConfigError("the config has no model: choose one with model=NAME (a file of configs/model/)")
    model = dict(node["model"])
    model_settings = model_config(model)
    train_node, notes = fit_warmup(dict(node.get("train", {})))
    train = from_dict(TrainConfig, train_node, "train")
    data = from_dict(DataConfig, node.get("data", {}), "data")
    notes += data.ignored()
    if train.learning_rate == 0:
        notes.append("train.learning_rate=0: the parameters will not change (the optimizer's steps are all zero)")
    return FerryConfig(
        model_name=str(model.get("name", "custom")),
        model=model_settings,
        train=train,
        offload=from_dict(OffloadConfig, node.get("offload", {}), "offload"),
        data=data,
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
