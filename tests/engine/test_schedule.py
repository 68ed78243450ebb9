"""The transfer schedule's table and totals for llama_tiny."""

import dataclasses
import io

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType

from ferry.models.registry import abstract_model
from ferry.offload.engine import Policy
from ferry.offload.schedule import model_schedule
from ferry.sharding import MESH_AXES, data_parallel_size
from tests.conftest import load_model_config, preset_policy


def test_qkv_offload_schedule(tiny_config):
    model = abstract_model(tiny_config)
    schedule = model_schedule(model, preset_policy("qkv_offload", model), 4, 32, jnp.bfloat16, "qkv_offload")
    rows = {r.name: r for r in schedule.residuals}
    assert [r.name for r in schedule.residuals][:4] == ["decoder_layer_input", "query_proj", "key_proj", "value_proj"]
    q_bytes = 4 * 32 * tiny_config.num_heads * tiny_config.head_dim * 2
    kv_bytes = 4 * 32 * tiny_config.num_kv_heads * tiny_config.head_dim * 2
    assert rows["query_proj"].bytes_per_device == q_bytes
    assert (rows["key_proj"].placement, rows["key_proj"].forward, rows["key_proj"].backward) == (
        "offload",
        "D2H as layer k+1 starts",  # a scanned stack: its copies one layer apart
        "H2D as layer k+1's backward starts",
    )
    assert (rows["mlpwo"].placement, rows["mlpwo"].forward) == ("remat", "-")
    layers = tiny_config.num_layers
    totals = schedule.totals()
    assert totals["device_to_host_bytes_per_step"] == layers * (q_bytes + 2 * kv_bytes)
    assert totals["host_to_device_bytes_per_step"] == totals["device_to_host_bytes_per_step"]
    input_bytes = 4 * 32 * tiny_config.dim * 2
    assert totals["device_residual_bytes_per_step"] == layers * input_bytes
    assert totals["pipeline_residual_bytes_per_step"] == q_bytes + 2 * kv_bytes  # the last layer's stay in HBM
    all_bytes = layers * sum(r.bytes_per_device for r in schedule.residuals)
    assert totals["hbm_bytes_saved_vs_save_all"] == all_bytes - layers * input_bytes - (q_bytes + 2 * kv_bytes)
    assert schedule.to_json()["totals_per_step"] == totals


def test_save_all_keeps_everything(tiny_config):
    model = abstract_model(tiny_config)
    schedule = model_schedule(model, preset_policy("save_all", model), 1, 8, jnp.float32)
    assert {r.placement for r in schedule.residuals} == {"device"}
    assert schedule.hbm_saved_bytes == 0 and schedule.device_to_host_bytes == 0


@pytest.mark.parametrize(
    "shape, mla_q_width, moe_rows",
    [((8, 1, 1, 1), 96, [128]), ((1, 2, 1, 4), 96, [40] * 4), ((2, 2, 2, 1), 48, [128])],
)
def test_schedule_is_sized_per_device_of_the_mesh(shape, mla_q_width, moe_rows):
    """Tensor parallelism halves what a device holds of a head-split residual. Expert parallelism
    runs a ring of one step per device of the expert group, each tagging up to
    moe_tag_capacity_factor (1.25) x a balanced share of one device's slots: 1.25 x 32 x 4 / 4."""
    mesh = AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    model = abstract_model(load_model_config("deepseek_v3_tiny"))
    policy = Policy.from_dict({name: "offload" for name in model.tagged_names()})
    rows = data_parallel_size(mesh)  # a row on each data-parallel device
    moe = model_schedule(model, policy, rows, 32, jnp.bfloat16, mesh=mesh).groups[1]
    shapes = {r.name: r.shape for r in moe.residuals}
    assert shapes["decoder_layer_input"] == (1, 32, 64)
    assert shapes["mla_q"] == (1, 32, mla_q_width)
    assert [r.shape for r in moe.residuals if r.name == "moe_mlpwi_0"] == [(rows, 32) for rows in moe_rows]


def rendered(schedule, width: int) -> str:
    from rich.console import Console

    from ferry.offload.schedule import schedule_table

    console = Console(width=width, record=True, file=io.StringIO())
    console.print(schedule_table(schedule))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 100])
def test_table_fits_the_terminal_with_every_tensor_name_whole(width):
    """deepseek_v3_tiny (the longest names, three layer groups, pipelined and not) with a streamed
    train state: no line wider than the terminal, and every name a user types (offload.tensors.NAME)
    whole on one line."""
    from ferry.offload.schedule import StateCopy

    model = abstract_model(load_model_config("deepseek_v3_tiny"))
    policy = preset_policy("minimal_offloaded", model)
    schedule = model_schedule(model, policy, 8, 4096, jnp.bfloat16, "minimal_offloaded")
    schedule = dataclasses.replace(schedule, state=(StateCopy("moe", "AdamW moments", 2, 3 << 20),))
    text = rendered(schedule, width)
    assert max(len(line) for line in text.splitlines()) <= width
    words = set(text.split())
    for name in {r.name for r in schedule.residuals}:
        assert name in words, (name, text)
    assert "AdamW moments" in text and "D2H k+1, H2D k+1 bwd" in " ".join(text.split())
    assert "H2D bwd = as its layer's backward starts" in " ".join(text.split())  # the legend of the short words


def test_a_wide_terminal_keeps_the_table_in_words(tiny_config):
    model = abstract_model(tiny_config)
    schedule = model_schedule(model, preset_policy("qkv_offload", model), 4, 32, jnp.bfloat16, "qkv_offload")
    text = rendered(schedule, 1000)
    assert "D2H as layer k+1 starts" in text and "H2D as layer k+1's backward starts" in text
    assert all(name in text.split() for name in ("decoder_layer_input", "query_proj", "mlpwo"))
