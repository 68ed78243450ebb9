"""The train step's configs: `TrainConfig` (the `train` group: batch, optimizer, loss, seed) and
`OffloadConfig` (the `offload` group: the policy and where the optimizer state and the master
weights live). The run's root config, composing every group, is `ferry.config.root.FerryConfig`."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from hydra.core.config_store import ConfigStore

from ferry.config_schema import require_finite, require_positive
from ferry.errors import ConfigError
from ferry.head.loss import LossHead
from ferry.offload.engine import ENGINES, PLACEMENTS, Policy

MAX_SEED = 2**32 - 1  # seeds are 32-bit: Grain's shuffle refuses others, JAX folds larger ones


DEVICE, HOST = "device", "host"
PLACES = (DEVICE, HOST)


MOMENT_DTYPES = ("float32", "bfloat16")  # train.adam_moments_dtype


@dataclasses.dataclass(frozen=True)
class StatePlacement:
    """Where the optimizer's moments and the float32 master weights live: device | host (and the
    dtype the moments are stored in, `train.adam_moments_dtype`, which sets their bytes)."""

    optimizer: str = DEVICE
    params: str = DEVICE
    # the most host-resident state (MiB per device) the update brings to HBM at once: a layer's
    # state when it is less, else that layer's leaves in groups and a large leaf in blocks of rows
    stream_mib: float = 1024.0
    # the update fetches the next step's state while it updates and writes back this step's (the
    # host link both ways at once); each step holds half of stream_mib, and three halves live at
    # once (this step's state, its new state, the next step's), 1.5x stream_mib
    prefetch: bool = False
    moments_dtype: str = "float32"  # train.adam_moments_dtype

    def __post_init__(self) -> None:
        for key in ("optimizer", "params"):
            if getattr(self, key) not in PLACES:
                raise ConfigError(f"offload.{key} is {getattr(self, key)!r}; use device or host")
        if not 0 < self.stream_mib < math.inf:
            raise ConfigError(
                f"offload.stream_mib={self.stream_mib:g}: it is the HBM (MiB per device) the update of a state on "
                "host streams through at once; use a positive number (1024 by default)"
            )

    @property
    def moment_bytes(self) -> int:
        """Bytes a parameter of each of AdamW's two moments."""
        return 2 if self.moments_dtype == "bfloat16" else 4

    @property
    def streams(self) -> bool:
        """Does any part of the state live on host (and the update stream it)?"""
        return HOST in (self.optimizer, self.params)

    @property
    def stream_bytes(self) -> float:
        """`stream_mib` in bytes: the most moved state per device the update holds in HBM at once."""
        return self.stream_mib * 2**20

    @property
    def step_bytes(self) -> float:
        """The most moved state per device one step of the update's loops brings to HBM: all of
        `stream_bytes`, or half of it where the next step's state is fetched beside it (`prefetch`)."""
        return self.stream_bytes / (2 if self.prefetch else 1)

    @property
    def steps_held(self) -> int:
        """How many steps' moved state the update's loops hold in HBM at once: one, or prefetching
        three half-size steps (the step's state, its new state, the next step's)."""
        return 3 if self.prefetch else 1

    def describe(self) -> str:
        return f"optimizer moments on {self.optimizer}, master weights on {self.params}"


DEVICE_STATE = StatePlacement()  # everything in HBM


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200  # optimizer steps of the run; the learning rate's cosine decay ends at the last
    global_batch_size: int = 8  # sequences per optimizer step, over every device and micro step
    micro_batch_size: int | None = None  # per device; set to accumulate gradients; None: one micro step
    seq_len: int = 128  # tokens per sequence (a packed window of the token stream)
    learning_rate: float = 3e-3  # AdamW's peak learning rate, reached after warmup_steps
    warmup_steps: int = 20  # steps of linear warmup from 0 to learning_rate
    min_learning_rate_ratio: float = 0.1  # the cosine decay's floor at the last step, as a fraction of learning_rate
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices only (norm scales are not decayed)
    adam_b1: float = 0.9  # Adam's decay rate of the first moment (the gradient's running mean)
    adam_b2: float = 0.95  # Adam's decay rate of the second moment (the squared gradient's running mean)
    adam_eps: float = 1e-8  # added to the root of the second moment before Adam divides by it
    # the dtype AdamW's two moments are stored in between steps (float32 | bfloat16): bfloat16 halves their
    # 8 bytes a parameter; each update computes in float32 from the stored values and rounds the new ones
    adam_moments_dtype: str = "float32"
    grad_clip_norm: float = 1.0  # the gradient is scaled down to this global norm when it is above it
    z_loss_weight: float = 0.0  # weight of PaLM's z-loss, mean(logsumexp(logits)^2), added to the loss; 0: none
    # auto: logits, fused in one chunk or chunked, whichever fits the HBM left for the head and is estimated
    # fastest from the three heads' compiled programs (ferry.head.auto; said at start-up); chunked (the
    # default until auto's choice is timed on the chip): the logits
    # are never whole (a vocabulary chunk at a time); fused: never whole either, the loss and both gradients in
    # one walk of the forward pass (a sequence chunk at a time); logits: whole
    loss_head: str = "chunked"
    # loss_head=chunked or fused (and auto's chunked candidate): float32 logits per chunk and device, in MiB
    loss_chunk_mib: float = 256.0
    # loss_head=chunked (and auto's chunked candidate): the head's weight gradient in a backward walk of its
    # own, after the layers' (late: less HBM, one more logits matmul) or with the hidden state's (early)
    loss_weight_grad: str = "late"
    # loss_head=fused (and auto's fused candidate): each chunk's logits, softmax and gradients by XLA (xla), or
    # by a Pallas TPU kernel that keeps the logits in VMEM (pallas; Pallas interpret mode off a TPU, refused on a
    # GPU); auto: pallas on a TPU whose devices hold the whole vocabulary and whose VMEM holds blocks of 512
    # tokens, else xla
    loss_kernel: str = "auto"
    compute_dtype: str = "bfloat16"  # float32 | bfloat16: the forward and backward pass (master weights stay float32)
    seed: int = 0  # the random init of the parameters (the data's shuffle has data.seed)
    log_every: int = 10  # steps between logged metrics (console, metrics.jsonl, TensorBoard); the first and last too
    eval_every: int = 50  # steps between held-out evaluations (eval_batches batches), and at the last step
    eval_batches: int = 4  # held-out batches per evaluation; 0: no evaluation
    on_nonfinite: str = "stop"  # stop: checkpoint the last good state and stop; skip: skip the update
    # the gradient self-check of the offload policy before training (ferry.run.policy_check);
    # None: on for platform=gpu and tpu, off on cpu
    check_policy: bool | None = None

    @property
    def head(self) -> LossHead:
        """How the loss reads the output head (`loss_head`, `loss_chunk_mib`)."""
        return LossHead(self.loss_head, self.loss_chunk_mib, self.loss_weight_grad, self.loss_kernel)

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
                f"(data x fsdp x expert of mesh {mesh_description}); choose a global batch that is a multiple "
                f"of {per_step}"
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
        if self.adam_moments_dtype not in MOMENT_DTYPES:
            raise ConfigError(
                f"train.adam_moments_dtype={self.adam_moments_dtype!r}: use one of {', '.join(MOMENT_DTYPES)}"
            )
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
        LossHead(  # refuses an unknown head or kernel, or a chunk of no bytes
            self.loss_head, self.loss_chunk_mib, self.loss_weight_grad, self.loss_kernel
        )
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"train.compute_dtype is {self.compute_dtype!r}; use float32 or bfloat16")


# The train.* keys that shape the update or the loss, which a resume compares with its checkpoint's
# (`ferry.run.settings_change`): the learning rate and its schedule (warmup, floor), AdamW's betas, eps
# and weight decay, the gradient clipping and the z-loss weight. A change is refused unless
# `run.allow_change` names it. Left out: train.steps (lengthening a run is what a resume with more
# steps is for; its stretched decay is said and recorded, not refused); the batch and sequence
# (data keys: `run.allow_data_change`); how the same loss and update are computed (micro_batch_size,
# loss_head and its chunks and kernel, compute_dtype, the offload placement); what is read at the
# start only (seed) or decides when to stop (on_nonfinite), logging and evaluation.
UPDATE_SETTINGS = tuple(
    f"train.{name}"
    for name in (
        "learning_rate",
        "warmup_steps",
        "min_learning_rate_ratio",
        "adam_b1",
        "adam_b2",
        "adam_eps",
        "weight_decay",
        "grad_clip_norm",
        "z_loss_weight",
    )
)


# The config holding TrainConfig's defaults as Hydra sees them; configs/train.yaml's defaults list loads it.
TRAIN_DEFAULTS = "train_defaults"


def register_train_defaults() -> None:
    """Give Hydra TrainConfig's defaults as the config `train_defaults`, so that the dataclass is
    their one source and every `train.*` key can be overridden on the command line."""
    ConfigStore.instance().store(name=TRAIN_DEFAULTS, node={"train": dataclasses.asdict(TrainConfig())})


@dataclasses.dataclass(frozen=True)
class AutoMeasureConfig:
    """`offload=auto` on a machine with the accelerator (`ferry.plan.auto_measure`): the search's
    `candidates` fastest-estimated placements that fit are each run on the real train step for
    `warmup_steps` untimed then `steps` timed steps, and the fastest measured that fits the device
    is chosen. The estimate does not time the chip's scheduler: on a TPU v5e it ranked offload
    presets above a full_remat that the chip ran faster. `measure`: null measures where an
    accelerator is present (a TPU's or an NVIDIA GPU's device file), and not on a CPU-only machine. `peel`:
    where the run leaves `offload.peel` at 0, the all-on-device candidate is also compiled with
    this many end layers of each stack out of the loop, its peeled twin, a candidate of its own
    (0: never): where the loop is over HBM, and wherever the candidates are timed, the loop
    fitting or not; where its loop is among the `candidates` timed, so is the twin, beyond the
    count. The estimate cannot tell the two apart (the same FLOPs and copies), the chip can (why
    the twin is a candidate: `ferry.plan.auto`)."""

    measure: bool | None = None  # time the candidates on the device; null: where an accelerator is present
    candidates: int = 3  # how many of the fastest-estimated placements that fit are timed
    warmup_steps: int = 1  # untimed steps of each timed candidate (its compile and first run)
    steps: int = 3  # timed steps of each candidate
    peel: int = 3  # end layers of each stack the all-on-device candidate's peeled twin runs out of the loop; 0: no twin

    def __post_init__(self) -> None:
        for name, least in (("candidates", 1), ("warmup_steps", 0), ("steps", 1), ("peel", 0)):
            if getattr(self, name) < least:
                raise ConfigError(f"offload.auto.{name} must be at least {least}, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """An offload preset: `tensors` maps tensor names to device | offload | remat; `default`, when
    set, places every other tensor the model tags (so one preset fits every model family)."""

    name: str = "custom"  # the preset's own name, as offload=NAME chooses it (printed, and in the run's config)
    keep_all: bool = False  # true: no custom VJP, JAX keeps every residual in HBM (save_all)
    # the placement (device | offload | remat) of every tagged tensor `tensors` does not name; null: remat
    default: str | None = None
    # tensor name -> device | offload | remat; offload.tensors.NAME=PLACEMENT changes one
    tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    optimizer: str = "device"  # AdamW's moments: device | host (pinned host, streamed through HBM by the update)
    params: str = "device"  # the float32 master weights: device | host (a compute-dtype copy stays in HBM)
    # the update's HBM for a state on host, MiB per device: at most a layer's state, never more than this
    stream_mib: float = 1024.0
    # the update fetches the next step's state while it writes back this one's (both directions of the host
    # link at once; each step within half of stream_mib, 1.5x stream_mib held at once). Faster on v5e, but
    # at DeepSeek-V3 width it holds more HBM than without (docs/results/tpu-v5e.md, run 11); off by default,
    # as HBM is what a run that streams its state lacks
    stream_prefetch: bool = False
    pipelined: bool = True  # a scanned stack's copies one layer apart (ferry.offload.scan)
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
        return StatePlacement(self.optimizer, self.params, self.stream_mib, self.stream_prefetch)

    @property
    def copies_to_host(self) -> bool:
        """May a run under this preset copy to pinned host (an offloaded tensor, state on host, or
        `auto`, whose candidates may)?"""
        offloads = "offload" in (self.default, *self.tensors.values())
        return self.name == "auto" or self.state_placement.streams or (offloads and not self.keep_all)

    def policy(self, tagged: frozenset[str] = frozenset()) -> Policy:
        """The policy for a model that tags `tagged` (needed only when `default` is set)."""
        placements = dict(self.tensors)
        if self.default is not None:
            placements = {name: self.default for name in tagged if name not in placements} | placements
        return Policy.from_dict(
            placements, keep_all=self.keep_all, pipelined=self.pipelined, peel=self.peel, engine=self.engine
        )
