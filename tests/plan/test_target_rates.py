"""The plan's step-time estimate runs a program's matmuls at its target's matmul rate: the dense
bf16 peak, times the compute fraction measured on a chip where one was (v5e); offload=auto keeps
free the HBM its platform's runtime takes beside a program."""

import dataclasses

import pytest

from ferry.plan.auto import fits_with_headroom, hbm_limit
from ferry.plan.memory_plan import MemoryPlan
from ferry.plan.transfers import Transfer, TransferSummary
from ferry.xla.targets import TARGETS, V5E_COMPUTE_FRACTION


def test_only_a_measured_chip_runs_below_its_peak():
    v5e = TARGETS["v5e"]
    assert v5e.compute_fraction == V5E_COMPUTE_FRACTION == pytest.approx(0.651, abs=1e-3)
    assert v5e.matmul_rate == pytest.approx(197e12 * 0.651, rel=1e-3)
    for name in ("v5p", "v6e", "h100", "h200", "b200", "gb200"):
        assert TARGETS[name].matmul_rate == TARGETS[name].bf16_peak_flops


def _plan(target: str) -> MemoryPlan:
    transfer = Transfer("q", "to host", "loop", "bf16[8,64]", 1024, 4, 1e6, 1e-6, 1e-6)
    return MemoryPlan(
        target=target, mesh="one", policy="p", argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0,
        host_bytes=0, flops=41.8e12, matmuls=1, capacity_bytes=1, host_capacity_bytes=None, compile_options=(),
        transfers=(transfer,), transfer_summary=TransferSummary(0, 0, 0.0, 0.0, 0.02), compile_seconds=0.0,
        matmul_rate=TARGETS[target].matmul_rate,
    )  # fmt: skip


def test_the_estimate_takes_the_measured_rate():
    """full_remat's 41.8 TFLOP at batch 8 on v5e: 212 ms at the peak, the 326 ms the chip measured."""
    v5e = _plan("v5e").estimate
    assert v5e.matmul_seconds == pytest.approx(0.3259, rel=1e-3)
    assert v5e.exposed_copy_seconds == 0.02
    at_peak = dataclasses.replace(_plan("v5e"), matmul_rate=TARGETS["v5e"].bf16_peak_flops).estimate
    assert at_peak.matmul_seconds == pytest.approx(0.2122, rel=1e-3)


def test_auto_leaves_hbm_free_only_where_the_runtime_takes_more_than_the_program():
    """A TPU program XLA compiled holds on the chip what it compiled to, and XLA refuses one over
    the chip's HBM: at batch 16 of the v5e shape the two placements 1.1x full_remat's speed
    compiled to 15.57 and 15.69 of 15.75 GiB and ran, which 5% of headroom ruled out. A GPU's
    allocator and libraries take more than the program, so there auto keeps 5% free."""
    for target, fits in (("v5e", True), ("v5p", True), ("v6e", True), ("h200", False), ("b200", False)):
        plan = dataclasses.replace(_plan(target), capacity_bytes=1000, temp_bytes=996)
        assert fits_with_headroom(plan) is fits, target
        assert hbm_limit(plan) == (1000 if fits else 950)
    assert not fits_with_headroom(dataclasses.replace(_plan("v5e"), capacity_bytes=1000, temp_bytes=1001))
