"""`plan.extrapolate`: a deep model planned from shallow compiles equals its full compile, because
a scanned stack's memory, FLOPs, host copies and collectives are affine in its depth."""

import dataclasses

import pytest

from ferry.models.registry import abstract_model
from ferry.plan.estimate import CollectiveTraffic
from ferry.plan.extrapolate import (
    ExtrapolationError,
    extrapolated_plan,
    group_depths,
    probe_depths,
    with_depths,
)
from ferry.plan.memory_plan import MemoryPlan
from ferry.plan.planner import model_flops_per_device, plan_memory
from ferry.plan.transfers import Transfer, TransferSummary
from ferry.xla.targets import TARGETS
from tests.conftest import GPU_FLAGS, compose_config, load_model_config, load_preset, needs_cuda_plugin

H200 = TARGETS["h200"]
EXACT = ("argument_bytes", "output_bytes", "alias_bytes", "host_bytes", "flops", "matmuls")


def synthetic_plan(depths: dict[str, int], copies_differ: bool = False) -> MemoryPlan:
    """A plan whose every quantity is affine in the depths, as a scanned stack's are."""
    dense, moe = depths.get("dense", 0), depths["moe"]
    layers = dense + moe
    transfer = Transfer("mla_q", "to host", "loop", "bf16[8,64]", 1024, 2 * moe, 1e6, 1e-6, 1e-6)
    extra = (transfer,) if copies_differ and moe == 8 else ()
    return MemoryPlan(
        target="h200",
        mesh="one",
        policy="p",
        argument_bytes=1000 + 100 * dense + 300 * moe,
        output_bytes=900 + 100 * dense + 300 * moe,
        alias_bytes=800 + 100 * dense + 300 * moe,
        temp_bytes=5000 + 70 * dense + 1100 * moe,
        host_bytes=2048 * moe,
        flops=1e9 + 3e8 * dense + 5e8 * moe,
        matmuls=12 + 7 * dense + 9 * moe,
        capacity_bytes=10**6,
        host_capacity_bytes=None,
        compile_options=(),
        transfers=(transfer, *extra),
        transfer_summary=TransferSummary(2048 * moe, 2048 * moe, 3e-6 * moe, 1e-6 * moe, 2e-6 * moe),
        compile_seconds=10.0,
        collectives=CollectiveTraffic({"all-gather": 64.0 * layers}, 1e-7 * layers),
        model_flops=0.0,
        matmul_rate=H200.matmul_rate,
    )


def test_every_quantity_is_extended_along_its_line_to_the_full_depth():
    full = {"dense": 3, "moe": 58}
    assert probe_depths(full) == ({"dense": 3, "moe": 6}, {"moe": {"dense": 3, "moe": 8}})
    compiled = []
    plan = extrapolated_plan(lambda depths: compiled.append(depths) or synthetic_plan(depths), full, 7e15)
    assert compiled == [{"dense": 3, "moe": 6}, {"dense": 3, "moe": 8}]
    whole = synthetic_plan(full)
    for field in (*EXACT, "temp_bytes"):  # all affine here
        assert getattr(plan, field) == getattr(whole, field), field
    assert plan.transfers[0].executions == 2 * 58 and plan.transfer_summary.bytes_to_host == 2048 * 58
    assert plan.collectives.bytes == {"all-gather": 64.0 * 61}
    assert plan.collectives.seconds == pytest.approx(1e-7 * 61)
    assert plan.model_flops == 7e15 and plan.compile_seconds == 20.0 and plan.extrapolated == "moe 58 from 6 and 8"


def test_compiles_that_differ_in_more_than_depth_are_not_extrapolated():
    with pytest.raises(ExtrapolationError, match="other host copies"):
        extrapolated_plan(lambda depths: synthetic_plan(depths, copies_differ=True), {"moe": 20}, 0.0)


def test_depths_by_family_and_the_default():
    deepseek = load_model_config("deepseek_v3")
    assert group_depths(deepseek) == {"dense": 3, "moe": 58}
    assert with_depths(deepseek, {"dense": 3, "moe": 6}).num_layers == 9
    llama = load_model_config("llama3_1_8b")
    assert group_depths(with_depths(llama, {"decoder": 3})) == {"decoder": 3}
    assert compose_config().plan.extrapolate is False  # whole compiles unless asked


def extrapolated_and_whole(model: str, preset: str, *overrides: str, target=H200) -> tuple[MemoryPlan, MemoryPlan]:
    # ferry's own attention and the whole-logits head, as these cases were set with (auto is cuDNN's
    # on an H200 or B200)
    config = compose_config(
        f"model={model}", f"offload={preset}", "model.attention=xla", "train.loss_head=logits", *overrides
    )
    policy = load_preset(preset).policy(abstract_model(config.model).tagged_names())

    def compile_at(depths: dict[str, int] | None) -> MemoryPlan:
        at = config if depths is None else dataclasses.replace(config, model=with_depths(config.model, depths))
        return plan_memory(at, target, policy, preset, xla_flags=GPU_FLAGS)

    planned = extrapolated_plan(compile_at, group_depths(config.model), model_flops_per_device(config, target))
    return planned, compile_at(None)


def assert_same(planned: MemoryPlan, whole: MemoryPlan, temp_over: float) -> None:
    """Everything exact but the temporaries, XLA's packing of buffers (see `ferry.plan.extrapolate`):
    those over-estimated, by at most `temp_over`."""
    for field in EXACT:
        assert getattr(planned, field) == getattr(whole, field), field
    assert whole.temp_bytes <= planned.temp_bytes <= (1 + temp_over) * whole.temp_bytes
    assert planned.model_flops == whole.model_flops
    key = lambda t: (t.tensor, t.direction, t.shape, t.bytes, t.executions)
    assert sorted(map(key, planned.transfers)) == sorted(map(key, whole.transfers))
    for field in ("bytes_to_host", "bytes_to_device"):
        assert getattr(planned.transfer_summary, field) == getattr(whole.transfer_summary, field)
    assert planned.transfer_summary.link_seconds == pytest.approx(whole.transfer_summary.link_seconds)
    assert planned.collectives.bytes == pytest.approx(whole.collectives.bytes)


@needs_cuda_plugin
@pytest.mark.slow  # 3 compiles of DeepSeek-V3's every feature; test_every_quantity... covers the arithmetic
def test_deepseek_v3_tiny_stretched_to_12_layers_plans_as_its_full_compile():
    planned, whole = extrapolated_and_whole(
        "deepseek_v3_tiny", "minimal_offloaded", "model.num_layers=12", "train.seq_len=64", "train.global_batch_size=8"
    )
    assert planned.extrapolated == "moe 11 from 6 and 8" and planned.host_bytes > 0
    assert_same(planned, whole, temp_over=0.005)


@needs_cuda_plugin
def test_llama_3_1_8b_planned_from_6_and_8_layers_is_its_32_layer_compile():
    """Llama 3.1 8B's shapes (8B parameters, their optimizer state, 4,096-wide layers) at 2 x 64
    tokens, on a B200: its 124 GB fit the B200's 178 GiB with room, where on an H200 (141 GB) XLA
    rematerialises to relieve the memory pressure and the full program is no longer the line's
    (1.4 layers' matmuls more)."""
    planned, whole = extrapolated_and_whole(
        "llama3_1_8b", "qkv_offload", "train.seq_len=64", "train.global_batch_size=2", target=TARGETS["b200"]
    )
    assert planned.extrapolated == "decoder 32 from 6 and 8" and planned.host_bytes > 0
    assert_same(planned, whole, temp_over=0.002)
