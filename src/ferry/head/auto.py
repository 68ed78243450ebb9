"""`train.loss_head=auto`: the loss head a step runs, chosen from the compiled
programs of the candidates, not from a table.

Why: the chunked head was made the default for Llama 3.1 8B on an H200, whose logits do not fit
beside the rest of the step; where they fit it is the slowest head (four or five logits-sized
matmuls against three). On the v5e chip the whole logits and the one-chunk fused head with the
Pallas kernel both ran faster steps than the chunked head (docs/results/loss-head.md).

How: three candidates, the whole `logits`, the `fused` head in one chunk (its kernel as
`train.loss_kernel` says: the Pallas kernel on a TPU) and the `chunked` head (`train.loss_chunk_mib`,
`train.loss_weight_grad`), each compiled alone, forward and backward, for one micro step's batch on
the step's own mesh (a run's devices, or a plan's compile-only devices of its target, so a plan and
a run of the same step choose alike). From each program: its temporaries (`memory_analysis`), its
matmul FLOPs (`ferry.xla.hlo_flops`, loops counted per trip) and its HBM traffic
(`ferry.xla.hlo_bytes`). A candidate whose temporaries exceed the HBM left for the head (the
device's usable HBM less the train state, its gradients and compute copy, and the activations the
offload policy keeps: `head_budget`) is refused; of the rest the one of the least estimated time,
FLOPs at the target's matmul rate plus traffic at its HBM bandwidth, is taken (ties: fused, then
logits, then chunked). Where none fits, the one of the least temporaries (the chunked head but at
tiny shapes), said so. On a CPU there is no target: the same facts are
weighed with nominal CPU figures (`CPU`), deterministic, and the line says so.

Compiles: three small programs, once. Each program's facts are kept on disk by the hash of its
lowered text and the compiler (`HeadFactsCache`, under `$XDG_CACHE_HOME/ferry/loss_head`), so a
second run, a resumed one, or a plan that builds the step for every preset, compiles none.
"""

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import psutil
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ferry.errors import ConfigError
from ferry.head.chunked import OutputHead, logits_share
from ferry.head.loss import MIB, LossHead
from ferry.sharding import ACTIVATION_RULES, PARAM_RULES, logical_spec
from ferry.xla.hardware import accelerator_name
from ferry.xla.hlo_bytes import memory_traffic
from ferry.xla.hlo_flops import matmul_flops
from ferry.xla.targets import TARGETS

CANDIDATES = ("fused", "logits", "chunked")  # ties go to the first


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the choice weighs a program with: the device's name, its matmul rate and HBM
    bandwidth, and the memory a step may use on it."""

    name: str
    matmul_rate: float  # FLOP/s
    bandwidth: float  # bytes/s
    memory_bytes: int
    nominal: bool = False  # figures of no measured device (the CPU's)

    def seconds(self, facts: "HeadFacts") -> float:
        return facts.flops / self.matmul_rate + facts.traffic / self.bandwidth


# a CPU's figures, nominal (a few cores' matmuls, one socket's DRAM): a CPU run picks by the same
# compiled facts, deterministically; its memory is the host's RAM
CPU_MATMUL_RATE = 100e9
CPU_BANDWIDTH = 20e9


def machine_of(mesh: Any) -> Machine:
    """The figures of the mesh's devices: a planner target's (`ferry.xla.targets`) for an
    accelerator, a run's or a plan's compile-only one alike; nominal ones for a CPU."""
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        return Machine("cpu", CPU_MATMUL_RATE, CPU_BANDWIDTH, psutil.virtual_memory().total, nominal=True)
    name = accelerator_name(device.device_kind)
    target = TARGETS.get(name or "")
    bandwidth = getattr(target, "hbm_bandwidth", 0)
    if target is None or not bandwidth:
        raise ConfigError(
            f"train.loss_head=auto weighs the heads with a device's matmul rate and HBM bandwidth, and ferry has "
            f"none for a {device.device_kind}; set train.loss_head=chunked, fused or logits"
        )
    usable = int(target.hbm_bytes * (1 - target.hbm_headroom))
    return Machine(target.name, target.matmul_rate, float(bandwidth), usable)


@dataclasses.dataclass(frozen=True)
class HeadShape:
    """One micro step's loss head: `rows` x `seq` tokens over the mesh, width `dim`, `vocab` ids;
    the weight as the head reads it (its shape, logical axes, vocabulary axis, dtype)."""

    rows: int
    seq: int
    dim: int
    vocab: int
    compute_dtype: str
    weight_shape: tuple[int, ...]
    weight_axes: tuple[str | None, ...]
    vocab_axis: int
    z_loss_weight: float = 0.0

    @classmethod
    def of(cls, model: Any, rows: int, seq: int, compute_dtype: str, z_loss_weight: float = 0.0) -> "HeadShape":
        """The head of `model` (abstract or concrete) for a micro step of `rows` x `seq` tokens."""
        head = model.output_head()
        shape = tuple(head.weight.shape)
        dim = shape[1 - head.vocab_axis]
        return cls(rows, seq, dim, shape[head.vocab_axis], compute_dtype, shape, tuple(head.axes), head.vocab_axis,
                   z_loss_weight)  # fmt: skip

    def weight_dtype(self, head: LossHead) -> Any:
        """The weight's dtype in the step: the compute dtype for the whole logits or a tied head,
        else as stored (`ferry.train.step.compute_copy`)."""
        return jnp.dtype(self.compute_dtype) if head.kind == "logits" or self.vocab_axis == 0 else jnp.float32


@dataclasses.dataclass(frozen=True)
class HeadFacts:
    """What a candidate's compiled program says: temporaries (bytes per device), matmul FLOPs and
    HBM traffic (bytes) per call."""

    temp_bytes: int
    flops: float
    traffic: float


def candidates(setting: LossHead, shape: HeadShape, mesh: Mesh) -> dict[str, LossHead]:
    """The heads auto weighs: the whole logits, the fused head in one chunk (all of a device's
    logits in its budget; its kernel as set), the chunked head as set."""
    rows, columns = logits_share(shape.rows, shape.seq, shape.vocab, mesh)
    one_chunk = math.ceil(rows * shape.seq * columns * 4 / MIB)
    return {
        "fused": LossHead("fused", float(one_chunk), setting.weight_grad, setting.kernel),
        "logits": LossHead("logits", setting.chunk_mib, setting.weight_grad),
        "chunked": LossHead("chunked", setting.chunk_mib, setting.weight_grad),
    }


def lowered_head(head: LossHead, shape: HeadShape, mesh: Mesh) -> Any:
    """The head's loss and both gradients, lowered for one micro step on `mesh`: the hidden state
    and targets split as the batch is, the weight as its layer declares it."""
    batch = logical_spec(("batch",), ACTIVATION_RULES, mesh)
    rows = NamedSharding(mesh, PartitionSpec(*batch, None, None))
    tokens = NamedSharding(mesh, PartitionSpec(*batch, None))
    weight = NamedSharding(mesh, logical_spec(shape.weight_axes, PARAM_RULES, mesh))
    hidden = jax.ShapeDtypeStruct((shape.rows, shape.seq, shape.dim), jnp.dtype(shape.compute_dtype), sharding=rows)
    weights = jax.ShapeDtypeStruct(shape.weight_shape, shape.weight_dtype(head), sharding=weight)
    targets = jax.ShapeDtypeStruct((shape.rows, shape.seq), jnp.int32, sharding=tokens)

    def loss(h: jax.Array, w: jax.Array, t: jax.Array) -> jax.Array:
        return head(h, OutputHead(w, shape.weight_axes, shape.vocab_axis), t, shape.z_loss_weight)[0]

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weights, targets)


@dataclasses.dataclass(frozen=True)
class HeadFactsCache:
    """Compiled heads' facts on disk, one JSON file per program, keyed by the hash of its lowered
    text, the devices it was compiled for and the compiler's versions."""

    directory: Path

    @classmethod
    def default(cls) -> "HeadFactsCache":
        return cls(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "ferry" / "loss_head")

    def key(self, lowered: Any, mesh: Mesh) -> str:
        digest = hashlib.sha256(lowered.as_text().encode())
        devices = (mesh.devices.flat[0].device_kind, dict(mesh.shape), jax.__version__, jax.lib.__version__)
        digest.update(repr(devices).encode())
        return digest.hexdigest()

    def load(self, key: str) -> HeadFacts | None:
        try:
            return HeadFacts(**json.loads((self.directory / f"{key}.json").read_text()))
        except (OSError, ValueError, TypeError):  # absent or cut short: compiled afresh
            return None

    def store(self, key: str, facts: HeadFacts) -> None:
        """Written whole or not at all (a temporary file renamed)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.directory, suffix=".tmp", delete=False) as file:
            json.dump(dataclasses.asdict(facts), file)
        os.replace(file.name, self.directory / f"{key}.json")


def head_facts(head: LossHead, shape: HeadShape, mesh: Mesh, cache: HeadFactsCache | None) -> tuple[HeadFacts, bool]:
    """The candidate's compiled facts, and whether it was compiled (False: from the cache)."""
    lowered = lowered_head(head, shape, mesh)
    key = None if cache is None else cache.key(lowered, mesh)
    cached = None if cache is None or key is None else cache.load(key)
    if cached is not None:
        return cached, False
    compiled = lowered.compile()
    text = compiled.as_text()
    facts = HeadFacts(int(compiled.memory_analysis().temp_size_in_bytes), matmul_flops(text), memory_traffic(text))
    if cache is not None and key is not None:
        cache.store(key, facts)
    return facts, True


@dataclasses.dataclass(frozen=True)
class HeadChoice:
    """The head auto took (`head`), the facts and estimates it weighed, and how many programs it
    compiled (the others came from the cache)."""

    name: str
    head: LossHead
    machine: Machine
    budget_bytes: int
    facts: dict[str, HeadFacts]
    compiled: int

    def seconds(self, name: str) -> float:
        return self.machine.seconds(self.facts[name])

    def fits(self, name: str) -> bool:
        return self.facts[name].temp_bytes <= self.budget_bytes

    def why(self) -> str:
        """auto's reasons in words, for the start-up line: where, what fits, the estimates."""
        chosen = self.seconds(self.name)
        others = ", ".join(
            f"{name} {self.seconds(name) / chosen:.2f}"
            + ("" if self.fits(name) else f" over by {_gib(self.over(name))}")
            for name in CANDIDATES
            if name != self.name
        )
        figures = (
            f"nominal CPU figures, {self.machine.matmul_rate / 1e9:,.0f} GFLOP/s and "
            f"{self.machine.bandwidth / 1e9:,.0f} GB/s"
            if self.machine.nominal
            else f"a {self.machine.name}'s matmul rate and HBM bandwidth"
        )
        fit = (
            f"{_gib(self.facts[self.name].temp_bytes)} of temporaries within the {_gib(self.budget_bytes)} left for "
            "the head"
            if self.fits(self.name)
            else f"none of the heads fits the {_gib(self.budget_bytes)} left for the head; this one holds least"
        )
        return f"auto: {fit}; 1.00 vs {others} est. from the compiled heads with {figures}"

    def over(self, name: str) -> int:
        return self.facts[name].temp_bytes - self.budget_bytes


def _gib(n: int | float) -> str:
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.1f} MiB"


def choose_head(
    setting: LossHead,
    shape: HeadShape,
    mesh: Mesh,
    budget_bytes: int,
    cache: HeadFactsCache | None = None,
) -> HeadChoice:
    """auto's head for one micro step of `shape` on `mesh` with `budget_bytes` of HBM left for it
    per device (see the module); `setting`'s chunk, weight-gradient walk and kernel are the
    candidates'."""
    machine = machine_of(mesh)
    heads = candidates(setting, shape, mesh)
    facts, compiled = {}, 0
    for name, head in heads.items():
        facts[name], fresh = head_facts(head, shape, mesh, cache)
        compiled += fresh
    fitting = [name for name in CANDIDATES if facts[name].temp_bytes <= budget_bytes]
    if fitting:
        name = min(fitting, key=lambda n: machine.seconds(facts[n]))
    else:
        name = min(CANDIDATES, key=lambda n: facts[n].temp_bytes)
    return HeadChoice(name, heads[name], machine, budget_bytes, facts, compiled)
