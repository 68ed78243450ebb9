"""Out of memory is a refusal: a step XLA refuses to compile over HBM (libtpu checks at compile
time) is one line saying what it needs, what the device has and what would fit, exit 2, with
nothing allocated and the run directory as it was; in `mode=plan` it is the preset's OOM row."""

import dataclasses
import json
import shutil

import jax
import pytest

import ferry.run.out_of_memory as out_of_memory
import ferry.run.training as train_run
import ferry.train.compiled_step as compiled_step
from ferry.plan.planner import out_of_memory_plan
from ferry.plan.report import refused_lines, write_plan
from ferry.xla.compile_oom import CompileTimeOom, StepOverHbm, parse_size
from ferry.xla.targets import TARGETS
from tests.conftest import SMALL_RUN, compose_config, needs_libtpu, run_launcher
from tests.launcher_cases import load_launcher, run_case
from tests.run.test_bad_inputs import tree_digest

# what jax 0.10.2 raised on the v5e chip for save_all at batch 8 of the 386M Llama (issue 45), in
# the wording libtpu 0.0.50 uses deviceless too
V5E_OOM = (
    "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (16.33G) exceeds available HBM (15.75G). HLO module: jit_step.\n"
    "See https://openxla.org/xla/errors/error_1000 for more details."
)
OLDER_OOM = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 21.95G of "
    "15.48G hbm. Exceeded hbm capacity by 6.47G."
)


def test_xla_refusals_are_read_into_numbers():
    oom = CompileTimeOom.of(jax.errors.JaxRuntimeError(V5E_OOM))
    assert oom == CompileTimeOom(round(16.33 * 2**30), round(15.75 * 2**30), "HLO temporaries")
    older = CompileTimeOom.of(jax.errors.JaxRuntimeError(OLDER_OOM))
    assert (older.needed_bytes, older.available_bytes) == (round(21.95 * 2**30), round(15.48 * 2**30))
    assert parse_size("530.00M") == 530 * 2**20 and parse_size("0B") == 0
    # not the step's size: a kernel's VMEM, an allocation at run time, any other error
    for other in (
        "RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem. Used 20.00M of 16.00M vmem.",
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.",
        "INVALID_ARGUMENT: HLO temporaries (16.33G) exceeds available HBM (15.75G)",
    ):
        assert CompileTimeOom.of(jax.errors.JaxRuntimeError(other)) is None


@pytest.fixture
def over_hbm(monkeypatch):
    """The run's compile raises what libtpu raised on the v5e chip; nothing may be allocated."""

    def refuse(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(V5E_OOM)

    def allocated(*args, **kwargs):
        raise AssertionError("the train state was allocated after the compile was refused")

    monkeypatch.setattr(compiled_step, "compile_lowered", refuse)
    monkeypatch.setattr(train_run, "initial_state", allocated)
    return load_launcher()


def refusal_line(case: dict) -> str:
    assert case["code"] == 2, case
    assert "Traceback" not in case["stderr"] + case["stdout"]
    line = case["stdout"].strip().splitlines()[-1]
    assert line.startswith("error: the train step does not fit 1 x cpu: XLA refused to compile it")
    return line


def test_a_run_over_hbm_is_refused_in_one_line_leaving_its_directory_as_it_was(over_hbm, tmp_path, finished_run):
    """A new run: XLA's figures and the levers, its directory not made. A resumed run: its
    checkpoints, metrics and lock file byte for byte as they were."""
    new = tmp_path / "new"
    line = refusal_line(run_case(over_hbm, [*SMALL_RUN, f"run.dir={new}", f"run.root={tmp_path}"]))
    assert "its HLO temporaries need 16.33 GiB per device, more than the 15.75 GiB of HBM" in line
    assert f"No plan of this step for <gpu or tpu> under run.root={tmp_path}" in line
    for lever in ("offload=full_remat", "train.micro_batch_size=2", "offload.optimizer=host", "train.seq_len"):
        assert lever in line
    assert not new.exists()

    resumed = tmp_path / "resumed"
    shutil.copytree(finished_run, resumed)
    before = tree_digest(resumed)
    refusal_line(run_case(over_hbm, [*SMALL_RUN, "train.steps=8", f"run.dir={resumed}"]))
    assert tree_digest(resumed) == before


def test_the_refusal_names_what_the_plan_of_the_same_step_found_to_fit(over_hbm, tmp_path, monkeypatch):
    """`mode=plan` for this accelerator wrote plan.json under run.root: the refusal names the
    presets that fit there, fastest first; a plan of another step is not advice."""
    monkeypatch.setattr(out_of_memory, "accelerator_name", lambda kind: "v5e")
    config = compose_config(*SMALL_RUN)
    oom = CompileTimeOom(round(16.33 * 2**30), round(15.75 * 2**30), "HLO temporaries")
    refused = out_of_memory_plan(StepOverHbm(oom, 2**20, 0, 1.0, "1 x TPU v5e"), config, TARGETS["v5e"], "save_all", {})
    fits = dataclasses.replace(refused, policy="full_remat", compile_oom=None, temp_bytes=5 * 2**30)
    slower = dataclasses.replace(fits, policy="minimal_offloaded", temp_bytes=3 * 2**30, flops=fits.flops * 2)
    write_plan([refused, fits, slower], [], tmp_path / "plan_of_this_step", config)
    other = compose_config(*SMALL_RUN, "train.seq_len=64")
    write_plan([dataclasses.replace(fits, policy="qkv_offload")], [], tmp_path / "plan_of_another", other)

    line = refusal_line(run_case(over_hbm, [*SMALL_RUN, f"run.dir={tmp_path / 'run'}", f"run.root={tmp_path}"]))
    assert f"mode=plan found for this step on v5e ({tmp_path / 'plan_of_this_step' / 'plan.json'})" in line
    assert "offload=full_remat (5.0 GiB), offload=minimal_offloaded (3.0 GiB) fit, fastest first" in line
    assert "qkv_offload" not in line and "save_all (" not in line
    assert not (tmp_path / "run").exists()


def plan_on_one_v5e(tmp_path, *overrides: str) -> tuple[str, dict]:
    """`mode=plan target=v5e` on one chip (a v5e-1, the 1x1 topology) for llama_tiny at 64 tokens:
    its output and plan.json."""
    run_dir = tmp_path / "plan"
    common = ("mode=plan", "target=v5e", "model=llama_tiny", "train.seq_len=64", f"run.dir={run_dir}")
    result = run_launcher(*common, *overrides, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert "llama_tiny on v5e x 1" in result.stdout
    return result.stdout, json.loads((run_dir / "plan.json").read_text())


@needs_libtpu
def test_plan_llama_tiny_for_one_v5e_chip(tmp_path):
    """A v5e-1 plans like any slice; its offloads land in pinned host memory."""
    out, record = plan_on_one_v5e(tmp_path, "plan.presets=[minimal_offloaded]")
    (plan,) = record["plans"]
    assert plan["target"] == "v5e" and plan["fits"] and plan["host_bytes"] > 0 and plan["compile_oom"] is None
    assert "OOM" not in out
    # its step-time estimate runs the compiled matmuls at the rate measured on a v5e chip, not the peak
    assert plan["matmul_rate"] == TARGETS["v5e"].matmul_rate < TARGETS["v5e"].bf16_peak_flops
    # it copies to host, so libtpu compiled it with the host-offload flags a run of it gets
    options = dict(plan["compile_options"])
    assert options["xla_tpu_host_transfer_overlap_limit"] == 24 and options["xla_max_concurrent_host_send_recv"] == 100


@needs_libtpu
def test_a_preset_libtpu_refuses_over_hbm_is_an_oom_row_of_the_plan(tmp_path):
    """save_all at 16,384 rows: libtpu refuses to compile it (its temporaries, 18.25 GiB, exceed
    the 15.75 GiB a v5e program gets); the plan says so in its row and in one line, exit 0."""
    out, record = plan_on_one_v5e(tmp_path, "train.global_batch_size=16384", "plan.presets=[save_all]")
    assert "OOM (XLA refused to compile it)" in out
    line = next(line for line in out.splitlines() if line.startswith("save_all: OOM at compile for v5e"))
    assert "its HLO temporaries need" in line and "more than the 15.75 GiB of HBM the compiler gives a program" in line
    assert (
        "none of the planned presets fits; try offload=auto, train.micro_batch_size or offload.optimizer=host" in line
    )
    (plan,) = record["plans"]
    assert plan["compile_oom"] and not plan["fits"] and plan["temp_bytes"] > 15.75 * 2**30
    assert record["step"]["global_batch_size"] == 16384


def test_the_oom_line_of_a_plan_names_the_presets_that_fit_fastest_first():
    config = compose_config(*SMALL_RUN)
    oom = CompileTimeOom(round(16.33 * 2**30), round(15.75 * 2**30), "HLO temporaries")
    refused = out_of_memory_plan(StepOverHbm(oom, 2**20, 0, 1.0, "1 x TPU v5e"), config, TARGETS["v5e"], "save_all", {})
    fits = dataclasses.replace(refused, policy="full_remat", compile_oom=None, temp_bytes=5 * 2**30)
    slower = dataclasses.replace(fits, policy="qkv_offload", flops=fits.flops * 2)
    over = dataclasses.replace(fits, policy="minimal", temp_bytes=17 * 2**30)  # compiled, over HBM
    (line,) = refused_lines([refused, slower, fits, over])
    assert line == (
        "save_all: OOM at compile for v5e: its HLO temporaries need 16.33 GiB per device, more than the 15.75 GiB "
        "of HBM the compiler gives a program (arguments 1.0 MiB on top); planned presets that fit, fastest first by "
        "the estimate: full_remat (5.0 GiB), qkv_offload (5.0 GiB)"
    )


def test_every_v5e_and_v6e_slice_a_user_can_rent_is_a_topology():
    v5e, v6e, v5p = TARGETS["v5e"], TARGETS["v6e"], TARGETS["v5p"]
    assert [v5e.topology(n) for n in (1, 4, 8)] == ["v5e:1x1", "v5e:2x2", "v5e:2x4"]
    assert [v6e.topology(n) for n in (1, 4, 8)] == ["v6e:1x1", "v6e:2x2", "v6e:2x4"]
    assert v5p.topology(4) == "v5p:2x2x1"
    with pytest.raises(ValueError, match="1 v5p chips are not a TPU slice; use 4 or a larger power of two"):
        v5p.topology(1)
    with pytest.raises(
        ValueError, match="2 v5e chips are not a TPU slice; use 1, 4 or a larger power of two up to 256"
    ):  # noqa: E501
        v5e.topology(2)
