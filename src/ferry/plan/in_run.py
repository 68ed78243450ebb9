"""`offload=auto` in a run: `python launch/run.py offload=auto` plans the step for the devices it
trains on (`ferry.plan.here`: a TPU or GPU the planner knows, or the CPU), trains with the pick,
and caches it under `run.root` (`<run.root>/.plans/<digest>.yaml`), keyed by the step's signature
(`step_signature`: everything that changes the compiled step). A second run of the same step reads
the cache and plans nothing.

The search is `mode=plan`'s (`ferry.plan.report.auto_pick`, its candidates compiled as
`StepRecipe` compiles the run's step), on the run's own devices instead of compile-only ones; its
best candidates are timed where `offload.auto.measure` says (by default on an accelerator, not on a
CPU), in this process, as `mode=plan` times them in their own. The pick is an offload preset
(`auto_<target>`), and it replaces `offload=auto` in the run's config: config.yaml and the
start-up line name it, so the run's checkpoints record the step it trained.

A cache file that cannot be read, or that holds another step's plan (a copy, a rename), is said in
one line and planned over: the cache is derived, and a run never trains from a file it cannot
read."""

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import jax
import jaxlib
import yaml
from rich.console import Console

from ferry.config.root import FerryConfig, check_mesh_shape, load_config
from ferry.config.train import OffloadConfig
from ferry.config_schema import from_dict
from ferry.errors import ConfigError, FerryError
from ferry.models.registry import abstract_model
from ferry.offload.schedule import format_bytes
from ferry.plan.advice import step_identity
from ferry.plan.auto import PEEL, Choice, Tried, fits_with_headroom
from ferry.plan.auto_measure import MeasuredPick, candidate_run
from ferry.plan.here import CPU, this_machine
from ferry.plan.measure import Measurement, StepTimer, measure_train_step
from ferry.plan.report import PlanCompiler, auto_pick, auto_preset_text
from ferry.xla.targets import Target

PLANS = ".plans"  # under run.root: one file per planned step
# train.* keys that change no compiled step's shapes, operations or memory: when to stop, log and
# evaluate, the seed, and the update's constants (numbers in the program, not its shape)
NOT_IN_STEP = (
    "steps",
    "learning_rate",
    "warmup_steps",
    "min_learning_rate_ratio",
    "weight_decay",
    "adam_b1",
    "adam_b2",
    "adam_eps",
    "grad_clip_norm",
    "seed",
    "log_every",
    "eval_every",
    "eval_batches",
    "check_policy",
)


def _json(value: Any) -> Any:
    """`value` as plain JSON values (tuples as lists, anything else as its text)."""
    return json.loads(json.dumps(value, default=str))


def step_signature(config: FerryConfig) -> dict[str, Any]:
    """Everything that changes the compiled step of a run of `config` on this machine, as JSON
    values: the model, batch, sequence, mesh and state placement (`step_identity`), the train
    settings but `NOT_IN_STEP`, the offload settings (auto's too), what of the data shapes the step,
    the platform's flags, the devices (their kind, count and runtime), and JAX's version."""
    devices = jax.devices()
    train = {k: v for k, v in dataclasses.asdict(config.train).items() if k not in NOT_IN_STEP}
    data = config.data
    mask = {"tokenizer": data.tokenizer, "eos_token": data.eos_token} if data.document_mask else {}
    return _json(
        {
            "step": step_identity(config),
            "train": train,
            "offload": dataclasses.asdict(config.offload),
            "data": {"format": data.format, "document_mask": data.document_mask} | mask,
            "platform": {"name": config.platform.name, "xla_flags": dict(config.run_platform.xla_flags)},
            "devices": {
                "kind": devices[0].device_kind,
                "count": len(devices),
                "processes": jax.process_count(),
                "runtime": devices[0].client.platform_version,
            },
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
        }
    )


def cache_path(root: Path, signature: Mapping[str, Any]) -> Path:
    """Where the plan of the step `signature` describes is cached under `run.root`."""
    digest = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]
    return root / PLANS / f"{digest}.yaml"


class CacheUnreadable(FerryError):
    """A cached plan that is not one (`read_cache`): said, and planned over."""


def read_cache(path: Path, signature: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cached plan at `path` (its `offload` node and how it was `planned`), None where there is
    none; a file that is not a plan of this very step is `CacheUnreadable`, saying why."""
    if not path.exists():
        return None
    try:
        record = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise CacheUnreadable(f"not readable YAML ({' '.join(str(error).split())[:120]})") from error
    if not isinstance(record, dict) or not all(isinstance(record.get(key), dict) for key in ("offload", "planned")):
        raise CacheUnreadable("it holds no offload preset and record of its planning")
    if record.get("signature") != signature:
        raise CacheUnreadable("it holds the plan of another step")
    try:
        from_dict(OffloadConfig, record["offload"], f"the cached plan {path}")
    except ConfigError as error:
        raise CacheUnreadable(str(error)) from error
    return record


def write_cache(path: Path, signature: Mapping[str, Any], offload: Mapping[str, Any], planned: Mapping[str, Any]):
    """The plan, written whole or not at all (a run reading it meanwhile sees the old or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# offload=auto's plan of one step, made by a run on {planned['device']} (ferry.plan.in_run)\n"
    text += yaml.safe_dump(
        {"planned": dict(planned), "offload": dict(offload), "signature": dict(signature)},
        sort_keys=False,
        width=1000,
    )
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


@dataclasses.dataclass(frozen=True)
class PlanTimes:
    """Where a run's planning time went, in seconds."""

    total: float
    compiles: int  # candidates compiled (`Tried`)
    compile: float  # their compiles
    timed: int  # candidates timed on the devices
    timing: float  # their compiles and steps

    def line(self, where: str, why_timed: str) -> str:
        rest = self.total - self.compile - self.timing
        timed = f"timed {self.timed} in {self.timing:.1f} s" if self.timed else "timed none"
        return (
            f"offload=auto: planned for {where} in {self.total:.1f} s: compiled {self.compiles} candidates in "
            f"{self.compile:.1f} s, {timed} ({why_timed}), the search and its traces {rest:.1f} s"
        )


def timing_here(config: FerryConfig, target: Target) -> tuple[bool, str]:
    """Whether the run times the search's best candidates on its devices, and why in words."""
    measure = config.offload.auto.measure
    if measure is False:
        return False, "offload.auto.measure=false"
    if jax.process_count() > 1:  # each process would time its own steps, and might choose otherwise
        return False, "a run of several processes is planned by the estimate alone"
    if measure is None and target.platform == CPU:
        return False, "offload.auto.measure=true times them on a CPU too"
    return True, f"offload.auto.measure: the best {config.offload.auto.candidates} that fit, on this machine"


def in_process_measurer(
    config: FerryConfig, node: Mapping[str, Any], spent: list[float]
) -> Callable[[int, Tried], Measurement]:
    """Time a candidate as the run it would be, in this process (its devices are this run's);
    the seconds each takes are appended to `spent`."""

    def no_preset(name: str) -> OffloadConfig:
        raise AssertionError(f"a run's plan compiles no preset ({name})")

    run_node = candidate_run(config, node, config.platform, no_preset)
    settings = config.offload.auto
    timer = StepTimer(settings.warmup_steps, settings.steps)

    def measure(number: int, candidate: Tried) -> Measurement:
        start = time.perf_counter()
        try:
            return measure_train_step(load_config(run_node(number, candidate)), timer)
        finally:
            spent.append(time.perf_counter() - start)

    return measure


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """offload=auto's pick for a run: the offload node it trains with, and its start-up line."""

    offload: dict[str, Any]
    line: str


def plan_for_run(config: FerryConfig, node: Mapping[str, Any], say: Callable[[str], None]) -> RunPlan:
    """The offload preset a run of `config` (`offload=auto`, its resolved config `node`) trains
    with: the cached plan of this step under run.root, else this machine's plan of it, cached."""
    check_mesh_shape(config)  # a refusal before any compile
    signature = step_signature(config)
    path = cache_path(Path(config.run.root), signature)
    try:
        cached = read_cache(path, signature)
    except CacheUnreadable as error:
        say(f"offload=auto: the cached plan {path} is not used ({error}); planning again")
        cached = None
    if cached is not None:
        offload, chose = cached["offload"], cached["planned"].get("chose", "")
        return RunPlan(offload, f"offload=auto: the plan cached at {path}, no planning: offload: {chose}")
    offload, planned = plan_here(config, node, say)
    if jax.process_index() == 0:
        write_cache(path, signature, offload, planned)
    return RunPlan(offload, f"offload: {planned['chose']}; cached at {path}")


def plan_here(
    config: FerryConfig, node: Mapping[str, Any], say: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This machine's plan of the step: the offload node of the pick, and how it was planned."""
    try:
        target = this_machine(config.train.compute_dtype)
    except ValueError as error:
        raise ConfigError(f"offload=auto plans for this machine, and {error}: name a preset (offload=NAME)") from error
    where = "this CPU" if target.platform == CPU else f"{config.mesh.num_devices} x {target.name}"
    if target.platform == CPU:
        say("offload=auto: this machine is a CPU, so the plan is the CPU's (device or remat per tensor), not a chip's")
    timing, why_timed = timing_here(config, target)
    spent: list[float] = []
    measure_one = in_process_measurer(config, node, spent) if timing else None
    tagged = abstract_model(config.model).tagged_names()
    compiler = PlanCompiler(config, target, config.platform, tagged, Console(quiet=True))
    start = time.perf_counter()
    plan, choices, tried, measured = auto_pick(compiler, {}, [], measure_one)
    times = PlanTimes(
        time.perf_counter() - start,
        len(compiler.compiled),
        sum((p.compile_seconds for p in compiler.compiled.values()), 0.0),
        len(spent),
        sum(spent, 0.0),
    )
    say(times.line(where, why_timed))
    how = _how(tried, measured)
    text = auto_preset_text(plan, choices, f"chosen by offload=auto in a run: {how}", config, measured)
    offload = cast(dict[str, Any], yaml.safe_load(text))
    moved = ", ".join(f"{c.name}={c.placement}" for c in choices if _departs(c))
    fits = "fits" if fits_with_headroom(plan) else "the closest to fitting: nothing compiled fits"
    chose = (
        f"{offload['name']} (offload=auto's plan for {where}: {moved or 'every tagged tensor on the device'}; "
        f"{format_bytes(plan.device_bytes)} of {format_bytes(plan.capacity_bytes)} per device, {fits}; {how})"
    )
    planned = {
        "device": target.description,
        "chose": chose,
        "seconds": round(times.total, 3),
        "compiled": times.compiles,
        "compile_seconds": round(times.compile, 3),
        "timed": times.timed,
        "timing_seconds": round(times.timing, 3),
    }
    return offload, planned


def _departs(choice: Choice) -> bool:
    """A choice other than keeping a tensor the backward pass reads on the device, in its loop."""
    if choice.name == PEEL:
        return choice.placement != "0"
    return choice.placement != "device" and choice.bytes > 0


def _how(tried: list[Tried], measured: MeasuredPick | None) -> str:
    if measured is not None and measured.pick is not None:
        return measured.reason
    fitting = sum(1 for t in tried if t.fits)
    return f"the fastest estimate of the {fitting} compiled candidate(s) that fit"
