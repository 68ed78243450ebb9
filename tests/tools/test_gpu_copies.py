"""benchmarks/gpu_copies.py: its configurations, its reading of a GPU profiler trace (exposed copy
time: copies with no kernel beside them), and its CPU run."""

import json
import os
import subprocess
import sys

import pytest
from jax.profiler import ProfileData

from benchmarks.gpu_copies import Configuration, busy_ns, trace_exposure, uncovered_ns
from tests.conftest import ROOT


def test_a_configuration_names_its_preset_schedule_and_state():
    plain = Configuration.parse("qkv_offload")
    assert (plain.preset, plain.schedule, plain.state_on_host) == ("qkv_offload", "ferry", False)
    assert "offload.pipelined=true" in plain.overrides() and plain.name == "qkv_offload"
    xla = Configuration.parse("minimal_offloaded@xla+state-on-host")
    assert (xla.preset, xla.schedule, xla.state_on_host) == ("minimal_offloaded", "xla", True)
    assert {"offload.pipelined=false", "offload.optimizer=host", "offload.params=host"} <= set(xla.overrides())
    assert xla.name == "minimal_offloaded@xla+state-on-host"
    with pytest.raises(SystemExit, match="one of ferry, per-layer, xla, both"):
        Configuration.parse("qkv_offload@sometimes")


def test_busy_time_is_the_union_and_uncovered_time_what_no_cover_overlaps():
    assert busy_ns([(0, 10), (5, 15), (20, 30)]) == 25
    assert busy_ns([]) == 0
    copies = [(0, 10), (20, 30)]
    assert uncovered_ns(copies, [(5, 25)]) == 10  # 0-5 and 25-30
    assert uncovered_ns(copies, []) == 20
    assert uncovered_ns(copies, [(0, 40)]) == 0


def xspace(path, lines: dict[str, list[tuple[str, int, int]]]) -> None:
    """A profiler trace of one GPU: per stream line, events (name, start us, duration us)."""
    names = sorted({name for events in lines.values() for name, _, _ in events})
    ids = {name: i + 1 for i, name in enumerate(names)}
    text = ['planes { name: "/device:GPU:0"']
    for line, events in lines.items():
        text.append(f'lines {{ name: "{line}" timestamp_ns: 0')
        for name, start, duration in events:
            ps = f"offset_ps: {start * 10**6} duration_ps: {duration * 10**6}"
            text.append(f"events {{ metadata_id: {ids[name]} {ps} }}")
        text.append("}")
    text += [f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in ids.items()]
    text.append("}")
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace("\n".join(text)))


def test_a_trace_gives_the_copy_time_no_kernel_hides(tmp_path):
    trace = tmp_path / "gpu.xplane.pb"
    xspace(
        trace,
        {
            "Stream #14(Compute)": [("nvjet_gemm", 0, 100), ("loop_add_fusion", 100, 50), ("nvjet_gemm", 300, 100)],
            "Stream #16(MemcpyD2H)": [("MemcpyD2H", 80, 100)],  # 80-180: hidden by both kernels to 150
            "Stream #15(MemcpyH2D)": [("MemcpyH2D", 250, 100)],  # 250-350: 250-300 bare
            "Stream #14(MemcpyD2D,Compute)": [("MemcpyD2D", 500, 10)],  # not a host copy
        },
    )
    measured = trace_exposure(trace, steps=2)
    us = lambda seconds: round(seconds * 1e6)
    assert us(measured["copy_seconds"]) == 100  # 200 us of host copies over 2 steps
    assert us(measured["to_host_seconds"]) == us(measured["to_device_seconds"]) == 50
    assert us(measured["exposed_seconds"]) == 40  # (30 + 50) / 2
    assert us(measured["exposed_to_matmuls_seconds"]) == 65  # (80 + 50) / 2: the add fusion is no matmul
    assert us(measured["kernel_seconds"]) == 125 and us(measured["matmul_kernel_seconds"]) == 100
    assert measured["copies"] == 1.0


def test_on_the_cpu_the_script_compiles_reads_and_runs_each_configuration(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_copies.py", "--configs", "save_all", "full_remat", "--steps", "1"]
        + ["--trace-steps", "1", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"},  # as a user runs it
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    for name in ("save_all", "full_remat"):
        assert results[name]["verified"] and results[name]["step_seconds"] > 0
        assert results[name]["measured"] is None  # a CPU trace has no GPU plane
    assert results["full_remat"]["matmul_tflop"] > results["save_all"]["matmul_tflop"]  # it recomputes
