"""The run's root config, `FerryConfig` (a whole run as resolved from Hydra, composing each
group's config from beside its code: `train` and `offload` in `ferry.config.train`, `data` in
`ferry.data.config`, `plan` in `ferry.config.plan`, `mesh` in `ferry.sharding`, `platform` in
`ferry.platform`, `distributed` in `ferry.distributed`), `load_config` that validates one, and
the run lifecycle's own groups: `run`, `checkpoint`, `log`, `profile` and `init`."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from ferry.config.plan import PlanConfig
from ferry.config.train import UPDATE_SETTINGS, OffloadConfig, StatePlacement, TrainConfig
from ferry.config_schema import checked_value, from_dict
from ferry.data.config import DataConfig
from ferry.data.loss_weights import weighted_width
from ferry.distributed import DistributedConfig
from ferry.errors import ConfigError
from ferry.models.base import AbstractModelConfig
from ferry.models.registry import model_config
from ferry.platform import PlatformConfig
from ferry.sharding import MeshConfig, check_divisible
from ferry.xla.targets import target_names


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str | None = None  # the run directory; null: a new one under run.root, named by the date and time
    root: str = "runs"  # where new run directories go, and where a run without offload= looks for a plan's choice
    resume: bool = True  # a run.dir holding checkpoints of this model resumes from the latest
    allow_data_change: bool = False  # resume although batch, sequence, seed or data differ from the checkpoint's
    # resume although these training settings (train.* keys of the update or the loss) differ from the
    # checkpoint's, e.g. [train.learning_rate,train.warmup_steps]; each change is recorded in <run dir>/run.json
    allow_change: tuple[str, ...] = ()
    # resume a latest checkpoint step whose record names another step (a symlink, copy or rename) or another run
    allow_foreign_checkpoint: bool = False

    def __post_init__(self) -> None:
        unknown = [key for key in self.allow_change if key not in UPDATE_SETTINGS]
        if unknown:
            raise ConfigError(
                f"run.allow_change names {', '.join(unknown)}, not a training setting a resume compares; "
                f"it takes {', '.join(UPDATE_SETTINGS)} (a data key: run.allow_data_change=true; train.steps "
                "needs no allowing)"
            )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in <run dir>/checkpoints: every `every` steps (0: only the final save and
    on preemption), the last `keep` kept, and also every `keep_every`-th step when set."""

    every: int = 100  # steps between saves; 0: only the final save (and one on preemption)
    keep: int = 3  # the last K checkpoints are kept, older ones deleted
    keep_every: int | None = None  # also keep every M-th step's checkpoint; null: none beyond the last `keep`
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
    wandb_project: str = "ferry"  # the Weights & Biases project of a log.wandb=true run
    verbose: bool = False  # the whole start-up report on the console, not only in <run dir>/startup.txt


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A jax.profiler trace of `steps` steps from `start_step` into <run dir>/profile."""

    start_step: int | None = None  # the first traced step (at least 1); null: no profile
    steps: int = 3  # how many steps the trace holds

    def __post_init__(self) -> None:
        if self.start_step is not None and self.start_step < 1:
            raise ConfigError(f"profile.start_step must be at least 1 (or null: no profile), got {self.start_step}")
        if self.steps < 1:
            raise ConfigError(f"profile.steps must be at least 1, got {self.steps}")


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Where the first parameters come from: a random init (`train.seed`), or `from_hf`, a local
    Hugging Face checkpoint directory whose config.json the model config must match."""

    from_hf: str | None = None  # a local Hugging Face checkpoint directory to start from; null: a random init


@dataclasses.dataclass(frozen=True)
class FerryConfig:
    """A whole run, as resolved from Hydra: `model` is the family's own config dataclass."""

    model_name: str
    model: AbstractModelConfig
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
    mode: str = "train"  # train | plan (compile for target=, no chip) | compile (a TPU run's step into the cache)
    target: str | None = None  # what mode=plan or compile compiles for: a name of ferry.xla.targets.TARGETS
    plan: PlanConfig = PlanConfig()
    init: InitConfig = InitConfig()
    notes: tuple[str, ...] = ()  # what was adjusted or looks wrong, printed once at start-up

    def __post_init__(self) -> None:
        if self.mode not in ("train", "plan", "compile"):
            raise ConfigError(f"mode is {self.mode!r}; use train, plan or compile")
        if self.mode == "plan" and self.target is None:
            raise ConfigError(f"mode=plan needs a target: target={'|'.join(target_names())}")
        if self.mode == "compile" and self.target is None:
            raise ConfigError(
                "mode=compile compiles a run's step for the TPU it will train on: add "
                f"target={'|'.join(target_names('tpu'))}"
            )
        if self.mode == "train" and self.target is not None:
            raise ConfigError(
                f"target={self.target} is the hardware mode=plan compiles for; a training run uses this machine's. "
                f"Add mode=plan to plan for {self.target}, or drop target= to train here"
            )
        if self.mode != "plan" and self.plan != PlanConfig():
            changed = [f.name for f in dataclasses.fields(PlanConfig) if getattr(self.plan, f.name) != f.default]
            raise ConfigError(
                f"plan.{changed[0]} is read by mode=plan only; add mode=plan target=<target> to plan, or drop "
                f"the plan.* keys to {self.mode}"
            )
        if self.profile.start_step is not None and self.profile.start_step > self.train.steps:
            raise ConfigError(
                f"profile.start_step={self.profile.start_step} is after the last step "
                f"(train.steps={self.train.steps}), "
                f"so nothing would be profiled; choose a step from 1 to {self.train.steps}"
            )
        check_peel(self.offload, self.model)
        if self.mode == "compile" and self.offload.name == "auto":
            raise ConfigError(
                "mode=compile compiles one preset's step, and offload=auto chooses its preset when the run starts: "
                "train once with offload=auto (its choice is in the run's config.yaml), or name a preset"
            )

    @property
    def run_platform(self) -> PlatformConfig:
        """The platform this run applies: `platform.host_offload_flags` joined to its flags where
        its offload copies to pinned host (`OffloadConfig.copies_to_host`)."""
        return self.platform.for_host_copies(self.offload.copies_to_host)

    @property
    def state_placement(self) -> StatePlacement:
        """Where the train state lives (`offload.optimizer`, `offload.params`, how it streams) and
        the dtype its moments are stored in (`train.adam_moments_dtype`)."""
        return dataclasses.replace(self.offload.state_placement, moments_dtype=self.train.adam_moments_dtype)

    @property
    def micro_steps(self) -> int:
        """Micro batches accumulated per step, over this mesh's data-parallel devices."""
        return self.train.micro_steps(self.mesh.data_parallel)

    @property
    def batch_shape(self) -> tuple[int, int]:
        """A step's global batch of token windows: each window holds its targets' extra token (and,
        with data.format=chat, its tokens' loss weights after them: `ferry.data.loss_weights`)."""
        if self.data.format == "chat":
            return (self.train.global_batch_size, weighted_width(self.train.seq_len))
        return (self.train.global_batch_size, self.train.seq_len + 1)


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
    profile = from_dict(ProfileConfig, node.get("profile", {}), "profile")
    notes += profile_cut(profile, train.steps)
    return FerryConfig(
        model_name=checked_value("model.name", model.get("name", "custom"), str),  # a label: a list is none
        model=model_settings,
        train=train,
        offload=from_dict(OffloadConfig, node.get("offload", {}), "offload"),
        data=data,
        run=from_dict(RunConfig, node.get("run", {}), "run"),
        checkpoint=from_dict(CheckpointConfig, node.get("checkpoint", {}), "checkpoint"),
        log=from_dict(LogConfig, node.get("log", {}), "log"),
        profile=profile,
        platform=from_dict(PlatformConfig, node.get("platform", {}), "platform"),
        mesh=from_dict(MeshConfig, node.get("mesh", {}), "mesh"),
        distributed=from_dict(DistributedConfig, node.get("distributed", {}), "distributed"),
        mode=str(node.get("mode", "train")),
        target=None if node.get("target") is None else str(node["target"]),
        plan=from_dict(PlanConfig, node.get("plan", {}), "plan"),
        init=from_dict(InitConfig, node.get("init", {}), "init"),
        notes=tuple(notes),
    )


def profile_cut(profile: ProfileConfig, steps: int) -> list[str]:
    """A trace that would run past the run's last step ends there: said once, with what it holds."""
    start = profile.start_step
    if start is None or start > steps or start + profile.steps - 1 <= steps:
        return []  # no trace, or one FerryConfig refuses (it starts after the last step), or it fits
    return [
        f"profile.steps={profile.steps} from profile.start_step={start} runs past train.steps={steps}: the trace "
        f"holds steps {start} to {steps} ({steps - start + 1} step(s))"
    ]


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
