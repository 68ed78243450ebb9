"""ferry's cost model handed to XLA:GPU's latency-hiding scheduler (`ferry.xla.scheduler_costs`):
every instruction the scheduler orders gets a time from the compiled program and the target, and
with them the scheduler hides the reloads its own fixed estimates leave exposed on an FSDP mesh."""

import collections
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import ferry.xla.scheduler_costs as scheduler_costs
from ferry.models.registry import abstract_model
from ferry.plan.copy_match import DEAD
from ferry.plan.planner import compile_config_step, compile_only_mesh, plan_memory
from ferry.platform import PlatformConfig
from ferry.xla.hlo_collectives import collectives
from ferry.xla.hlo_host_copies import host_copies
from ferry.xla.hlo_schedule import scheduled_instructions
from ferry.xla.scheduler_costs import (
    COLLECTIVE_LATENCY_US,
    CostProfile,
    ProfileCache,
    SchedulerCostsError,
    compile_with_costs,
    cost_profile,
    scheduler_target,
)
from ferry.xla.targets import TARGETS
from tests.conftest import GPU_FLAGS, compose_config, needs_cuda_plugin

H200 = TARGETS["h200"]


def planned(model: str, preset: str, *overrides: str, costs: bool = False, xla_flags=None, cache=None):
    # ferry's own attention and the whole-logits head, with which these schedules were measured (auto
    # is cuDNN's on an H200; the chunked head adds two logits matmuls to the step's compute)
    config = compose_config(
        f"model={model}", f"offload={preset}", "model.attention=xla", "train.loss_head=logits", *overrides
    )
    policy = config.offload.policy(abstract_model(config.model).tagged_names())
    flags = GPU_FLAGS | (xla_flags or {})
    return plan_memory(config, H200, policy, preset, xla_flags=flags, scheduler_costs=costs, costs_cache=cache)


def compiled_and_scheduled(tmp_path):
    """llama_tiny's train step on 2 compile-only H200s (FSDP), its layer inputs offloaded: the final
    program and the module XLA's scheduler received (its dump before `latency-hiding-scheduler`)."""
    dump = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_pass_re": "latency-hiding-scheduler"}
    planned("llama_tiny", "decoder_input_offload", "train.seq_len=256", "mesh.fsdp=2", xla_flags=dump)
    (scheduled,) = tmp_path.glob("*before_latency-hiding-scheduler.txt")
    (final,) = tmp_path.glob("*gpu_after_optimizations.txt")
    return final.read_text(), scheduled.read_text()


@needs_cuda_plugin
def test_every_instruction_the_scheduler_orders_is_priced_from_the_program(tmp_path):
    final, scheduled = compiled_and_scheduled(tmp_path)
    profile = cost_profile(scheduled, H200)
    assert profile.unpriced(scheduled) == []
    # read from the final program by the planner's own parser: the host copies take their bytes
    # over the host link, the collectives their ring bytes over NVLink (the estimate's formula)
    link = sorted(round(c.bytes / H200.host_link_bandwidth * 1e6, 3) for c in host_copies(final))
    rings = [c for c in collectives(final) if c.executions and c.algorithmic_bytes]
    ring = sorted(
        round(c.algorithmic_bytes / H200.collective_bandwidth(c.groups) * 1e6 + COLLECTIVE_LATENCY_US, 3) for c in rings
    )
    latencies = sorted(round(us, 3) for us in profile.latencies.values())
    assert link and ring
    assert collections.Counter(link) <= collections.Counter(latencies)
    assert collections.Counter(ring) <= collections.Counter(latencies)
    # a loop takes its body's time once per trip
    computations = scheduled_instructions(scheduled)
    loops = [i for instructions in computations.values() for i in instructions if i.op == "while"]
    assert any(loop.trip_count > 1 for loop in loops)
    for loop in loops:
        body = sum(profile.costs.get(i.name, 0.0) for c in loop.callees for i in computations[c])
        assert profile.costs[loop.name] == pytest.approx(loop.trip_count * body)


@needs_cuda_plugin
# decoder_input_offload's reloads hide by the same cost profile as qkv_offload's (slow: 35 s more)
@pytest.mark.parametrize("preset", ["qkv_offload", pytest.param("decoder_input_offload", marks=pytest.mark.slow)])
def test_with_ferrys_costs_the_reloads_hide_on_an_fsdp_mesh(preset):
    """Llama 3.1 8B's layer shapes, 3 layers x 2048 tokens x 8 rows on 8 H200 (FSDP): the goal of
    the pipelined schedule, exposed <= max(0, link - matmul) + 5% of matmul, holds with ferry's
    costs. With XLA's fixed estimates the scheduler issues each reload next to the layer's last
    reduce-scatter, with a few matmuls under it: for qkv_offload more exposed than the goal allows."""
    overrides = ("model.num_layers=3", "train.seq_len=2048", "train.global_batch_size=8", "mesh.fsdp=8")
    xla = planned("llama3_1_8b", preset, *overrides)
    ferry = planned("llama3_1_8b", preset, *overrides, costs=True)
    assert (ferry.scheduler_costs, xla.scheduler_costs) == ("ferry", "xla")

    def goal(plan) -> float:
        return plan.transfer_summary.goal_seconds(plan.flops / H200.bf16_peak_flops)

    assert ferry.transfer_summary.link_seconds == xla.transfer_summary.link_seconds  # the same copies
    assert ferry.transfer_summary.exposed_seconds <= goal(ferry)
    assert ferry.transfer_summary.exposed_seconds < xla.transfer_summary.exposed_seconds
    if preset == "qkv_offload":
        assert xla.transfer_summary.exposed_seconds > goal(xla)
    assert ferry.temp_bytes <= xla.temp_bytes * 1.01  # hiding the copies costs no HBM


@needs_cuda_plugin
def test_where_a_layers_copies_outlast_its_compute_the_pipelined_schedule_reaches_the_floor():
    """minimal_offloaded at Llama 3.1 8B's layer shapes (3 layers x 1024 tokens, one H200): each
    forward iteration stores more than its matmuls take, and no copy outlives its iteration, so
    every order leaves the excess exposed (the floor), well above the goal that assumes a copy may
    overlap any compute of the step. ferry's pipelined schedule comes within 5% of the matmul time
    of that floor; the per-layer engine, whose reloads wait for their layer, does not."""
    overrides = ("model.num_layers=3", "train.seq_len=1024", "train.global_batch_size=1")
    pipelined = planned("llama3_1_8b", "minimal_offloaded", *overrides, costs=True)
    per_layer = planned("llama3_1_8b", "minimal_offloaded", *overrides, "offload.pipelined=false", costs=True)
    matmul = pipelined.flops / H200.bf16_peak_flops
    summary = pipelined.transfer_summary
    assert summary.link_seconds > matmul and summary.floor_seconds > summary.goal_seconds(matmul)
    assert per_layer.transfer_summary.floor_seconds == pytest.approx(summary.floor_seconds)  # the same iterations
    assert summary.floor_seconds <= summary.exposed_seconds <= summary.floor_seconds + 0.05 * matmul
    assert per_layer.transfer_summary.exposed_seconds > summary.floor_seconds + 0.05 * matmul


@needs_cuda_plugin
def test_a_peeled_stack_moves_no_placeholder_and_peeling_two_layers_of_four_meets_the_goal():
    """minimal_offloaded at Llama 3.1 8B's layer shapes (4 layers x 1024 tokens, one H200), where
    the copies outweigh a layer's compute. Peeled (`offload.peel`), the first layer and the last
    `peel` run outside the loop, so each tensor crosses the link 3 times each way, not 4 (no
    placeholder). With one peeled, only the loop's 2 iterations are bound to their own compute:
    the floor halves, and the exposed time falls with it. With two, the loop runs one layer, which
    XLA unrolls: no copy is bound to an iteration (floor 0), its copies survive (they wait for the
    cotangent), and ordered by XLA's own estimates every copy hides (the goal: exposed <= 5% of the
    matmul time, the link being shorter than it), in fewer temporaries than the unpeeled loop's."""
    overrides = ("model.num_layers=4", "train.seq_len=1024", "train.global_batch_size=1")
    pipelined = planned("llama3_1_8b", "minimal_offloaded", *overrides, costs=True)
    peeled = planned("llama3_1_8b", "minimal_offloaded", *overrides, "offload.peel=1", costs=True)
    two = planned("llama3_1_8b", "minimal_offloaded", *overrides, "offload.peel=2")
    for plan in (peeled, two):
        read = [c for c in plan.verification.copies if c.status != DEAD]
        assert read and all((c.found, c.expected, c.status) == (3, 3, "copied") for c in read)
    before, after = pipelined.transfer_summary, peeled.transfer_summary
    assert after.link_seconds == pytest.approx(0.75 * before.link_seconds)
    assert after.floor_seconds == pytest.approx(0.5 * before.floor_seconds)
    assert after.floor_seconds <= after.exposed_seconds < before.exposed_seconds
    assert peeled.temp_bytes <= pipelined.temp_bytes + pipelined.pipeline_bytes
    summary = two.transfer_summary
    assert summary.link_seconds == pytest.approx(after.link_seconds) and summary.floor_seconds == 0
    assert summary.exposed_seconds <= summary.goal_seconds(two.flops / H200.bf16_peak_flops)
    assert two.temp_bytes < pipelined.temp_bytes


@needs_cuda_plugin
def test_a_peeled_loop_of_one_layer_keeps_its_copies():
    """Peeled at 3 layers, the loop runs one layer and XLA unrolls it: the store it issues is then
    read straight back by the backward pass, and XLA would fold the pair into nothing, but the
    host values pass a barrier with the cotangent (`ferry.offload.scan`), so every read tensor
    still crosses the link twice each way."""
    overrides = ("model.num_layers=3", "train.seq_len=512", "train.global_batch_size=1", "offload.peel=1")
    read = [c for c in planned("llama3_1_8b", "minimal_offloaded", *overrides).verification.copies if c.status != DEAD]
    assert read and all((c.found, c.expected, c.status) == (2, 2, "copied") for c in read)


def counting_compiles(monkeypatch) -> dict[str, int]:
    """The compiles `compile_with_costs` makes, by kind: stopped before the scheduler to read its
    module ("stopped"), with a profile priced before ("priced"), handed its profile as XLA reads it
    ("handed")."""
    counts = collections.Counter()
    for kind, name in (("stopped", "_module_before_scheduling"), ("priced", "_compile_priced")):
        original = getattr(scheduler_costs, name)
        monkeypatch.setattr(scheduler_costs, name, lambda *args, _o=original, _k=kind: counts.update([_k]) or _o(*args))
    handed = scheduler_costs._compile_priced_on_read

    def counted(*args):
        result = handed(*args)
        counts.update(["handed"] if result is not None else [])
        return result

    monkeypatch.setattr(scheduler_costs, "_compile_priced_on_read", counted)
    return counts


def tiny_offloading_program(costs: bool = True) -> str:
    """llama_tiny's train step, layer inputs offloaded, on 2 compile-only H200s (FSDP)."""
    config = compose_config(
        "model=llama_tiny", "offload=decoder_input_offload", "train.seq_len=256", "mesh.fsdp=2", "model.attention=xla"
    )
    policy = config.offload.policy(abstract_model(config.model).tagged_names())
    mesh, options = compile_only_mesh(H200, config.mesh), H200.compile_options(GPU_FLAGS)
    return compile_config_step(config, H200, policy, mesh, options, costs).compiled.as_text()


@needs_cuda_plugin
def test_one_compile_hands_xla_the_profile_priced_from_the_module_it_schedules(monkeypatch):
    """The profile is made when XLA opens it, from its dump of the last pass before scheduling:
    one compile, and the program it makes is the one two compiles make (the module read first,
    then compiled with its profile), not the one XLA's own estimates schedule."""
    counts, programs = counting_compiles(monkeypatch), []
    for leases in (True, False):  # one call site: the programs' stack traces alike
        monkeypatch.setattr(scheduler_costs, "leases_supported", lambda directory, _leases=leases: _leases)
        programs.append(tiny_offloading_program())
        assert counts == ({"handed": 1} if leases else {"handed": 1, "stopped": 1, "priced": 1})
    assert programs[0] == programs[1]
    assert programs[0] != tiny_offloading_program(costs=False)


@needs_cuda_plugin
def test_a_profile_priced_before_xlas_last_passes_is_not_the_schedulers(monkeypatch):
    """Should a pass after the dump ferry prices change the module (here the dump is taken before
    the pass that wraps the host copies for asynchrony), the scheduler got a profile of another
    module: the program is compiled again with the profile of the module it schedules."""
    counts, programs = counting_compiles(monkeypatch), []
    for last_pass in ("gpu-copy-async-wrapper", "fusion-wrapper"):
        monkeypatch.setattr(scheduler_costs, "_LAST_PASS_BEFORE_SCHEDULING", last_pass)
        programs.append(tiny_offloading_program())
    assert counts == {"handed": 2, "priced": 1}  # the second handed the wrong module's profile: compiled again
    assert programs[0] == programs[1]


@needs_cuda_plugin
def test_without_leases_the_module_is_priced_from_a_compile_stopped_before_scheduling(tmp_path, monkeypatch, capfd):
    """Where files take no lease (or XLA autotunes), the first compile stops at XLA's check of a
    profile (an empty one, a miss an error), just before the scheduler: the module it dumps there
    is the one a whole compile schedules, and the thousands of lines XLA logs about the empty
    profile's misses are kept off standard error."""
    read, stopped = [], scheduler_costs._module_before_scheduling

    def reading(lowered, options, directory):
        read.append(stopped(lowered, options, directory))
        assert not list(directory.glob("*after_optimizations.txt"))  # it stopped: no program was made
        return read[-1]

    monkeypatch.setattr(scheduler_costs, "leases_supported", lambda directory: False)
    monkeypatch.setattr(scheduler_costs, "_module_before_scheduling", reading)
    planned("llama_tiny", "decoder_input_offload", "train.seq_len=256", "mesh.fsdp=2", costs=True)
    _, scheduled = compiled_and_scheduled(tmp_path)
    assert len(read) == 1
    assert cost_profile(read[0], H200) == cost_profile(scheduled, H200)  # every instruction, priced alike
    assert "profile_guided_latency_estimator" not in capfd.readouterr().err


def test_where_xla_autotunes_the_module_is_read_from_a_whole_compile(tmp_path):
    """On a GPU XLA compiles every kernel candidate with the step's options, and an empty profile
    checked strictly fails them all ("No candidates could be compiled", seen on an H200 for every
    preset): a compile that autotunes (training's) reads the module from a whole compile without a
    profile; the planner's, which does not autotune, stops before the scheduler."""
    compiles = []

    class Lowered:  # what XLA does with the options: dump the module it schedules
        def compile(self, options):
            compiles.append(options)
            Path(options["xla_dump_to"], "m.before_latency-hiding-scheduler.txt").write_text("HloModule m")

    assert scheduler_costs._module_before_scheduling(Lowered(), {}, tmp_path / "run") == "HloModule m"
    assert not any(name.startswith("xla_gpu_pgle") for name in compiles[0])
    scheduler_costs._module_before_scheduling(Lowered(), H200.compile_options({}), tmp_path / "plan")
    assert compiles[1]["xla_gpu_pgle_accuracy_checker"] == "PGLE_STRICTNESS_LEVEL_ERROR"


@needs_cuda_plugin
def test_a_profile_that_misses_an_instruction_is_refused(monkeypatch):
    """The second compile must be the program that was priced: a profile missing one of its
    instructions is an error naming it, never a schedule built on XLA's fallback estimates."""
    dropped = []

    def less_one(hlo_text, target):
        profile = cost_profile(hlo_text, target)
        name = next(name for name in profile.costs if name.startswith("custom-call") or "fusion" in name)
        dropped.append(name)
        return CostProfile({k: v for k, v in profile.costs.items() if k != name}, profile.latencies)

    monkeypatch.setattr(scheduler_costs, "cost_profile", less_one)
    with pytest.raises(SchedulerCostsError, match="platform.scheduler_costs=xla") as error:
        planned("llama_tiny", "qkv_offload", "train.seq_len=128", costs=True)
    assert dropped[0] in str(error.value)


def test_a_run_prices_its_step_only_on_a_gpu_ferry_knows():
    gpu = PlatformConfig(name="gpu", scheduler_costs="ferry")
    assert scheduler_target(gpu, "NVIDIA H200") is TARGETS["h200"]
    assert scheduler_target(gpu, "NVIDIA GB200") is TARGETS["gb200"]
    assert scheduler_target(PlatformConfig(name="gpu"), "NVIDIA A100-SXM4-80GB") is None  # xla's estimates
    with pytest.raises(SchedulerCostsError, match="A100.*platform.scheduler_costs=xla"):
        scheduler_target(gpu, "NVIDIA A100-SXM4-80GB")


def two_matmuls(size: int = 256):
    """A small program lowered for one compile-only H200, and the planner's options for it."""
    sharding = NamedSharding(Mesh(H200.devices(1), ("x",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((size, size), jnp.bfloat16, sharding=sharding)
    return jax.jit(lambda a, b: jnp.tanh(a @ b) @ b).lower(x, x), H200.compile_options(GPU_FLAGS)


@needs_cuda_plugin
def test_a_program_planned_again_takes_its_cost_profile_from_the_cache(tmp_path, monkeypatch):
    """A re-plan of the same program compiles with the profile priced the first time, found by
    the program's key, and the program compiled with it is the one priced afresh."""
    cache = ProfileCache(tmp_path / "costs")
    counts = counting_compiles(monkeypatch)
    overrides = ("train.seq_len=256", "mesh.fsdp=2")
    fresh = planned("llama_tiny", "decoder_input_offload", *overrides, costs=True, cache=cache)
    again = planned("llama_tiny", "decoder_input_offload", *overrides, costs=True, cache=cache)
    assert counts == {"handed": 1, "priced": 1} and not fresh.profile_cached and again.profile_cached
    assert (again.device_bytes, again.host_bytes, again.flops) == (fresh.device_bytes, fresh.host_bytes, fresh.flops)
    assert again.transfer_summary == fresh.transfer_summary
    planned("llama_tiny", "qkv_offload", *overrides, costs=True, cache=cache)  # another program: priced
    assert counts["handed"] == 2 and len(list(cache.directory.glob("*.pbtxt.gz"))) == 2


@needs_cuda_plugin
def test_the_cache_key_covers_the_options_and_a_stale_profile_is_priced_afresh(tmp_path, monkeypatch):
    """Other compile options or another lowering are another program (another key); and should an entry still not
    price the module its compile schedules, it is dropped and replaced by a fresh profile, not
    used for a schedule on XLA's fallback estimates."""
    cache = ProfileCache(tmp_path)
    lowered, options = two_matmuls()
    key = cache.key(lowered, options, H200)
    assert key != cache.key(lowered, options | {"xla_gpu_memory_limit_slop_factor": 90}, H200)
    assert key != cache.key(two_matmuls(512)[0], options, H200)
    fresh = compile_with_costs(lowered, options, H200)
    stale = CostProfile(dict(list(fresh.profile.costs.items())[1:]), fresh.profile.latencies)
    cache.store(key, stale)
    assert cache.load(key).to_text() == stale.to_text()  # what is stored is read back whole, as XLA reads it
    counts = counting_compiles(monkeypatch)
    priced = compile_with_costs(lowered, options, H200, cache)
    assert counts == {"priced": 1, "handed": 1} and not priced.cached  # the stale entry's compile, then afresh
    assert cache.load(key).to_text() == fresh.profile.to_text()
    assert priced.compiled.as_text() == fresh.compiled.as_text()
    again = compile_with_costs(lowered, options, H200, cache)
    assert counts == {"priced": 2, "handed": 1} and again.cached
    assert again.compiled.as_text() == fresh.compiled.as_text()


def test_a_platform_keeps_its_profiles_in_the_users_cache_unless_told_not_to(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gpu = PlatformConfig(name="gpu", scheduler_costs="ferry")
    assert ProfileCache.of(gpu) == ProfileCache(tmp_path / "ferry" / "scheduler_costs")
    assert ProfileCache.of(PlatformConfig(name="gpu", scheduler_costs="ferry", scheduler_costs_cached=False)) is None
