"""The planner's step-time ESTIMATE: matmuls at the dense peak, exposed host copies and collectives
over the target's links, overlapped (best) or not (worst), and the presets ranked by the middle of
the two."""

import pytest

from ferry.plan.estimate import StepEstimate, collective_traffic, ranked
from ferry.xla.targets import TARGETS
from tests.xla.test_hlo_stats import GROUPS_MODULE


def test_best_overlaps_collectives_and_worst_adds_them():
    estimate = StepEstimate(matmul_seconds=2.0, exposed_copy_seconds=0.5, collective_seconds=1.0, model_flops=5e12)
    assert estimate.best_seconds == 2.5 and estimate.worst_seconds == 3.5 and estimate.middle_seconds == 3.0
    assert estimate.best_tflops == pytest.approx(2.0) and estimate.worst_tflops == pytest.approx(5 / 3.5)
    bound = StepEstimate(matmul_seconds=1.0, exposed_copy_seconds=0.0, collective_seconds=4.0, model_flops=8e12)
    assert bound.best_seconds == 4.0 and bound.worst_seconds == 5.0  # the collectives bound the step
    assert bound.middle_seconds == 4.5  # half the matmuls under them
    record = estimate.to_json()
    assert record["kind"] == "estimate" and record["best_tflops_per_device"] == pytest.approx(2.0)


def test_presets_rank_by_their_middle_estimate_against_full_remat():
    def step(matmul: float, copies: float = 0.0, collectives: float = 0.5) -> StepEstimate:
        return StepEstimate(matmul, copies, collectives, 10e12)

    order = ranked({"full_remat": step(4.0), "save_all": step(3.0), "moe_offload": step(3.0, 0.2)})
    assert [name for name, _, _ in order] == ["save_all", "moe_offload", "full_remat"]
    assert [speedup for _, _, speedup in order] == pytest.approx([4.25 / 3.25, 4.25 / 3.45, 1.0])
    # collectives outlast compute: 1% less of them does not outrank 21% more matmuls (as the best would)
    state_on_host, state_on_device = step(41.39, collectives=57.51), step(34.19, collectives=58.07)
    assert state_on_host.best_seconds < state_on_device.best_seconds
    assert [name for name, _, _ in ranked({"host": state_on_host, "device": state_on_device})] == ["device", "host"]
    assert all(speedup is None for _, _, speedup in ranked({"save_all": step(3.0)}))


def test_a_collective_crossing_nvlink_domains_runs_at_the_network_bandwidth():
    """On H200s (8 per NVLink board) groups within a board use NVLink; on 16 the ring leaves it."""
    h200 = TARGETS["h200"]
    assert h200.collective_bandwidth(((0, 1, 2, 3), (4, 5, 6, 7))) == h200.interconnect_bandwidth
    assert h200.collective_bandwidth(((0, 8), (1, 9))) == h200.scale_out_bandwidth < h200.interconnect_bandwidth
    assert TARGETS["gb200"].collective_bandwidth((tuple(range(72)),)) == TARGETS["gb200"].interconnect_bandwidth
    traffic = collective_traffic(GROUPS_MODULE, h200)  # 8 partitions: one NVLink board
    expected = (16 * 16 * 4 * 3 / 4) + (256 * 4) + (2 * 16 * 4 * 3) + (8 * 16 * 4 * 7 / 8) + (8 * 16 * 4)
    assert traffic.total_bytes == expected
    assert traffic.seconds == pytest.approx(expected / h200.interconnect_bandwidth)
