"""benchmarks/tpu_check.py without a TPU: every case's command is a valid run config, its
records are read as written, a refusal is recorded with the bytes it names, and the report's
table and frontier say what the records say."""

import concurrent.futures
import json

import pytest

from benchmarks import tpu_check
from benchmarks.tpu_report import frontier, markdown_table
from ferry.config.overrides import compose_node
from ferry.config.root import load_config
from tests.conftest import CONFIGS, compose_config

GIB = 2**30


@pytest.mark.parametrize("case", ["minimal_offloaded", "jax_offload", "full_remat"])
def test_each_case_is_a_valid_run(case, tmp_path):
    overrides = tpu_check.case_overrides(case, 16, tmp_path / "run", check_policy=case == "minimal_offloaded")
    config = compose_config(*[o for o in overrides if not o.startswith("platform=")])
    assert config.model.dim == 2048 and config.model.num_layers == 4 and config.model.vocab_size == 32768
    assert config.train.global_batch_size == 16 and config.train.seq_len == 2048 and config.train.log_every == 1
    assert not config.checkpoint.final
    assert config.offload.engine == ("jax" if case == "jax_offload" else "ferry")
    assert (config.profile.start_step is not None) == (case in tpu_check.TRACED_CASES)
    assert "platform=tpu" in overrides


def test_metrics_are_the_timed_steps_medians(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": step, "tokens_per_s": 1000.0 * step, "step_time_s": 1.0 / step, "mfu": 0.1 * step}
        | {"mfu_full_attention": 0.11 * step, "mfu_convention": "causal_attention_halved"}
        | {"device_memory_peak_bytes": 9 * GIB, "device_memory_compiled_bytes": 9 * GIB - 5}
        for step in range(1, 8)
    ]
    path.write_text("\n".join(json.dumps(r) for r in records))
    read = tpu_check.read_metrics(path)
    assert read["tokens_per_s"] == 3500.0  # steps 2-5: the first compiles, the last two are traced
    assert read["mfu"] == pytest.approx(0.35) and read["mfu_full_attention"] == pytest.approx(0.385)
    assert read["mfu_convention"] == "causal_attention_halved"
    assert read["hbm_peak_bytes"] == 9 * GIB and read["compiled_bytes"] == 9 * GIB - 5


def test_an_out_of_memory_refusal_is_recorded_with_its_bytes():
    line = "the compiled train step needs 16.33 GiB per device but a device has 15.75 GiB free"
    record = tpu_check.refusal(f"platform tpu: ...\nerror: {line}\n", 2)
    assert record["status"] == "oom" and record["compiled_bytes"] == int(16.33 * GIB)
    assert tpu_check.refusal("Traceback ...\nValueError: boom", 1)["status"] == "failed"


def test_the_refusal_is_read_from_the_error_line_not_from_notes_before_it():
    """As a v5e run printed it: a note that also says 'does not fit' comes first."""
    output = (
        "[   4.8s] note: train.warmup_steps=20 does not fit a run of train.steps=7; warming up over 0 step(s)\n"
        "[  30.1s] error: the train step does not fit 1 x TPU v5 lite: XLA refused to compile it, its HLO "
        "temporaries need 16.33 GiB per device, more than the 15.75 GiB of HBM the compiler gives a program\n"
    )
    record = tpu_check.refusal(output, 2)
    assert record["status"] == "oom" and record["compiled_bytes"] == int(16.33 * GIB)
    assert record["message"].startswith("the train step does not fit 1 x TPU v5 lite")


def test_table_and_frontier():
    results = [
        {"preset": "full_remat", "global_batch": 8, "status": "ok", "tokens_per_s": 100.0, "hbm_peak_bytes": 8 * GIB},
        {"preset": "minimal", "global_batch": 8, "status": "ok", "tokens_per_s": 120.0, "hbm_peak_bytes": 14 * GIB},
        {"preset": "qkv_offload", "global_batch": 8, "status": "ok", "tokens_per_s": 90.0, "hbm_peak_bytes": 9 * GIB},
        {"preset": "save_all", "global_batch": 8, "status": "oom", "compiled_bytes": 17 * GIB},
    ]
    table = markdown_table(results)
    assert "| 8 | minimal | 120 | 1.200 |" in table and "oom (needs 17.00 GiB)" in table
    points = [(r["hbm_peak_bytes"], r["tokens_per_s"], r["preset"]) for r in results if "tokens_per_s" in r]
    assert [p[2] for p in frontier(points)] == ["full_remat", "minimal"]


def test_auto_pick_becomes_a_run(tmp_path):
    """The planner's offload_auto.yaml, as tpu_check turns it into the run of auto's pick."""
    (tmp_path / "offload_auto.yaml").write_text(
        "# offload=auto for v5e\nname: auto_v5e\nkeep_all: false\ndefault: null\noptimizer: device\n"
        "params: device\ntensors:\n  decoder_layer_input: device\n  query_proj: device\n  mlpwi_0: offload\n"
        "  mlpwo: remat\n"
    )
    pick = tpu_check.preset_overrides(tmp_path / "offload_auto.yaml")
    overrides = tpu_check.case_overrides("auto", 16, tmp_path / "run", False, pick)
    # as launch/run.py composes them (entries of offload.tensors that full_remat does not list)
    config = load_config(compose_node("train", [o for o in overrides if not o.startswith("platform=")], CONFIGS))
    assert config.offload.name == "auto_v5e" and config.offload.default is None
    assert dict(config.offload.tensors) == {
        "decoder_layer_input": "device",
        "query_proj": "device",
        "mlpwi_0": "offload",
        "mlpwo": "remat",
    }
    assert "mode=plan" in tpu_check.plan_command(16, tmp_path) and "target=v5e" in tpu_check.plan_command(16, tmp_path)
    assert tpu_check.auto_measured(tmp_path / "offload_auto.yaml") is None  # it timed nothing
    with (tmp_path / "offload_auto.yaml").open("a") as timed:
        timed.write("measured:\n  pick: 2\n  reason: the fastest measured\n  candidates: []\n")
    assert tpu_check.auto_measured(tmp_path / "offload_auto.yaml") == {
        "pick": 2,
        "reason": "the fastest measured",
        "candidates": [],
    }


def test_the_trace_reads_exposed_time_the_floor_and_the_in_step_link_rate(monkeypatch, tmp_path):
    from ferry.xla import profile_trace
    from ferry.xla.profile_trace import StepProfile, TracedCopy

    gb = 10**9
    copies = (  # 1 GB to host in flight for 0.1 s (10 GB/s), 1 GB back over 0.2 s (5 GB/s), 0.05 s waited
        TracedCopy("store", "to host", gb, 0.0, 0.1e9, 0.0, 0.1e9),
        TracedCopy("reload", "to device", gb, 0.3e9, 0.5e9, 0.05e9, 0.15e9),
    )
    profile = StepProfile(step_ns=0.6e9, compute_ns=0.5e9, copies=copies, compute_before_reload_ns=0.2e9)
    monkeypatch.setattr(profile_trace, "newest_xplane", lambda directory: tmp_path / "x.xplane.pb")
    monkeypatch.setattr(profile_trace, "step_profiles", lambda path: [profile, profile])
    record = tpu_check.read_trace(tmp_path, {"to_host_gbps": 10.0, "to_device_gbps": 10.0})
    assert record["exposed_copy_s"] == pytest.approx(0.05) and record["compute_s"] == pytest.approx(0.5)
    assert record["in_step_to_host_gbps"] == pytest.approx(10.0) and record["in_step_to_device_gbps"] == pytest.approx(
        5.0
    )
    assert record["link_s"] == pytest.approx(0.2)  # 1 GB each way at the probe's 10 GB/s
    assert record["exposed_floor_s"] == pytest.approx(0.0)  # 0.1 s of stores under 0.2 s, 0.1 of reloads under 0.3


def test_extra_overrides_reach_every_case_and_autos_plan(monkeypatch, tmp_path):
    """`--extra`: the same overrides in a preset's run, a placement of one's own and auto's plan."""
    extra = ["offload.peel=3", "platform.xla_flags.xla_tpu_host_transfer_overlap_limit=24"]
    monkeypatch.setattr(tpu_check, "EXTRA", extra)
    monkeypatch.setattr(tpu_check, "CUSTOM", {"mine": ["offload=minimal", "offload.tensors.mlpwi_0=offload"]})
    for case in ("minimal_offloaded", "mine"):
        overrides = tpu_check.case_overrides(case, 16, tmp_path / "run", False)
        assert overrides[-len(extra) :] == extra
        config = load_config(compose_node("train", [o for o in overrides if not o.startswith("platform=")], CONFIGS))
        assert config.offload.peel == 3 and config.platform.xla_flags["xla_tpu_host_transfer_overlap_limit"] == 24
    assert tpu_check.plan_command(16, tmp_path)[-len(extra) :] == extra


def test_the_plot_draws_the_run_it_is_asked_for(tmp_path):
    """`--plot --run`: the README's PNG is one run's frontier, though later runs follow it."""
    pytest.importorskip("matplotlib")
    from benchmarks.tpu_report import plot_frontier

    case = {"global_batch": 8, "status": "ok", "tokens_per_s": 100.0, "hbm_peak_bytes": 8 * GIB, "date": "2026-12-06"}
    results = [{"run": "run 4: presets", "preset": "full_remat", **case}, {"run": "run 5", "preset": "mo", **case}]
    assert plot_frontier(results, tmp_path / "a.png", "run 4:").endswith("(run 4: presets)")
    assert plot_frontier(results, tmp_path / "c.png").endswith("(run 5)") and (tmp_path / "a.png").exists()
    assert plot_frontier(results, tmp_path / "b.png", "run 9").startswith("no PNG: no run's label starts with")
    assert not (tmp_path / "b.png").exists()


def test_auto_is_not_started_with_less_budget_than_its_plan_needs(monkeypatch, tmp_path):
    """A case is started only with the budget it needs: auto's plan ran 110 to 190 s on the chip,
    and started with 60 s left it was killed unfinished; a preset needs 20 s."""
    ran = []

    def run_case(case, batch, *args):
        ran.append(case)
        return {"preset": case, "global_batch": batch, "status": "ok", "tokens_per_s": 1.0, "hbm_peak_bytes": GIB}

    monkeypatch.setattr(tpu_check, "run_case", run_case)
    out = tmp_path / "check.json"
    argv = ["tpu_check.py", "--batches", "16", "--no-link", "--presets", "full_remat", "auto", "--out", str(out)]
    argv += ["--compile-workers", "0"]
    for budget, started in (("100", ["full_remat"]), ("400", ["full_remat", "auto"])):
        ran.clear()
        monkeypatch.setattr("sys.argv", [*argv, "--budget-s", budget])
        assert tpu_check.main() == 0
        assert ran == started, budget
    monkeypatch.setattr("sys.argv", [*argv, "--budget-s", "100"])
    tpu_check.main()
    skipped = [r for r in json.loads(out.read_text()) if r["status"].startswith("skipped")]
    assert [r["preset"] for r in skipped] == ["auto"]


def test_a_budget_that_cannot_reach_auto_is_said_before_anything_runs():
    """Twice on the chip a --budget-s of 300 and 330 skipped auto after full_remat had run."""
    note = tpu_check.auto_budget_note(["full_remat", "auto"], 330)
    assert note is not None and "--budget-s 330 will likely not start offload=auto" in note
    assert "give --budget-s 340 or more" in note
    assert tpu_check.auto_budget_note(["full_remat", "auto"], 400) is None
    assert tpu_check.auto_budget_note(["full_remat"], 100) is None


def done(returncode, output):
    future = concurrent.futures.Future()
    future.set_result((returncode, output))
    return future


def test_a_case_compiled_ahead_is_the_same_run_and_its_refusal_skips_the_chip(monkeypatch, tmp_path):
    """`mode=compile` of a case is its run's command (the same program, so the run loads it from
    the cache) plus mode and target; the compile's refusal over HBM is the case's record, and the
    case never reaches the chip; a compile not done in time or failed leaves the run to compile."""
    command = tpu_check.compile_command("qkv_offload", 8)
    overrides = tpu_check.case_overrides("qkv_offload", 8, tmp_path, False)
    launched = command[2:]  # after python and launch/run.py
    assert launched[-2:] == ["mode=compile", "target=v5e"] and launched[:-2][:-4] == overrides[:-4]
    assert compose_config(*[o for o in launched if not o.startswith("platform=")]).target == "v5e"  # valid
    oom = "[ 20.1s] error: the train step does not fit 1 x TPU v5e: XLA refused to compile it, its HLO "
    oom += "temporaries need 16.33 GiB per device"
    assert tpu_check.compiled_ahead(done(0, "[ 30.0s] compiled the train step for 1 x TPU v5e in 27.5 s (...)"), 1) == {
        "compiled_ahead_s": 27.5
    }
    refused = tpu_check.compiled_ahead(done(2, oom), 1)
    assert (
        refused["status"] == "oom"
        and refused["compiled_bytes"] == int(16.33 * GIB)
        and "mode=compile" in refused["refused_by"]
    )
    assert tpu_check.compiled_ahead(done(1, "Traceback"), 1)["compiled_ahead"].startswith("failed (exit 1)")
    assert tpu_check.compiled_ahead(concurrent.futures.Future(), 0.01) == {"compiled_ahead": "not done in time"}
    assert tpu_check.compiled_ahead(None, 1) == {}

    class Compiles:  # save_all's compile refuses; full_remat's compiles
        def __init__(self, keys, seq, workers):
            assert keys == [("full_remat", 16), ("save_all", 16)] and workers == 2  # in the order the cases run

        def get(self, key):
            return (
                done(2, oom) if key[0] == "save_all" else done(0, "compiled the train step for 1 x TPU v5e in 30.0 s")
            )

        def wait(self):
            waited.append(len(ran))
            return 1.0

        def stop(self):
            pass

    ran, waited = [], []

    def run_case(case, batch, *args):
        ran.append(case)
        return {"preset": case, "global_batch": batch, "status": "ok", "tokens_per_s": 1.0, "hbm_peak_bytes": GIB}

    monkeypatch.setattr(tpu_check, "Compiles", Compiles)
    monkeypatch.setattr(tpu_check, "run_case", run_case)
    out = tmp_path / "check.json"
    argv = ["tpu_check.py", "--batches", "16", "--no-link", "--presets", "save_all", "full_remat", "--out", str(out)]
    monkeypatch.setattr("sys.argv", [*argv, "--compile-workers", "2"])
    assert tpu_check.main() == 0 and ran == ["full_remat"]
    assert waited == [0]  # every compile ended before the first case was timed
    records = {r["preset"]: r for r in json.loads(out.read_text())}
    assert records["save_all"]["status"] == "oom" and records["full_remat"]["compiled_ahead_s"] == 30.0


def test_full_remat_then_auto_start_each_batch_so_the_budget_reaches_auto(monkeypatch):
    """Last in a batch, auto (which needs 300 s of budget) never started within the default budget
    (run 6); now each batch starts with the baseline and auto, and batch 16 comes first."""
    monkeypatch.setattr(tpu_check, "CUSTOM", {"mine": ["offload=minimal"]})
    order = tpu_check.case_order(list(tpu_check.CASES))
    assert order[:2] == ["full_remat", "auto"] and order[-1] == "mine"
    assert sorted(order[2:-1]) == sorted(c for c in tpu_check.CASES if c not in ("full_remat", "auto"))
    assert tpu_check.case_order(["qkv_offload"]) == ["qkv_offload", "mine"]
    assert tpu_check.BATCH_ORDER[0] == 16


def test_compiles_wait_returns_once_every_compile_has_ended(monkeypatch):
    """The cases are timed only after every compile ahead has ended: run 10's first case, timed
    beside six compiles, ran 0.402 s a step against 0.326 alone."""
    import time

    def timed_output(command, timeout, children):
        time.sleep(0.2)
        return 0, "compiled the train step for 1 x TPU v5e in 0.2 s"

    monkeypatch.setattr(tpu_check, "timed_output", timed_output)
    compiles = tpu_check.Compiles([("full_remat", 8), ("minimal", 8), ("qkv_offload", 8)], tpu_check.SEQ, 2)
    assert compiles.wait() >= 0.35  # two rounds of two workers
    assert all(compiles.get(key).done() for key in compiles.futures)
