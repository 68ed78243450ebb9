"""benchmarks/gpu_check.py: its CPU part runs as a user types it, its micro batch search finds the
largest batch that fits, its slice is DeepSeek-V3 at full width, and its planning step compiles
deviceless for an H200."""

import os
import subprocess
import sys

import pytest
from rich.console import Console

from benchmarks.gpu_check import SLICE, largest_fitting, measure_slice, plan_slice_deviceless, slice_config, slice_table
from tests.conftest import ROOT, load_model_config


@pytest.mark.parametrize(
    ("bytes_of", "capacity"),
    [
        (lambda b: 10 + 3 * b, 40),  # a line: 10 fits
        (lambda b: 10 + 3 * b, 12),  # nothing fits
        (lambda b: 10 + 3 * b, 13),  # only 1
        (lambda b: 10 + b * b, 110),  # convex
        (lambda b: 10 + 30 * b**0.5, 200),  # concave
        (lambda b: 5 + b, 10**6),  # everything up to the limit
    ],
)
def test_largest_fitting_finds_the_largest_batch_that_fits(bytes_of, capacity):
    calls = []

    def counted(batch):
        calls.append(batch)
        return bytes_of(batch)

    batch, used = largest_fitting(counted, capacity, limit=64)
    best = max((b for b in range(1, 65) if bytes_of(b) <= capacity), default=0)
    assert batch == best
    assert used == bytes_of(max(best, 1))
    assert len(calls) == len(set(calls)) <= 12  # never the same compile twice


def test_a_line_takes_four_compiles():
    calls = []
    largest_fitting(lambda b: calls.append(b) or 1000 + 100 * b, 4000)
    assert calls == [1, 2, 30, 31]


def test_the_slice_is_deepseek_v3_at_full_width():
    full = load_model_config("deepseek_v3")
    model = slice_config("moe_offload", 4, 4096).model
    width = ("dim", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_dim", "dense_mlp_dim", "moe_mlp_dim")
    assert {k: getattr(model, k) for k in width} == {k: getattr(full, k) for k in width}
    assert model.vocab_size == full.vocab_size
    assert (model.num_layers, model.num_dense_layers, model.mtp_depth) == (3, 1, 0)
    assert model.experts_per_token == full.experts_per_token


def test_the_cpu_part_runs_the_self_check_and_says_the_rest_needs_a_gpu():
    presets = ["minimal_offloaded", "moe_offload", "save_all"]
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--models", "llama_tiny", "--presets", *presets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        # as a user runs it: the script keeps JAX off the CUDA plugin where there is no GPU
        env={**{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}, "COLUMNS": "160"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if "llama_tiny" in line]
    assert len(rows) == 1 and "minimal_offloaded" in rows[0] and "decoder" in rows[0] and "ok" in rows[0]
    assert "no GPU here" in result.stdout


@pytest.mark.slow  # three deviceless H200 compiles; test_largest_fitting covers the search, test_plan the planner
def test_the_planning_step_runs_deviceless_for_an_h200():
    tiny = ("model=deepseek_v3_tiny", "model.mtp_depth=0")
    chosen = plan_slice_deviceless("h200", 64, ("full_remat",), Console(), model=tiny)
    batch, used = chosen["full_remat"]
    assert batch == 64 and 0 < used < 141e9  # the tiny model fits the search's limit
    assert SLICE[0] == "model=deepseek_v3"


def test_the_gpu_measurement_runs_on_the_cpu_with_a_tiny_model():
    """The GPU path's own code (compile per batch, search, run, time) on llama_tiny, on the CPU,
    which reports no memory peak."""
    result = measure_slice("full_remat", 32, 1, model=("model=llama_tiny",), capacity=10**12, limit=2)
    assert result["micro_batch"] == 2 and result["compiles"] == 2
    assert result["tokens_per_s"] > 0 and result["peak_bytes"] is None and result["predicted_bytes"] > 0
    offload = {**result, "preset": "minimal_offloaded", "tokens_per_s": result["tokens_per_s"] / 2}
    printed = Console(width=200, record=True)
    printed.print(slice_table([result, offload, {**result, "preset": "moe_offload", "micro_batch": 0}], 32, "cpu"))
    rows = {line.split()[1]: line for line in printed.export_text().splitlines() if "_" in line and "│" in line}
    assert "1.000x" in rows["full_remat"] and "0.500x" in rows["minimal_offloaded"]
    assert "none fits" in rows["moe_offload"]
