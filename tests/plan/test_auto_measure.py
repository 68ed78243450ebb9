"""offload=auto that measures (`ferry.plan.auto_measure`, `ferry.plan.measure`): the search's best
candidates are run on the real train step, timed with an injectable clock, and the fastest that
fits the device is chosen and recorded in offload_auto.yaml. On this CPU a fake clock decides
which candidate is "fastest"; the steps themselves really compile and run."""

import dataclasses
import functools
import io
import itertools
from unittest import mock

import jax
import pytest
import yaml
from rich.console import Console

from ferry.config.root import load_config
from ferry.config.train import AutoMeasureConfig, OffloadConfig
from ferry.config_schema import from_dict
from ferry.errors import ConfigError
from ferry.plan import auto, auto_measure, report
from ferry.plan.auto import PEEL
from ferry.plan.auto_measure import candidate_run, resolve_measure, subprocess_measurer
from ferry.plan.auto_search import MIN_GAIN
from ferry.plan.measure import (
    MeasureError,
    Measurement,
    StepTimer,
    accelerator_present,
    measure_in_subprocess,
    measure_train_step,
)
from ferry.plan.memory_plan import MemoryPlan
from ferry.plan.planner import plan_memory
from ferry.plan.report import run_plan, write_plan
from ferry.plan.transfers import TransferSummary
from ferry.run import compile_ahead as compile_ahead_module
from ferry.run.compile_ahead import subprocess_compiler
from ferry.run.policy_check import one_device_mesh
from ferry.xla.targets import TARGETS
from tests.conftest import CONFIGS, compose_config, load_platform, load_preset, needs_cuda_plugin, run_launcher

# llama_tiny at 256 tokens on an H200 (1 GiB of it): everything fits, so the search's candidates are
# its all-on-device one, its peeled twin (where the plan measures), and the two presets planned
# beside it, ranked by estimate in that order (minimal_offloaded's copies are exposed under
# llama_tiny's microseconds of compute)
PLANNED = (
    "model=llama_tiny",
    "offload=auto",
    "train.seq_len=256",
    "mode=plan",
    "target=h200",
    "plan.capacity_gib=1",
    "plan.presets=[full_remat,minimal_offloaded,auto]",
)


def fake_clock(step_seconds: float):
    """A clock that advances `step_seconds` between any two readings: every timed step takes that."""
    ticks = itertools.count(0.0, step_seconds)
    return lambda: next(ticks)


def test_the_timer_times_each_step_after_the_warm_up_with_its_clock():
    ran = []
    readings = iter([10.0, 10.5, 20.0, 20.25, 30.0, 31.0])
    timer = StepTimer(warmup_steps=2, steps=3, clock=lambda: next(readings))
    timing = timer.time(lambda x: ran.append(x) or x, lambda: len(ran))
    assert ran == [0, 1, 2, 3, 4]  # 2 untimed, 3 timed; each input made before its step
    assert timing.seconds == (0.5, 0.25, 1.0) and timing.median == 0.5


def test_measuring_is_on_where_the_targets_accelerator_is_and_refused_where_asked_without_it():
    assert resolve_measure(AutoMeasureConfig(), "tpu", "tpu")[0]
    assert not resolve_measure(AutoMeasureConfig(), "tpu", None)[0]  # a CPU-only machine: the estimate
    assert not resolve_measure(AutoMeasureConfig(), "gpu", "tpu")[0]  # another chip says nothing of the target
    assert not resolve_measure(AutoMeasureConfig(measure=False), "tpu", "tpu")[0]
    with pytest.raises(ConfigError, match="offload.auto.measure=true .* has no accelerator"):
        resolve_measure(AutoMeasureConfig(measure=True), "tpu", None)
    from tests.run.test_cpu_only import matching

    assert accelerator_present({}, matching("/dev/vfio/2", "/dev/vfio/vfio"), list) == "tpu"  # the v5e VM
    assert accelerator_present({}, matching("/dev/nvidia0"), list) == "gpu"
    assert accelerator_present({"JAX_PLATFORMS": "cpu"}, matching("/dev/vfio/2"), list) is None
    assert accelerator_present({}, matching("/dev/vfio/vfio"), list) is None
    with pytest.raises(ConfigError, match="offload.auto.steps must be at least 1"):
        from_dict(OffloadConfig, {"auto": {"steps": 0}}, "offload")


def compose_node(*overrides: str) -> dict:
    """The resolved config node `python launch/run.py OVERRIDES...` would load."""
    from omegaconf import OmegaConf

    from ferry.config.overrides import hydra_compose

    return OmegaConf.to_container(hydra_compose(CONFIGS, "train", list(overrides)), resolve=True)


_plans = {}


def plan_once(*args):
    """`plan_memory`, each program compiled once for both of `measured_plan`'s runs: measuring or not,
    run_plan compiles the same presets and auto candidates of PLANNED (the second run took 16 s)."""
    key = repr(args)  # the XLA flags are a dict
    if key not in _plans:
        _plans[key] = plan_memory(*args)
    return _plans[key]


@functools.cache
def measured_plan(fastest: int | None):
    """mode=plan offload=auto of PLANNED measured as the launcher measures (`subprocess_measurer`:
    each candidate a run of the launcher's config node with the candidate's offload and the target's
    platform), but in this process and on its CPU: the candidate the search ranks `fastest` (from 0)
    takes 1 ms a step by the fake clock, the others 5 ms, except the one it ranks first, which is over
    the device's memory (given as one byte) and dropped untimed. None: measuring off. The
    candidates are compiled ahead first as on a TPU (`subprocess_compiler`), its processes faked.
    Returns the config, run_plan's result, the offload presets timed (each compiled ahead listed
    before as "compiled NAME") and the output."""
    config = compose_config(*PLANNED)
    console = Console(file=io.StringIO(), width=250)
    timed = []

    def compile_here(nodes, target):  # what the compiling processes would compile
        assert target == "v5e" and all(node["mode"] == "train" and node["target"] is None for node in nodes)
        timed.extend(f"compiled {node['offload']['name']}" for node in nodes)
        return [f"compiled the train step for 1 x TPU v5e ({node['offload']['name']})" for node in nodes]

    def measure_here(node, timer):  # what the measuring process would run, on this CPU
        assert node["platform"]["name"] == "gpu" and node["mode"] == "train"  # as a run on the target
        run = load_config({**node, "platform": {"name": "cpu"}})
        rank = len([t for t in timed if not t.startswith("compiled ")])
        timed.append(run.offload.name)
        clock = fake_clock(1e-3 if rank == fastest else 5e-3)
        capacity = 1 if rank == 0 else None
        timer = dataclasses.replace(timer, clock=clock)
        return measure_train_step(run, timer, one_device_mesh(jax.devices()[0]), capacity_bytes=capacity)

    measure_one = compile_ahead = None
    if fastest is not None:
        run_node = candidate_run(config, compose_node(*PLANNED), load_platform("gpu"), load_preset)
        measure_one = subprocess_measurer(run_node, config.offload.auto)
        compile_ahead = subprocess_compiler(run_node, "v5e")
    with (
        mock.patch.object(auto_measure, "measure_in_subprocess", measure_here),
        mock.patch.object(compile_ahead_module, "compile_in_subprocesses", compile_here),
        mock.patch.object(report, "plan_memory", plan_once),
    ):
        result = run_plan(config, load_preset, load_platform, console, measure_one, compile_ahead)
    return config, result, timed, console.file.getvalue()


@needs_cuda_plugin
def test_auto_picks_the_fastest_measured_candidate_and_says_why_in_its_preset(tmp_path):
    """Measuring, auto compiles the all-on-device program's peeled twin though its loop fits (1 of
    llama_tiny's 2 layers out of the loop; unmeasured it does not: the test below), times it
    beside the loop, and picks it where it runs fastest: the preset it writes trains peeled."""
    config, (plans, choices, measured), timed, output = measured_plan(1)
    names = [f"auto_candidate_{c.number}" if c.source == "auto" else c.source for c in measured.candidates]
    # the search's best three, best first, compiled ahead all at once before any is timed
    assert timed == [f"compiled {name}" for name in names] + names and len(names) == config.offload.auto.candidates == 3
    assert "compiling 3 candidates ahead" in output and output.count("compiled the train step for 1 x TPU v5e") == 3
    estimates = [c.predicted_seconds for c in measured.candidates]
    assert estimates == sorted(estimates) or max(estimates) <= (1 + MIN_GAIN) * min(estimates)  # ties: the worst
    first, twin, third = measured.candidates
    assert (first.number, twin.number) == (1, 2) and dict(twin.values) == dict(first.values) | {PEEL: "1"}
    assert third.source == "full_remat" and third.measurement.step_seconds == pytest.approx(5e-3)
    assert measured.pick == twin and "the estimate ranked it 2 of 3" in measured.reason
    assert not first.measurement.fits and "of the device's" in first.measurement.reason
    assert first.measurement.step_seconds is None  # dropped untimed
    assert set(first.values.values()) == {"device"}  # the search's own pick (measuring off keeps it)
    placements = {c.name: c.placement for c in choices}
    assert {name: placements[name] for name in twin.values} == twin.values != first.values
    why = "measured: the fastest measured step (1.00 ms"
    assert all(c.reason.startswith(why) for c in choices if c.name in twin.values)
    assert plans[-1].policy == "auto" and plans[-1].device_bytes == twin.predicted_bytes
    assert "candidates MEASURED on this machine" in output and "PICK" in output
    written_path = write_plan(plans, choices, tmp_path, compose_config(*PLANNED), measured)[1]
    written = yaml.safe_load(written_path.read_text())
    record = written["measured"]
    assert record["pick"] == twin.number and record["device"] == jax.devices()[0].device_kind
    assert [c["candidate"] for c in record["candidates"]] == [c.number for c in measured.candidates]
    assert record["candidates"][1]["off_device"] == {PEEL: "1"}
    for entry, step in zip(record["candidates"], (None, 1e-3, 5e-3), strict=True):
        assert entry["predicted_step_s"] > 0 and entry["device_bytes"] > 0 and entry["reason"]
        assert entry["measured_step_s"] == (None if step is None else pytest.approx(step))
    preset = from_dict(OffloadConfig, written, "offload_auto.yaml")  # still a preset a run trains with
    tensors = {k: v for k, v in twin.values.items() if not k.startswith("offload.")}
    assert {k: preset.tensors[k] for k in tensors} == tensors and PEEL not in preset.tensors
    assert (preset.optimizer, preset.params) == (twin.values["offload.optimizer"], twin.values["offload.params"])
    assert preset.peel == 1  # trains as it was timed


@needs_cuda_plugin
def test_with_measuring_off_auto_keeps_the_searchs_pick(tmp_path):
    """The same plan unmeasured keeps the search's pick, the first-ranked candidate (everything on
    device, which measuring above dropped), and its preset records no measurement. Its loop fits,
    so it compiles no peeled twin: the estimate cannot tell the two apart."""
    _, (plans, choices, measured), timed, output = measured_plan(None)
    assert measured is None and timed == [] and "MEASURED" not in output
    assert "offload.peel=1" not in output and "(all on device)" in output  # the candidate table: no twin
    placements = {c.name: c.placement for c in choices}
    assert placements.pop("mlpwo") == "remat"  # never read by the backward pass: no decision
    assert set(placements.values()) == {"device"}
    written = yaml.safe_load(write_plan(plans, choices, tmp_path)[1].read_text())
    assert "measured" not in written and "estimated" in write_plan(plans, choices, tmp_path)[1].read_text()


def fake_compiler(config):
    """`report.PlanCompiler` for `report.auto_pick` with its compile faked (its `asked`: the policies
    compiled): every program is 1 GFLOP and 2 bytes of temporaries, but a peeled one
    (`offload.peel`), which is 1 byte and 0.1% more FLOPs, a hair slower by the estimate (a tie
    within `MIN_GAIN`, which the worst estimate breaks)."""
    from ferry.models.registry import abstract_model

    tagged = abstract_model(config.model).tagged_names()
    compiler = report.PlanCompiler(
        config, TARGETS[config.target], load_platform("tpu"), tagged, Console(file=io.StringIO())
    )
    compiler.asked = []

    def compile_at(policy, name, state, depths=None):
        compiler.asked.append(policy)
        return MemoryPlan(
            target="v5e", mesh="one", policy=name, argument_bytes=1, output_bytes=0, alias_bytes=0,
            temp_bytes=1 if policy.peel else 2, host_bytes=0, flops=1e9 * (1.001 if policy.peel else 1.0),
            matmuls=1, capacity_bytes=2**40, host_capacity_bytes=None, compile_options=(), transfers=(),
            transfer_summary=TransferSummary(0, 0, 0.0, 0.0, 0.0), compile_seconds=0.0, matmul_rate=1e12,
        )  # fmt: skip

    compiler.compile_at = compile_at
    return compiler


def test_measuring_auto_times_the_peeled_twin_beside_its_fitting_loop_beyond_the_count(monkeypatch):
    """`report.auto_pick` with `measure_one` compiles the all-on-device program's peeled twin though the
    loop fits, and times it with its loop although `offload.auto.candidates=1` and the estimate
    ranks it second; where the fake timer makes it faster it is the pick, with its peel. Without
    `measure_one` (a deviceless plan) the loop fits and no twin is compiled. Nothing compiles."""
    monkeypatch.setattr(report, "compile_only_mesh", lambda target, mesh: one_device_mesh(jax.devices()[0]))
    traced = {}  # llama_tiny's costs, traced once (3 s) for the three times the two plans ask
    costs = auto.tensor_costs
    monkeypatch.setattr(auto, "tensor_costs", lambda *args: traced.get(0) or traced.setdefault(0, costs(*args)))
    config = compose_config(
        "model=llama_tiny", "offload=auto", "train.seq_len=64", "mode=plan", "target=v5e", "offload.auto.candidates=1"
    )
    timed = []

    def measure_one(number, candidate):
        timed.append(number)
        return Measurement(True, "timed", step_seconds=0.9 if PEEL in candidate.values else 1.0)

    compiler = fake_compiler(config)
    plan, choices, tried, measured = report.auto_pick(compiler, {}, [], measure_one)
    assert [p.peel for p in compiler.asked[:2]] == [0, 1]  # the loop, then its twin
    loop, twin = tried[:2]
    assert dict(twin.values) == dict(loop.values) | {PEEL: "1"} and loop.fits and twin.fits
    assert [number for number, _ in auto_measure.ranked_candidates(tried, 1)] == timed == [1, 2]  # beyond the count
    assert measured.pick.number == 2 and "ranked it 2 of 2" in measured.reason
    assert plan.temp_bytes == 1 and {c.name: c.placement for c in choices}[PEEL] == "1"
    # a twin rides along with its loop only: where the loop is not timed, neither is it
    faster = dataclasses.replace(loop, values={**loop.values, "mlpwi_0": "remat"})
    faster = dataclasses.replace(faster, plan=dataclasses.replace(loop.plan, flops=0.5e9))
    assert [n for n, _ in auto_measure.ranked_candidates([loop, twin, faster], 1)] == [3]
    assert [n for n, _ in auto_measure.ranked_candidates([loop, twin, faster], 2)] == [3, 1, 2]

    deviceless = fake_compiler(config)
    plan, choices, tried, measured = report.auto_pick(deviceless, {}, [], None)
    assert measured is None and tried[0].fits and all(p.peel == 0 for p in deviceless.asked)
    assert all(PEEL not in t.values for t in tried) and PEEL not in {c.name for c in choices}


def test_the_measuring_process_times_a_run_on_this_machine_and_refuses_a_mesh_it_lacks():
    """`measure_in_subprocess` runs a resolved config in a fresh process (here on the CPU) and
    reads back its measurement; a mesh of devices the machine lacks is a refusal."""
    node = compose_node("model=llama_tiny", "train.seq_len=32", "train.global_batch_size=2")
    measured = measure_in_subprocess(node, StepTimer(1, 2), timeout_s=300.0)
    assert measured.fits and measured.step_seconds > 0 and len(measured.step_times) == 2
    assert measured.device_kind == "cpu" and measured.device_bytes > 0
    with pytest.raises(MeasureError, match="mesh"):
        measure_in_subprocess({**node, "mesh": {**node["mesh"], "fsdp": 2}}, StepTimer(0, 1), timeout_s=300.0)


@needs_cuda_plugin  # without the plan extra an H200 plan is refused first, naming the extra
def test_the_launcher_refuses_measuring_asked_for_on_a_machine_without_the_targets_chip():
    """At once, before any compile."""
    result = run_launcher("mode=plan", "target=h200", "offload=auto", "offload.auto.measure=true")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "offload.auto.measure=true times the candidates on this machine's GPU" in result.stdout
    assert "compiling" not in result.stdout


@needs_cuda_plugin
def test_the_launcher_leaves_measuring_off_on_a_cpu(tmp_path):
    result = run_launcher(
        "mode=plan",
        "target=h200",
        "model=llama_tiny",
        "offload=auto",
        "plan.presets=[auto]",
        "train.seq_len=64",
        f"run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "offload.auto.measure: off (this machine has no accelerator)" in result.stdout
    written = yaml.safe_load((tmp_path / "run" / "offload_auto.yaml").read_text())
    assert "measured" not in written and set(written["tensors"].values()) >= {"device"}


def test_the_measured_step_is_the_runs_own_loss_head_included(monkeypatch):
    """A candidate is timed on the step its run trains (its `StepRecipe`), so what auto measures
    is what the pick runs: with `train.loss_head=logits` the measured step holds the logits too
    (it once took the default head whatever the config said)."""
    from ferry.train import recipe

    class Built(Exception):
        pass

    seen = []

    def body(optimizer, settings, *rest):
        seen.append(settings)
        raise Built  # the step as built is all this asks; nothing compiles

    monkeypatch.setattr(recipe, "train_step_body", body)
    config = compose_config("model=llama_tiny", "train.loss_head=logits", "train.seq_len=32")
    with pytest.raises(Built):
        measure_train_step(config, StepTimer(0, 1), one_device_mesh(jax.devices()[0]))
    assert seen[0].head == config.train.head and seen[0].head.kind == "logits"
