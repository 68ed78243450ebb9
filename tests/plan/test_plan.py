"""The planner compiles the real train step for an H200 or a TPU v5p without one (compile-only
devices of the CUDA plugin and of libtpu) and reads the compiled program: its memory (offloads
land in pinned host memory, never dropped), its host copies, and the placement offload=auto
chooses."""

import dataclasses
import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ferry.models.registry import abstract_model
from ferry.nn.attention import QUERY_CHUNK
from ferry.offload import engine as offload
from ferry.offload.schedule import model_schedule
from ferry.plan.auto import (
    MAX_CHECKS,
    PEEL,
    auto_plan,
    fastest,
    fits_with_headroom,
    state_decisions,
    state_of,
    tensor_costs,
    tensor_decisions,
)
from ferry.plan.auto_search import MIN_GAIN, Baseline, anchored, banded_rank, faster, fastest_fitting, predict
from ferry.plan.copy_match import DEAD
from ferry.plan.estimate import StepEstimate
from ferry.plan.memory_plan import PlanError
from ferry.plan.planner import compile_only_mesh, for_target, plan_memory
from ferry.plan.replay import LayerGroupTrace, recompute_flops
from ferry.sharding import MeshConfig
from ferry.train.step import LossSettings, batch_loss
from ferry.xla.hlo_flops import matmul_flops, xla_rematerialised
from ferry.xla.targets import TARGETS
from tests.conftest import (
    GPU_FLAGS,
    compose_config,
    load_platform,
    load_preset,
    needs_cuda_plugin,
    needs_libtpu,
    run_launcher,
)

pytestmark = needs_cuda_plugin
H200 = TARGETS["h200"]
# The offload numbers below were measured with ferry's own attention (auto picks cuDNN on an H200,
# whose residuals and temporaries differ: tests/models/test_attention_kernels.py plans with it)
XLA_ATTENTION = "model.attention=xla"


@functools.cache  # tests share compiles: llama_tiny's minimal_offloaded at 256 tokens, save_all on FSDP 8
def plan(model: str, preset: str, *overrides: str, target=H200, seq_len=256, **kwargs):
    config = compose_config(
        f"model={model}", f"offload={preset}", f"train.seq_len={seq_len}", XLA_ATTENTION, *overrides
    )
    policy = config.offload.policy(abstract_model(config.model).tagged_names())  # the preset, overridden
    return plan_memory(config, target, policy, preset, xla_flags=GPU_FLAGS, **kwargs)


def test_llama_presets_on_h200():
    """Both presets keep far less in HBM than save_all. Which of the two needs fewer temporaries
    is decided by the backward pass's attention working set (its 8 MiB float32 score buffers at
    8 x 256 tokens), not by the residuals (256 KiB each): with jax 0.12 full_remat needs 48.1 MiB
    and minimal_offloaded 46.7 (jax 0.10: the other way round), save_all 99.0."""
    plans = {preset: plan("llama_tiny", preset) for preset in ("save_all", "full_remat", "minimal_offloaded")}
    assert plans["minimal_offloaded"].host_bytes > 0
    assert plans["save_all"].host_bytes == plans["full_remat"].host_bytes == 0
    assert (
        max(plans["full_remat"].temp_bytes, plans["minimal_offloaded"].temp_bytes) < 0.6 * plans["save_all"].temp_bytes
    )
    # matmul FLOPs counted from the GPU program, layer loop included: recomputing the layer shows
    assert plans["full_remat"].flops > plans["minimal_offloaded"].flops > plans["save_all"].flops > 0
    measured = plans["save_all"]
    assert measured.fits and measured.capacity_bytes == H200.hbm_bytes
    assert not dataclasses.replace(measured, capacity_bytes=measured.device_bytes - 1).fits


@pytest.mark.slow  # ~3 DeepSeek compiles; test_verify's DeepSeek H200 test covers its offloads group by group
def test_deepseek_presets_on_h200():
    """full_remat and minimal_offloaded keep the same tensors in HBM, each layer's input; the
    second also stages its copies there. Which of the two needs more temporaries is decided by
    the backward pass's MoE working set, not the staging: measured for deepseek_v3_tiny,
    minimal_offloaded is 1% below full_remat at 32 x 64, 128 x 64 and 8 x 256 tokens. What the
    offload buys shows in recompute: fewer FLOPs than full_remat at far less HBM than save_all."""
    presets = ("save_all", "full_remat", "minimal_offloaded")  # the last offloads the expert products too
    plans = {preset: plan("deepseek_v3_tiny", preset, "train.global_batch_size=32", seq_len=64) for preset in presets}
    assert plans["minimal_offloaded"].host_bytes > 0
    assert any("moe_mlpwi_0" in t.tensor for t in plans["minimal_offloaded"].transfers)
    assert plans["save_all"].host_bytes == plans["full_remat"].host_bytes == 0
    assert max(plans["full_remat"].temp_bytes, plans["minimal_offloaded"].temp_bytes) < plans["save_all"].temp_bytes
    assert plans["full_remat"].flops > plans["minimal_offloaded"].flops > plans["save_all"].flops > 0


def test_a_dropped_offload_is_an_error(monkeypatch):
    """Were the engine to place with a pinned_host NamedSharding on compile-only devices, JAX
    would silently keep the values on device; the planner refuses such a program."""
    monkeypatch.setattr(offload, "has_memory_kinds", lambda mesh: True)
    with pytest.raises(PlanError, match="keeps no bytes in pinned host memory: the offload was dropped"):
        plan.__wrapped__("llama_tiny", "minimal_offloaded")  # a fresh compile, not the cached one


def test_launcher_plans_and_flips_the_verdict(tmp_path):
    common = ("mode=plan", "target=h200", "train.seq_len=256", "plan.presets=[save_all]")
    result = run_launcher(*common, "plan.capacity_gib=0.01", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "OOM" in result.stdout and "FITS" not in result.stdout
    assert (tmp_path / "run" / "plan.json").exists()


def test_every_offloaded_byte_is_a_named_copy_in_the_compiled_program():
    """The host copies read from the scheduled GPU program move exactly what the transfer schedule
    offloads, each named by the tensor of its size, in both directions."""
    measured = plan("llama_tiny", "minimal_offloaded")
    config = compose_config("model=llama_tiny", "offload=minimal_offloaded", "train.seq_len=256", XLA_ATTENTION)
    model = abstract_model(config.model)
    policy = load_preset("minimal_offloaded").policy(model.tagged_names())
    schedule = model_schedule(model, policy, config.train.global_batch_size, 256, jnp.bfloat16)
    summary = measured.transfer_summary
    assert summary.bytes_to_host == summary.bytes_to_device == measured.host_bytes
    # the layer's last product (mlpwo) only joins the residual stream: its backward pass never
    # reads it, so XLA removes its copy; every other offloaded tensor crosses the link
    mlpwo = next(r for r in schedule.residuals if r.name == "mlpwo")
    assert schedule.device_to_host_bytes - summary.bytes_to_host == config.model.num_layers * mlpwo.bytes_per_device
    assert {t.direction for t in measured.transfers} == {"to host", "to device"}
    assert all(t.tensor != "?" and t.executions == config.model.num_layers for t in measured.transfers)
    assert summary.link_seconds == pytest.approx(summary.bytes_to_host * 2 / H200.host_link_bandwidth)
    assert 0 <= summary.exposed_seconds <= summary.link_seconds
    assert ("xla_gpu_enable_latency_hiding_scheduler", True) in measured.compile_options


@needs_libtpu
def test_tpu_v5p_plan_offloads_to_pinned_host():
    plans = {p: plan("llama_tiny", p, "mesh.data=4", target=TARGETS["v5p"]) for p in ("save_all", "minimal_offloaded")}
    assert plans["save_all"].host_bytes == 0 and not plans["save_all"].transfers
    assert plans["minimal_offloaded"].host_bytes > 0
    assert plans["minimal_offloaded"].transfer_summary.bytes_to_host > 0
    assert plans["minimal_offloaded"].temp_bytes < plans["save_all"].temp_bytes
    assert TARGETS["v5p"].topology(128) == "v5p:4x4x8" and TARGETS["v6e"].topology(32) == "v6e:4x8"


@needs_libtpu
@pytest.mark.parametrize("peel", [1, 2])
def test_tpu_v5p_keeps_every_copy_of_a_peeled_stack(peel):
    """libtpu, like XLA:GPU, keeps the copies of a peeled stack (`offload.peel`; 4 layers: a loop of
    two, and a loop of one, which the compiler unrolls): every tensor the backward pass reads
    crosses the link 3 times each way, and peeling adds no matrix work (libtpu recomputes some of
    the unpeeled program's saved values on its own: 1.72 GFLOP against 1.56 and 1.54 peeled)."""
    overrides = ("mesh.data=4", "model.num_layers=4")
    target = TARGETS["v5p"]
    peeled = plan("llama_tiny", "minimal_offloaded", *overrides, f"offload.peel={peel}", target=target)
    read = [c for c in peeled.verification.copies if c.status != DEAD]
    assert read and all((c.found, c.expected, c.status) == (3, 3, "copied") for c in read)
    assert peeled.flops <= plan("llama_tiny", "minimal_offloaded", *overrides, target=target).flops


_compiled_plans = {}


def plan_at_capacity(config, target, policy, name: str, capacity_bytes: int, host_capacity_bytes: int | None):
    """`plan_memory` with these capacities, which only label the plan it returns (`fits` and the
    headroom are read from them): the tests of auto share the compile of each program, auto's
    first candidate (everything on device) being the same in three of them."""
    key = (repr(config), target, policy, name)
    if key not in _compiled_plans:
        _compiled_plans[key] = plan_memory(config, target, policy, name, None, GPU_FLAGS, None)
    capacities = {"capacity_bytes": capacity_bytes, "host_capacity_bytes": host_capacity_bytes}
    return dataclasses.replace(_compiled_plans[key], **capacities)


def auto_choice(
    target,
    capacity_gib: float,
    host_capacity_gib: float | None = None,
    seq_len: int = 256,
    state: bool = False,
    known: tuple[str, ...] = (),
    attention: str = "auto",
):
    """offload=auto on llama_tiny; with `state`, the optimizer's and master weights' placements
    are decisions too, as mode=plan makes them; `known` presets are compiled first and handed to
    auto as mode=plan hands it the presets it planned. `attention`: model.attention (auto is
    cuDNN's on an H200)."""
    config = compose_config(
        "model=llama_tiny", "offload=auto", f"train.seq_len={seq_len}", "mode=plan", f"target={target.name}",
        f"model.attention={attention}",
    )  # fmt: skip
    host = None if host_capacity_gib is None else int(host_capacity_gib * 2**30)

    def compile_policy(policy, name, placed=config):
        return plan_at_capacity(placed, target, policy, name, int(capacity_gib * 2**30), host)

    def compile_choice(policy, values):
        state = state_of(values)
        offload = dataclasses.replace(config.offload, optimizer=state.optimizer, params=state.params)
        return compile_policy(policy, "auto", dataclasses.replace(config, offload=offload))

    mesh = compile_only_mesh(target, config.mesh)
    tagged = abstract_model(config.model).tagged_names()
    policies = [load_preset(name).policy(tagged) for name in known]
    compiled = [(policy, compile_policy(policy, name)) for policy, name in zip(policies, known, strict=True)]
    if compiled:
        return auto_plan(config, target, mesh, compile_policy, known=compiled)
    if not state:
        return auto_plan(config, target, mesh, compile_policy)
    return auto_plan(config, target, mesh, compile_policy, state_decisions(config, target, mesh), compile_choice)


def test_auto_keeps_everything_on_device_when_it_fits():
    """Everything the backward pass reads stays on device; `mlpwo`, which it never reads, is no
    decision and is left to remat (it frees nothing)."""
    measured, choices, tried = auto_choice(H200, 1.0)
    placements = {c.name: c.placement for c in choices}
    assert measured.fits and placements.pop("mlpwo") == "remat" and set(placements.values()) == {"device"}
    assert len(tried) == 1


@functools.cache
def llama_tiny_decisions(seq_len: int = 64):
    config = compose_config("model=llama_tiny", "offload=auto", f"train.seq_len={seq_len}", "mode=plan", "target=h200")
    costs, forward = tensor_costs(config, H200, compile_only_mesh(H200, config.mesh))
    decisions = tensor_decisions(costs, micro_steps=1)
    baseline = Baseline(
        hbm_bytes=float(sum(c.bytes for c in costs.values()) + 2**20),
        host_bytes=0.0,
        matmul_seconds=sum(forward.values()) * 3 / H200.bf16_peak_flops,
        collective_seconds=0.0,
        forward_seconds={group: flops / H200.bf16_peak_flops for group, flops in forward.items()},
        layer_runs={"decoder": config.model.num_layers},
    )
    return costs, decisions, baseline


@functools.cache
def every_prediction(link: float, collectives: float):
    """The target and baseline of the search test below at this link and collectives' time, and
    the prediction of every one of llama_tiny's placements (the same whatever HBM is shed)."""
    target = dataclasses.replace(H200, host_link_bandwidth=link)
    costs, decisions, baseline = llama_tiny_decisions()
    baseline = dataclasses.replace(baseline, collective_seconds=collectives * baseline.matmul_seconds)
    every = [
        predict(baseline, decisions, values, target)
        for values in itertools.product(*[[o.value for o in d.options] for d in decisions])
    ]
    return target, baseline, every


@pytest.mark.parametrize("shed", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("link", [64e9, 1e15], ids=["pcie", "fast"])
@pytest.mark.parametrize("collectives", [0.0, 10.0], ids=["compute-bound", "collective-bound"])
def test_the_search_finds_the_fastest_predicted_candidate_within_both_memories(shed, link, collectives):
    """Branch and bound against every one of llama_tiny's 3^7 x 2 placements, predicted (`mlpwo`,
    never read by the backward pass, is no decision). Where the collectives take 10x the matmul
    time, every candidate's best estimate is theirs (as at the Llama 3.1 405B seed): the middle
    estimate still counts recompute and exposed copies, so the least worst is found."""
    costs, decisions, _ = llama_tiny_decisions()
    target, baseline, every = every_prediction(link, collectives)  # predicted once for the three `shed`
    hbm_limit = baseline.hbm_bytes - shed * sum(c.bytes for c in costs.values())
    host_limit = 0.3 * sum(c.bytes for c in costs.values())
    found = fastest_fitting(baseline, decisions, target, hbm_limit, host_limit)
    fitting = [p for p in every if p.hbm_bytes <= hbm_limit and p.host_bytes <= host_limit]
    assert found is not None and found.rank == min(p.rank for p in fitting)
    if collectives:  # best estimates tie at the collectives' time: recompute and copies still decide
        tied = [p for p in fitting if p.estimate.best_seconds == found.estimate.best_seconds]
        assert len({p.worst for p in tied}) > 1 and found.worst == min(p.worst for p in tied)
    assert found.hbm_bytes <= hbm_limit and found.host_bytes <= host_limit
    placements = dict(zip((d.name for d in decisions), found.values, strict=True))
    if link > 1e12:  # copies hide behind any compute: offload within the host pool before recomputing
        assert "offload" in placements.values()
    excluded = fastest_fitting(baseline, decisions, target, hbm_limit, host_limit, frozenset({found.values}))
    assert excluded is not None and excluded.values != found.values and excluded.rank >= found.rank
    # around a compiled step's middle estimate, those within MIN_GAIN of it tie: the worst decides
    banded = fastest_fitting(baseline, decisions, target, hbm_limit, host_limit, fastest_seconds=found.seconds)
    assert banded is not None
    assert banded_rank(banded.estimate, found.seconds) == min(banded_rank(p.estimate, found.seconds) for p in fitting)


def test_a_candidate_is_predicted_from_the_nearest_compiled_one():
    """Where the all-on-device program is far over HBM, predictions from it miss (at the
    DeepSeek-V3 seed presets compiled 6 to 16 GiB below their predictions; 190 to 214 GiB with
    XLA's own rematerialisation on). A compiled candidate anchors the ones near it: predicted from its anchor it
    is its compiled program, a neighbour differs by what their placements differ by, and the
    search finds a candidate that only the anchor says fits."""
    costs, decisions, baseline = llama_tiny_decisions()
    all_device = tuple(d.options[0].value for d in decisions)
    least = tuple(d.options[-1].value for d in decisions)  # every tag rematerialised, the layer input offloaded
    predicted = predict(baseline, decisions, least, H200)
    held = predicted.hbm_bytes - 2.0**20  # the compiled program holds a MiB less than predicted
    compiled = dataclasses.replace(predicted, hbm_bytes=held)
    anchor = anchored(baseline, predicted, compiled)
    assert predict(anchor, decisions, least, H200) == compiled
    limit = held + 0.5 * max(c.bytes for c in costs.values())
    assert fastest_fitting(baseline, decisions, H200, limit, None) is None  # from the baseline nothing fits
    anchors = [(all_device, baseline), (least, anchor)]
    found = fastest_fitting(baseline, decisions, H200, limit, None, frozenset({least}), anchors)
    assert found is not None and found.hbm_bytes <= limit
    assert found.values != least and found.rank < compiled.rank  # a tag kept: less recompute
    from_anchor = predict(anchor, decisions, found.values, H200)  # predicted from the anchor
    assert found.hbm_bytes == pytest.approx(from_anchor.hbm_bytes) and found.rank == pytest.approx(from_anchor.rank)
    assert found.hbm_bytes > held


def test_the_search_says_so_when_nothing_fits():
    costs, decisions, baseline = llama_tiny_decisions()
    assert fastest_fitting(baseline, decisions, H200, 2.0**20 - 1, None) is None  # below what nothing on device needs


def test_auto_picks_the_fastest_estimate_that_fits_both_memories():
    """llama_tiny's layers compute for about a microsecond: no copy hides behind that, so auto
    sheds HBM by recompute. Of the candidates it compiled, its pick is the one of the least
    estimated step time whose program fits HBM and the pinned host pool with 5% to spare."""
    measured, choices, tried = auto_choice(H200, 0.055, host_capacity_gib=0.01, seq_len=256, attention="xla")
    fitting = [t for t in tried if fits_with_headroom(t.plan)]
    assert fitting and measured is fastest(fitting).plan
    assert measured.device_bytes <= 0.95 * measured.capacity_bytes
    assert measured.host_bytes <= 0.95 * measured.host_capacity_bytes
    assert not fits_with_headroom(tried[0].plan)  # everything on device does not fit
    placements = {c.name: c.placement for c in choices}
    assert "remat" in placements.values() and placements["decoder_layer_input"] != "remat"
    assert len(tried) <= 1 + MAX_CHECKS


def test_a_prediction_within_min_gain_of_the_fastest_is_a_tie():
    """A prediction within `MIN_GAIN` of the fastest compiled step's middle estimate is no reason to
    compile another candidate, unless its worst is faster by more; among compiled ones, middle
    estimates that close tie and the worst decides."""
    compiled = StepEstimate(1.0, 0.0, 0.0, 1.0)
    within = dataclasses.replace(compiled, matmul_seconds=1 - MIN_GAIN / 2)
    beyond = dataclasses.replace(compiled, matmul_seconds=1 - 2 * MIN_GAIN)
    assert not faster(compiled, compiled) and not faster(within, compiled) and faster(beyond, compiled)
    collective_bound = dataclasses.replace(compiled, collective_seconds=10.0)
    less_recompute = dataclasses.replace(collective_bound, matmul_seconds=0.5)
    assert less_recompute.best_seconds == collective_bound.best_seconds  # the best estimates tie
    assert faster(less_recompute, collective_bound) and not faster(collective_bound, less_recompute)
    # collectives 0.6% shorter, middle estimates 0.14% apart: 0.4 s less of recompute decides
    fewer_collectives = StepEstimate(4.42, 0.0, 12.40, 1.0)  # middle 14.61 s, worst 16.82 s
    less_compute = StepEstimate(4.30, 0.0, 12.48, 1.0)  # middle 14.63 s, worst 16.78 s
    assert fewer_collectives.rank < less_compute.rank
    least = fewer_collectives.middle_seconds
    assert banded_rank(less_compute, least) < banded_rank(fewer_collectives, least)
    assert banded_rank(StepEstimate(4.3, 0.0, 12.6, 1.0), least) > banded_rank(fewer_collectives, least)


def test_auto_weighs_the_presets_planned_beside_it():
    """The presets mode=plan compiled anyway are candidates: they are in auto's table under their
    names, and auto's pick is never slower than the fastest of them that fits."""
    measured, choices, tried = auto_choice(H200, 0.055, seq_len=256, known=("full_remat", "minimal_offloaded"))
    presets = {t.plan.policy: t.plan for t in tried if t.plan.policy != "auto"}
    assert set(presets) == {"full_remat", "minimal_offloaded"}
    fitting = [p for p in presets.values() if fits_with_headroom(p)]
    assert fitting and fits_with_headroom(measured) and measured.policy == "auto"
    assert measured.estimate.middle_seconds <= (1 + MIN_GAIN) * min(p.estimate.middle_seconds for p in fitting)
    assert {c.name: c.placement for c in choices}["decoder_layer_input"] != "remat"


def test_auto_starts_from_minimal_instead_of_compiling_it_again():
    """`minimal` (every tag on device) is the program of auto's all-on-device candidate: auto
    starts from the preset's compile (at the DeepSeek-V3 seed, 180 s saved); save_all, which keeps
    the untagged values too, is another program and no start."""
    measured, choices, tried = auto_choice(H200, 0.055, seq_len=256, known=("save_all", "minimal"))
    assert tried[0].plan.policy == "minimal" and all(t.plan.policy == "auto" for t in tried[1:])
    alone = auto_choice(H200, 0.055, seq_len=256)[2]  # compiled by auto itself
    assert alone[0].plan.policy == "auto" and alone[0].plan.device_bytes == tried[0].plan.device_bytes
    assert alone[0].plan.flops == tried[0].plan.flops
    assert measured.estimate.rank == fastest([t for t in alone if t.fits]).plan.estimate.rank  # the same search


def test_an_expert_axis_shards_the_dense_weights_as_fsdp_does():
    """Compiled for 8 H200s, llama_tiny's arguments (weights and AdamW moments) take the same bytes
    per device on an expert-8 mesh as on an FSDP-8 one: the expert axis shards every parameter,
    none is replicated over it (before, the expert mesh held 8x)."""
    fsdp = plan("llama_tiny", "save_all", "mesh.fsdp=8")
    expert = plan("llama_tiny", "save_all", "mesh.expert=8")
    assert expert.argument_bytes == fsdp.argument_bytes


def test_the_estimate_reads_the_compiled_collectives_and_counts_model_flops_as_maxtext():
    """llama_tiny over 8 H200s (FSDP): the weights' all-gathers and the gradients' reduce-scatters
    are in the estimate at NVLink speed; the matmul time is the program's FLOPs at the peak, the
    model FLOPs `train/step_flops.py`'s per device."""
    from ferry.train.step_flops import training_flops

    measured = plan("llama_tiny", "save_all", "mesh.fsdp=8")
    config = compose_config("model=llama_tiny", "train.seq_len=256", "mesh.fsdp=8")
    traffic = measured.collectives
    assert traffic.bytes["all-gather"] > 0 and traffic.bytes["reduce-scatter"] > 0
    assert traffic.seconds == pytest.approx(traffic.total_bytes / H200.interconnect_bandwidth)
    estimate = measured.estimate
    assert estimate.matmul_seconds == measured.flops / H200.bf16_peak_flops
    assert estimate.collective_seconds == traffic.seconds and estimate.exposed_copy_seconds == 0
    flops = training_flops(config.model, config.train.global_batch_size, 256).per_device(8)
    assert estimate.model_flops == flops
    assert estimate.best_seconds < estimate.worst_seconds
    assert measured.to_json()["estimate"]["kind"] == "estimate"


def test_auto_reports_the_least_hbm_candidate_when_nothing_fits():
    """Below what full_remat needs, no placement fits: auto compiles the all-on-device program as
    a loop and its peeled twin (`offload.peel`: 1 of llama_tiny's 2 layers after the first), then
    the placement freeing the most HBM (every tensor rematerialised, the layer input offloaded),
    and reports the least of them as the closest."""
    measured, choices, tried = auto_choice(H200, 0.01, seq_len=64)
    assert not fits_with_headroom(measured) and len(tried) == 3
    assert tried[1].values == tried[0].values | {PEEL: "1"}  # the twin, numbered after the loop
    assert tried[1].plan.device_bytes != tried[0].plan.device_bytes  # another program
    placements = {name: value for name, value in tried[2].values.items() if not name.startswith("offload.")}
    assert placements.pop("decoder_layer_input") == "offload" and set(placements.values()) == {"remat"}
    closest = min(tried, key=lambda t: t.plan.device_bytes)
    assert measured.device_bytes == closest.plan.device_bytes < tried[0].plan.device_bytes
    chosen = {c.name: c.placement for c in choices}
    assert chosen.get(PEEL, "0") == closest.values.get(PEEL, "0")
    assert all(chosen[name] == value for name, value in closest.values.items())


def test_auto_peels_the_stack_where_only_its_peeled_twin_fits(tmp_path):
    """Between the all-on-device program's HBM as a loop and peeled, the peeled twin is the pick
    (nothing recomputed or copied beats it), and the preset auto writes trains with its peel."""
    import yaml

    from ferry.config.root import check_peel
    from ferry.config.train import OffloadConfig
    from ferry.config_schema import from_dict
    from ferry.plan.report import write_plan

    _, _, over = auto_choice(H200, 0.01, seq_len=64)
    loop, twin = (t.plan.device_bytes for t in over[:2])
    assert twin < loop
    measured, choices, tried = auto_choice(H200, (loop + twin) / 2 / (1 - H200.hbm_headroom) / 2**30, seq_len=64)
    assert fits_with_headroom(measured) and not fits_with_headroom(tried[0].plan)
    assert measured.device_bytes == twin and tried[1].values[PEEL] == "1"
    chosen = {c.name: c.placement for c in choices}
    assert chosen.pop(PEEL) == "1" and chosen.pop("mlpwo") == "remat" and set(chosen.values()) == {"device"}
    written = yaml.safe_load(
        write_plan([measured], choices, tmp_path, compose_config("model=llama_tiny"))[1].read_text()
    )
    preset = from_dict(OffloadConfig, written, "offload_auto.yaml")
    assert preset.peel == 1 and PEEL not in preset.tensors
    check_peel(preset, compose_config("model=llama_tiny").model)  # a run takes it


def test_auto_moves_the_train_state_to_host_when_only_that_fits(tmp_path):
    """llama_tiny at 64 tokens: its activations are about a MiB, its AdamW moments 1 MiB. Below
    what full_remat needs with the state in HBM, only a placement with (part of) the state on
    host fits: auto chooses one, compiles it with the state in pinned host memory, and writes it
    into the preset a run trains with."""
    import yaml

    from ferry.config.train import OffloadConfig
    from ferry.config_schema import from_dict
    from ferry.plan.report import write_plan

    remat = plan("llama_tiny", "full_remat", seq_len=64).device_bytes
    state_on_host = plan("llama_tiny", "full_remat", "offload.optimizer=host", "offload.params=host", seq_len=64)
    remat_state_on_host = state_on_host.device_bytes
    assert remat_state_on_host < remat
    # the transfer table names the update's copies by the state they move
    assert all(t.tensor.startswith("master weights+AdamW moments:") for t in state_on_host.transfers)
    assert any("mlp.wi_0" in t.tensor for t in state_on_host.transfers)
    # between the two, with headroom; nearer the state on host, where the search compiles 2 candidates
    # after the all-on-device one (7 at the midpoint, each about 9 s)
    capacity = (0.6 * remat_state_on_host + 0.4 * remat) / 0.95 / 2**30
    measured, choices, tried = auto_choice(H200, capacity, seq_len=64, state=True, attention="xla")  # as plan()
    assert not fits_with_headroom(tried[0].plan) and fits_with_headroom(measured)
    state = {c.name: c.placement for c in choices if c.name.startswith("offload.")}
    assert "host" in state.values()
    assert measured.host_bytes > 0 and measured.device_bytes < remat
    moments = next(c for c in choices if c.name == "offload.optimizer").bytes
    assert moments >= 2**20  # llama_tiny's 131,392 parameters, two float32 moments each
    written = yaml.safe_load(write_plan([measured], choices, tmp_path)[1].read_text())
    preset = from_dict(OffloadConfig, written)
    assert (preset.optimizer, preset.params) == (state["offload.optimizer"], state["offload.params"])
    assert not any(name.startswith("offload.") for name in preset.tensors)


@pytest.mark.parametrize("preset", ["qkv_offload", "decoder_input_offload"])
def test_copies_hide_under_compute_where_the_link_allows(preset):
    """The goal of the pipelined schedule, per preset whose link time is below its matmul time:
    exposed copy time <= max(0, link - matmul) + 5% of matmul. Llama 3.1 8B's layer shapes, 3
    layers x 2048 tokens on an H200. The per-layer engine leaves more exposed (its reloads are
    issued as the replay needs them, with nothing scheduled under them), for qkv_offload more
    than the bound allows."""
    overrides = ("model.num_layers=3", "train.global_batch_size=1")
    pipelined = plan("llama3_1_8b", preset, *overrides, seq_len=2048)
    per_layer = plan("llama3_1_8b", preset, *overrides, "offload.pipelined=false", seq_len=2048)
    for measured in (pipelined, per_layer):
        assert measured.transfer_summary.link_seconds < measured.flops / H200.bf16_peak_flops
    bound = lambda p: (
        max(0.0, p.transfer_summary.link_seconds - p.flops / H200.bf16_peak_flops)
        + 0.05 * (p.flops / H200.bf16_peak_flops)
    )
    assert pipelined.transfer_summary.exposed_seconds <= bound(pipelined)
    assert pipelined.transfer_summary.exposed_seconds < per_layer.transfer_summary.exposed_seconds
    if preset == "qkv_offload":
        assert per_layer.transfer_summary.exposed_seconds > bound(per_layer)


def compiled_gradient(model, policy: offload.Policy, rows: int, seq_len: int) -> tuple[float, int]:
    """Matmul FLOPs and temporary bytes of the loss gradient of `model` (abstract) under
    `policy`, compiled for an H200 without one."""
    mesh = compile_only_mesh(H200, MeshConfig())
    on_device = NamedSharding(mesh, PartitionSpec())
    params, static = eqx.partition(model, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device), params)
    batch = jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32, sharding=on_device)
    settings = LossSettings(policy, "bfloat16")
    loss = lambda p, b: batch_loss(eqx.combine(p, static), b, settings)[0]
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile(H200.compile_options(GPU_FLAGS))
    return matmul_flops(compiled.as_text()), compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("seq_len", [64, 1024], ids=["whole", "chunked"])
def test_a_tags_costs_are_what_the_compiled_gradient_holds_and_runs_again(seq_len):
    """auto prices rematerialising a tag by the matmuls one layer's backward pass runs again for it
    (`replay.recompute_flops`), not by its producing matmul, and sizes what keeping it holds by
    whether the backward pass reads it. `mlpwo`, read only by the residual sum, is held by no
    placement and costs nothing to rematerialise (its producer was priced at a whole MLP
    projection and its bytes as freed), so it is no decision of auto's; `attention_out` costs the
    probabilities' product with the values only, as the replay recomputes the untagged scores
    anyway. Each checked against the compiled gradient of llama_tiny with every other tag kept on
    device, also where the attention runs as a loop over query chunks (each trip counted)."""
    config = compose_config(
        "model=llama_tiny", f"train.seq_len={seq_len}", "train.global_batch_size=2", "mode=plan", "target=h200",
        XLA_ATTENTION,
    )  # fmt: skip
    model = abstract_model(for_target(config.model, H200))
    (kind,) = model.layer_kinds()
    rows = 2
    trace = LayerGroupTrace(kind.name, kind.run, (rows, seq_len, model.config.dim), jnp.bfloat16)
    tagged = model.tagged_names()
    costs = recompute_flops(model, trace, tagged)
    assert costs["mlpwo"] == 0 and costs["mlpwi_0"] > 0
    head_dim = model.config.dim // model.config.num_heads
    values_product = 2 * rows * model.config.num_heads * seq_len * seq_len * head_dim
    assert costs["attention_out"] == values_product * (1 if seq_len <= QUERY_CHUNK else 2)
    sized, _ = tensor_costs(config, H200, compile_only_mesh(H200, config.mesh))
    assert sized["mlpwo"].bytes == 0 and sized["mlpwi_0"].bytes > 0
    assert "mlpwo" not in {d.name for d in tensor_decisions(sized, micro_steps=1)}
    keep = {name: "device" for name in tagged}
    base_flops, base_temp = compiled_gradient(model, offload.Policy.from_dict(keep), rows, seq_len)
    for name in ("mlpwo", "mlpwi_0", "attention_out"):
        flops, temp = compiled_gradient(model, offload.Policy.from_dict(keep | {name: "remat"}), rows, seq_len)
        assert flops - base_flops == kind.num_layers * costs[name], name
        assert (temp == base_temp) == (name == "mlpwo"), name


def test_xla_rescue_rematerialisation_is_counted():
    """Where XLA's own rematerialisation pass runs (`configs/platform/gpu.yaml` turns it off) and its
    memory estimate exceeds its limit (95% of 80% of HBM by default), XLA recomputes on its own. On
    a 64 MiB H200 llama_tiny's save_all (86.7 MiB by XLA's estimate) is rescued: the plan counts the
    clones, and their recomputation is in its matmuls."""
    plain = plan("llama_tiny", "save_all")
    config = compose_config("model=llama_tiny", "offload=save_all", "train.seq_len=256", XLA_ATTENTION)
    small = dataclasses.replace(H200, hbm_bytes=64 * 2**20)
    rescued = plan_memory(config, small, config.offload.policy(frozenset()), "save_all", xla_flags=GPU_FLAGS)
    assert plain.xla_rematerialised == 0 < rescued.xla_rematerialised
    other_pass = "%loop_broadcast_fusion.4.rematerialized.1 = bf16[8]{0} fusion(), kind=kLoop, calls=%f"
    assert xla_rematerialised(other_pass + "\n  %fusion.6.remat = f32[8]{0} fusion(%p), calls=%g") == 1
    assert rescued.flops > plain.flops and rescued.temp_bytes < plain.temp_bytes


def test_gpu_flags_keep_xla_from_recomputing_for_bytes_on_host():
    """XLA's rematerialisation pass counts pinned host buffers as HBM, so it recomputes in a program
    that offloads though the program's HBM is under XLA's own limit. gpu.yaml turns the pass off:
    on a 58 MiB H200, llama_tiny's minimal_offloaded (48.8 MiB of HBM, 5 MiB on host) compiles to
    the program it is on a whole H200; with the pass on, XLA adds clones and matmuls for nothing."""
    flags = dict(load_platform("gpu").xla_flags)
    config = compose_config("model=llama_tiny", "offload=minimal_offloaded", "train.seq_len=256", XLA_ATTENTION)
    policy = config.offload.policy(abstract_model(config.model).tagged_names())
    small = dataclasses.replace(H200, hbm_bytes=58 * 2**20)
    whole = plan_memory(config, H200, policy, "minimal_offloaded", xla_flags=flags)
    held = plan_memory(config, small, policy, "minimal_offloaded", xla_flags=flags)
    with_pass = {k: v for k, v in flags.items() if k != "xla_disable_hlo_passes"}
    rescued = plan_memory(config, small, policy, "minimal_offloaded", xla_flags=with_pass)
    inputs_outputs = held.argument_bytes + held.output_bytes - held.alias_bytes
    xla_limit = (0.8 * small.hbm_bytes - inputs_outputs) * flags["xla_gpu_memory_limit_slop_factor"] / 100
    assert held.temp_bytes + inputs_outputs < xla_limit < held.temp_bytes + inputs_outputs + held.host_bytes
    assert (held.xla_rematerialised, held.flops, held.temp_bytes) == (0, whole.flops, whole.temp_bytes)
    assert rescued.xla_rematerialised > 0 and rescued.flops > held.flops


def test_offloads_outside_a_layer_loop_free_hbm():
    """Unscanned layers (`model.scan_layers=false`, DeepSeek's MTP block) use the per-layer engine
    outside any loop, where XLA:GPU starts a reload as soon as its store is done unless something
    makes it wait: the value was then back in HBM from the forward pass on, and minimal_offloaded
    needed more temporaries than save_all (3,266 against 2,965 MiB at Llama 3.1 8B's layer shapes,
    2 layers x 1024 tokens). The reloads now wait for their layer's cotangent."""
    shape = ("model.num_layers=2", "model.scan_layers=false", "train.global_batch_size=1")
    plans = {p: plan("llama3_1_8b", p, *shape, seq_len=1024) for p in ("save_all", "minimal_offloaded")}
    assert plans["minimal_offloaded"].host_bytes > 0
    assert plans["minimal_offloaded"].temp_bytes < plans["save_all"].temp_bytes
