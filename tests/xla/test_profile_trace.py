"""ferry's reader of TPU profiler traces, on events shaped like a v5e trace's: which async
instructions are host copies, which way, how many bytes, and how long the core waited for each."""

from types import SimpleNamespace

import pytest

from ferry.xla.profile_trace import busy_ns, host_copy_direction, profiles_of_lines, uncovered_ns

# instruction texts as the trace's `XLA Ops` / `Async XLA Ops` lines name them (jax 0.10.2, v5e)
TO_HOST = (
    "%dynamic-update-slice-start.2 = ((bf16[4,8,2048,2048]{3,2,1,0:S(5)}, bf16[1,8,2048,2048]{3,2,1,0}, s32[], "
    "s32[], s32[], s32[]), bf16[4,8,2048,2048]{3,2,1,0:S(5)}, u32[]) dynamic-update-slice-start(%a, %b, %c, %d, %e, %f)"
)
TO_DEVICE = (
    "%dynamic-slice-start.1 = ((bf16[4,8,2048,2048]{3,2,1,0:S(5)}, s32[], s32[], s32[], s32[]), "
    "bf16[1,8,2048,2048]{3,2,1,0}, u32[]) dynamic-slice-start(%a, %b, %c, %d, %e)"
)
COPY_TO_HOST = "%copy-start.4 = (f32[1024]{0:S(5)}, f32[1024]{0}, u32[]) copy-start(%x)"
PREFETCH = "%copy-start.5 = (f32[1024]{0:S(1)}, f32[1024]{0}, u32[]) copy-start(%y)"
SLICE_BYTES = 8 * 2048 * 2048 * 2


def test_host_copies_are_told_apart_with_their_bytes():
    assert host_copy_direction(TO_HOST) == ("to host", SLICE_BYTES)
    assert host_copy_direction(TO_DEVICE) == ("to device", SLICE_BYTES)
    assert host_copy_direction(COPY_TO_HOST) == ("to host", 4096)
    assert host_copy_direction(PREFETCH) is None  # a VMEM prefetch, not the host link
    assert host_copy_direction("%fusion.3 = bf16[8]{0} fusion(%p), kind=kLoop") is None


def event(name: str, start: float, end: float, **stats) -> SimpleNamespace:
    start, end = float(start), float(end)
    return SimpleNamespace(name=name, start_ns=start, end_ns=end, duration_ns=end - start, stats=list(stats.items()))


def test_exposed_time_is_the_wait_in_each_done():
    """A step of 100 ns: compute 0-40, a store in flight 10-70 whose done waits 40-70, compute
    70-100 under a reload in flight 75-90 whose done (90-95) sits inside other compute."""
    ops = [
        event("%while.1 = (s32[]) while(%t)", 0, 40),  # holds the fusion: not a leaf
        event("%fusion.1 = bf16[8]{0} fusion(%p)", 0, 40),
        event("%dynamic-update-slice-done.2 = bf16[4]{0:S(5)} dynamic-update-slice-done(%s)", 40, 70),
        event("%fusion.2 = bf16[8]{0} fusion(%q)", 70, 90),
        event("%dynamic-slice-done.1 = bf16[1]{0} dynamic-slice-done(%r)", 90, 95),
        event("%fusion.3 = bf16[8]{0} fusion(%u)", 95, 100),
    ]
    asyncs = [
        event(TO_HOST, 10, 70, hlo_op="dynamic-update-slice-done.2"),
        event(TO_DEVICE, 75, 95, hlo_op="dynamic-slice-done.1"),
        event(PREFETCH, 0, 5, hlo_op="copy-done.5"),
    ]
    (step,) = profiles_of_lines({"Steps": [event("step", 0, 100)], "XLA Ops": ops, "Async XLA Ops": asyncs})
    assert step.step_ns == 100
    store, reload = step.copies
    assert (store.direction, store.wait_ns, store.compute_under_ns) == ("to host", 30, 30)
    assert (reload.direction, reload.wait_ns, reload.compute_under_ns) == ("to device", 5, 15)
    assert step.exposed_copy_ns == 35
    assert step.compute_ns == 65  # busy 0-100 less the two waits
    assert step.bytes("to host") == step.bytes("to device") == SLICE_BYTES
    assert step.link_busy_ns() == 80 and step.link_busy_ns("to host") == 60
    assert step.compute_before_reload_ns == 45  # 0-40 and 70-75: the reload starts at 75
    # at 1 byte/ns a store of SLICE_BYTES outlasts the 45 ns of compute before the reload, and the
    # reload the 20 after it
    assert step.exposed_floor_ns(1.0, 1.0) == (SLICE_BYTES - 45) + (SLICE_BYTES - 20)
    assert step.exposed_floor_ns(1e9, 1e9) == 0.0


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [([], 0.0), ([(0.0, 10.0), (5.0, 20.0)], 20.0), ([(0.0, 1.0), (2.0, 3.0), (2.5, 4.0)], 3.0)],
)
def test_busy_is_the_union(intervals, expected):
    assert busy_ns(intervals) == expected


def test_uncovered():
    assert uncovered_ns([(0.0, 10.0)], [(2.0, 5.0), (8.0, 20.0)]) == 5.0
