"""`platform.host_offload_flags`: a TPU run that copies to pinned host gets libtpu's host-offload
scheduling flags; a run that copies nothing keeps its flags as they were."""

import dataclasses

import jax
import pytest
import yaml
from rich.console import Console

from ferry.config.overrides import compose_node
from ferry.config.root import load_config
from ferry.config.train import DEVICE_STATE, OffloadConfig
from ferry.config_schema import from_dict
from ferry.offload.engine import Policy
from ferry.plan import report
from ferry.plan.auto import Tried, auto_plan
from ferry.plan.auto_measure import candidate_offload
from ferry.plan.auto_search import Prediction
from ferry.plan.estimate import StepEstimate
from ferry.plan.memory_plan import MemoryPlan
from ferry.plan.transfers import TransferSummary
from ferry.run.policy_check import one_device_mesh
from ferry.xla.targets import TARGETS
from tests.conftest import CONFIGS, load_platform, load_preset

MODEL = ("model=llama_tiny", "platform=tpu")


def config_of(*overrides: str):
    return load_config(compose_node("train", [*MODEL, *overrides], CONFIGS))


@pytest.mark.parametrize(
    "overrides",
    [
        ("offload=minimal_offloaded",),
        ("offload=qkv_offload",),
        ("offload=full_remat", "offload.optimizer=host"),
        ("offload=minimal", "offload.tensors.mlpwi_0=offload"),
    ],
)
def test_a_run_that_copies_to_host_gets_them(overrides):
    flags = config_of(*overrides).run_platform.xla_flags
    expected = load_platform("tpu").host_offload_flags
    assert expected and all(flags[name] == value for name, value in expected.items())
    assert flags["xla_tpu_enable_latency_hiding_scheduler"] is True  # the platform's own flags stay


@pytest.mark.parametrize("preset", ["full_remat", "minimal", "save_all"])
def test_a_run_that_copies_nothing_keeps_its_flags(preset):
    assert config_of(f"offload={preset}").run_platform.xla_flags == load_platform("tpu").xla_flags


def test_the_runs_own_flag_wins_and_another_platform_has_none():
    flags = config_of(
        "offload=minimal_offloaded", "platform.xla_flags.xla_tpu_host_transfer_overlap_limit=4"
    ).run_platform.xla_flags
    assert flags["xla_tpu_host_transfer_overlap_limit"] == 4
    cpu = load_config(compose_node("train", ["model=llama_tiny", "offload=minimal_offloaded"], CONFIGS))
    assert not cpu.platform.host_offload_flags and cpu.run_platform == cpu.platform


def test_a_plan_compiles_each_policy_with_the_flags_its_run_would_get(monkeypatch):
    """mode=plan target=v5e: a preset that copies is compiled with the host-offload flags, one
    that does not without them (the flags a run of each gets), each program once."""
    seen = []
    plan = MemoryPlan(
        target="v5e", mesh="one", policy="p", argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0,
        host_bytes=0, flops=1.0, matmuls=1, capacity_bytes=1, host_capacity_bytes=None, compile_options=(),
        transfers=(), transfer_summary=TransferSummary(0, 0, 0.0, 0.0, 0.0), compile_seconds=0.0,
    )  # fmt: skip
    monkeypatch.setattr(report, "plan_memory", lambda *args: seen.append(args[5]) or plan)
    config = load_config(compose_node("train", ["model=llama_tiny", "mode=plan", "target=v5e"], CONFIGS))
    compiler = report.PlanCompiler(config, TARGETS["v5e"], load_platform("tpu"), frozenset({"mlpwi_0"}), Console())
    host = load_platform("tpu").host_offload_flags
    offloads, remats = Policy.from_dict({"mlpwi_0": "offload"}), Policy.from_dict({"mlpwi_0": "remat"})
    peeled = Policy.from_dict({"mlpwi_0": "offload"}, peel=1)
    for policy in (offloads, remats, offloads, peeled):
        compiler.compile_policy(policy, "p", DEVICE_STATE)
    assert len(seen) == 3  # the same policy compiles once; another peel is another program
    assert all(seen[0][name] == value for name, value in host.items()) and seen[2] == seen[0]
    assert not set(host) & set(seen[1]) and seen[1]["xla_tpu_enable_latency_hiding_scheduler"] is True


def test_auto_compiles_writes_and_times_its_candidates_with_the_runs_peel(tmp_path):
    """offload=auto chooses placements; the run's pipelining, peel, engine and state stream
    (`offload.peel=1`, `offload.stream_mib=64`) go into every candidate it compiles, into the
    candidates it times, and into offload_auto.yaml."""
    overrides = ["model=llama_tiny", "mode=plan", "target=v5e", "offload=auto", "offload.peel=1"]
    overrides.append("offload.stream_mib=64")
    config = load_config(compose_node("train", overrides, CONFIGS))
    compiled = []

    def compile_policy(policy, name):
        compiled.append(policy)
        return MemoryPlan(
            target="v5e", mesh="one", policy=name, argument_bytes=1, output_bytes=0, alias_bytes=0,
            temp_bytes=len(compiled), host_bytes=0, flops=1e9, matmuls=1, capacity_bytes=2**40,
            host_capacity_bytes=None, compile_options=(), transfers=(),
            transfer_summary=TransferSummary(0, 0, 0.0, 0.0, 0.0), compile_seconds=0.0, matmul_rate=1e12,
        )  # fmt: skip

    plan, choices, tried = auto_plan(config, TARGETS["v5e"], one_device_mesh(jax.devices()[0]), compile_policy)
    assert compiled and all(p.peel == 1 and p.pipelined and p.engine == "ferry" for p in compiled)
    values = {"mlpwi_0": "offload", "offload.optimizer": "device", "offload.params": "device"}
    estimate = StepEstimate(1.0, 0.0, 0.0, 0.0)
    search = Tried(values, Prediction((), 0.0, 0.0, estimate), dataclasses.replace(plan, policy="auto"))
    node = candidate_offload(1, search, config, load_preset)
    assert node["peel"] == 1 and node["tensors"] == {"mlpwi_0": "offload"} and node["stream_mib"] == 64
    written = yaml.safe_load(report.write_plan([plan], choices, tmp_path, config)[1].read_text())
    assert written["peel"] == 1 and written["pipelined"] is True and written["engine"] == "ferry"
    assert written["stream_mib"] == 64
    preset = from_dict(OffloadConfig, written, "offload_auto.yaml")  # still a preset a run trains with
    assert preset.peel == 1 and preset.state_placement.stream_mib == 64
