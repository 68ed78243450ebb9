"""The DeepSeek-V3-width slice benchmark (benchmarks/moe_slice_tpu.py): its slices are the runs
it says, and what it reads from a run's output is what the run prints."""

import io

import pytest
from rich.console import Console

from benchmarks import moe_slice_tpu
from ferry.offload.schedule import LayerGroup, StateCopy, TransferSchedule, schedule_table
from tests.conftest import compose_config


@pytest.mark.parametrize("name", list(moe_slice_tpu.LAYERS))
def test_each_slice_is_the_deepseek_width_run_it_names(name, tmp_path):
    layers = moe_slice_tpu.LAYERS[name]
    overrides = [*moe_slice_tpu.SLICE, f"model.num_layers={layers}", *moe_slice_tpu.OVERRIDES.get(name, [])]
    overrides.append(f"run.dir={moe_slice_tpu.slice_dir(tmp_path, name)}")  # a name with a comma broke this
    config = compose_config(*[o for o in overrides if not o.startswith("platform=")])
    model = config.model
    assert (model.dim, model.num_experts, model.vocab_size, model.mtp_depth) == (7168, 16, 32768, 0)
    assert model.num_layers == layers and model.num_dense_layers == 1  # the second layer is the MoE one
    assert config.train.global_batch_size == 1 and config.train.seq_len == 2048
    assert config.offload.optimizer == config.offload.params == "host"
    assert config.train.steps == max(moe_slice_tpu.TIMED)
    assert config.offload.stream_prefetch == (name == moe_slice_tpu.PREFETCH)
    assert config.run.dir == str(moe_slice_tpu.slice_dir(tmp_path, name))


def test_the_report_gives_the_moe_share_and_what_prefetching_gains():
    ok = {"status": "ok", "tokens_per_s": 1.0, "mfu": 0.01, "hbm_peak_bytes": 2**30, "compiled_bytes": 2**30}
    records = [
        ok | {"slice": name, "step_s": step, "state_each_way_bytes": 2**30}
        for name, step in (("dense", 1.0), ("dense+moe", 2.0), (moe_slice_tpu.PREFETCH, 1.6))
    ]
    text = moe_slice_tpu.report(records)
    assert "the MoE layer's share of the dense+moe step: 50.0%" in text
    assert "prefetching the update's state: 1.250x the dense+moe step's speed" in text
    assert "prefetching" not in moe_slice_tpu.report(records[:2])


def test_the_state_streamed_each_way_is_read_from_the_schedule_the_run_prints():
    state = (StateCopy("moe", "AdamW moments", 1, 3 * 2**30), StateCopy("moe", "master weights", 1, 2**30))
    schedule = TransferSchedule("full_remat", (LayerGroup("moe", 1, ()),), state=state)
    console = Console(file=io.StringIO(), width=400)
    console.print(schedule_table(schedule))
    assert moe_slice_tpu.state_each_way(console.file.getvalue()) == 4 * 2**30
    assert moe_slice_tpu.state_each_way("no state on host") is None


def test_the_link_floor_moves_the_state_down_and_back():
    rates = {"to_device_gbps": 10.0, "to_host_gbps": 20.0, "both_gbps": 25.0}
    floor = moe_slice_tpu.link_floor(10**10, rates)
    assert floor == pytest.approx({"link_serial_s": 1.0 + 0.5, "link_both_ways_s": 0.8})
    assert moe_slice_tpu.link_floor(None, rates) == {} and moe_slice_tpu.link_floor(10**10, None) == {}
