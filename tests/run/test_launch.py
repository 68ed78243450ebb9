"""`python launch/run.py` as a user runs it: training, the run directory, and refusals."""

import json
import time

import pytest

from tests.conftest import run_launcher


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_run_learns_the_stdlib(tmp_path):
    """The default command (llama_tiny, 200 steps; with the offloading preset that was the default
    before the default became a choice: tests/old_default.py) lowers held-out loss below 60% of its
    starting value."""
    run_dir = tmp_path / "run"
    result = run_launcher(f"run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    records = read_metrics(run_dir)
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert evals[200] < 0.6 * evals[0], evals
    logged = [r for r in records if "loss" in r]
    assert logged[-1]["step"] == 200
    for record in logged:
        assert {"step", "loss", "tokens_per_s", "step_time_s", "learning_rate", "grad_norm"} <= record.keys()
    schedule = json.loads((run_dir / "schedule.json").read_text())
    assert schedule["policy"] == "minimal_offloaded"
    assert schedule["totals_per_step"]["device_to_host_bytes_per_step"] > 0
    assert (run_dir / "config.yaml").read_text().count("minimal_offloaded") == 1
    assert "offload schedule: minimal_offloaded" in (run_dir / "startup.txt").read_text()


def test_per_tensor_override_and_preset(tmp_path):
    run_dir = tmp_path / "run"
    result = run_launcher(
        "offload=qkv_offload",
        "offload.tensors.mlpwo=offload",
        "offload.tensors.query_proj=device",
        "train.steps=2",
        "train.warmup_steps=1",
        "train.eval_every=2",
        f"run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr + result.stdout
    groups = json.loads((run_dir / "schedule.json").read_text())["layer_groups"]
    rows = {r["name"]: r["placement"] for r in groups[0]["residuals"]}
    assert rows["mlpwo"] == "offload" and rows["query_proj"] == "device" and rows["key_proj"] == "offload"
    assert rows["mlpwi_0"] == "remat"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "offload.tensors.mlpwoo=offload",
            "names ['mlpwoo'], which this model never tags; it tags: attention_lse, attention_out",
        ),
        ("offload.tensors.mlpwo=host", "'mlpwo' has placement 'host'; a placement is one of device, offload, remat"),
        ("train.seq_len=0", "train.seq_len must be at least 1"),
        ("offload.peel=-1", "offload.peel=-1: it counts a stack's last layers run outside its loop"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, override, message):
    run_dir = tmp_path / "run"
    result = run_launcher(override, f"run.dir={run_dir}")
    assert result.returncode == 2
    assert message in " ".join(result.stdout.split())
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "override, line",
    [
        ("train.stpes=5", "error: unknown key train.stpes: did you mean train.steps?"),
        ("trian.steps=5", "error: unknown key trian.steps: did you mean train.steps?"),
        ("model=lama3_tiny", "did you mean llama_tiny or qwen3_tiny? (configs/model/ holds deepseek_v3,"),
    ],
)
def test_a_misspelt_key_or_preset_names_the_nearest(tmp_path, override, line):
    """One line naming the nearest known key or presets, without Hydra's hint to append with `+`,
    exit 2, before JAX starts (no platform line)."""
    result = run_launcher(override, f"run.dir={tmp_path / 'run'}", old_default=False)
    assert result.returncode == 2
    assert result.stdout.count("\n") == 1 and line in result.stdout, result.stdout
    assert "+" not in result.stdout and "platform" not in result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_an_unknown_key_with_no_near_one_lists_its_mapping():
    from ferry.config.overrides import unknown_key

    known = {"train", "train.steps", "train.seed", "model", "model.dim"}
    assert unknown_key("train.foo", known) == "unknown key train.foo: train has the keys seed, steps"
    assert unknown_key("modl.dim", known) == "unknown key modl.dim: did you mean model.dim?"
    assert unknown_key("xyz", known) == "unknown key xyz: the config has the keys model, train"


def test_model_too_large_fails_fast(tmp_path):
    start = time.monotonic()
    result = run_launcher("model=llama3_1_405b", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    text = " ".join(result.stdout.split())
    assert "405.85B parameters" in text and "GiB" in text and "model=llama_tiny" in text
    assert time.monotonic() - start < 60  # seconds, not an attempt to allocate terabytes
    assert not (tmp_path / "run").exists()


def test_deepseek_v3_tiny_trains_with_moe_offload(tmp_path):
    run_dir = tmp_path / "run"
    result = run_launcher(
        "model=deepseek_v3_tiny",
        "offload=moe_offload",
        "train.steps=24",
        "train.eval_every=24",
        "train.log_every=12",
        f"run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr + result.stdout
    records = read_metrics(run_dir)
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert evals[24] < 0.75 * evals[0], evals  # measured 3.32 against 5.58
    last = records[-1]
    for field in ("mtp_loss", "balance_loss", "expert_load_min", "expert_load_max", "expert_load_cv"):
        assert field in last
    for name in ("query_wa_proj", "mla_kv", "moe_mlpwi_0"):  # the schedule's rows, in the start-up report
        assert name in (run_dir / "startup.txt").read_text()
    groups = {g["name"]: g for g in json.loads((run_dir / "schedule.json").read_text())["layer_groups"]}
    assert set(groups) == {"dense", "moe", "mtp_1"}
    moe = {r["name"]: r["placement"] for r in groups["moe"]["residuals"]}
    assert moe["moe_mlpwi_0"] == moe["moe_mlpwi_1"] == "offload" and moe["moe_mlpwo"] == "remat"


def test_deepseek_v3_fails_fast_with_its_size(tmp_path):
    result = run_launcher("model=deepseek_v3", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    text = " ".join(result.stdout.split())
    assert "682.64B parameters (671.03B without MTP)" in text and "model=deepseek_v3_tiny" in text


def test_moe_preset_on_llama_lists_the_names(tmp_path):
    result = run_launcher("offload=moe_offload", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "never tags" in result.stdout and "moe_mlpwi_0" in result.stdout


def test_cfg_job_prints_the_resolved_config_and_starts_nothing():
    """Hydra's `--cfg job`: the resolved config as YAML, exit 0, no backend (no platform line)."""
    import yaml

    result = run_launcher("--cfg", "job", "train.steps=7", "offload.tensors.mlpwo=offload", old_default=False)
    assert result.returncode == 0, result.stdout + result.stderr
    node = yaml.safe_load(result.stdout)
    assert node["train"]["steps"] == 7 and node["offload"]["name"] == "minimal"
    assert node["offload"]["tensors"] == {"mlpwo": "offload"} and node["model"]["name"] == "llama_tiny"
    assert "platform cpu" not in result.stdout and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cfg", "hydra"], "--cfg=hydra: ferry prints its own config with --cfg job"),
        (["--cfg"], "--cfg=: ferry prints its own config with --cfg job"),
        (["--cfg=job", "--multirun"], "--multirun: ferry takes config overrides (key=value), not options"),
    ],
)
def test_other_options_are_still_refused(argv, message):
    from tests.launcher_cases import load_launcher, run_case

    case = run_case(load_launcher(), argv)
    assert case["code"] == 2 and message in " ".join(case["stdout"].split()), case


def test_install_hints_are_printed_without_markup(capsys):
    """A line's own brackets (`pip install -e ".[gpu]"`) are text, on the run's console and in a refusal."""
    from ferry.platform import PlatformError
    from tests.launcher_cases import load_launcher

    launcher = load_launcher()
    launcher.make_console().print('note: pip install -e ".[gpu]", [bold]not bold[/]')
    assert 'note: pip install -e ".[gpu]", [bold]not bold[/]' in capsys.readouterr().out
    assert launcher.refuse(PlatformError('install ferry\'s tpu extra (pip install -e ".[tpu]")')) == 2
    assert '(pip install -e ".[tpu]")' in capsys.readouterr().out


def test_help_lists_the_presets_modes_and_targets_without_starting_jax():
    """`--help` reads the presets from configs/ and the targets from the registry; no backend starts."""
    from ferry.config.overrides import config_groups
    from ferry.xla.targets import target_names
    from tests.conftest import CONFIGS, run_python

    code = (
        "import contextlib, io, sys; sys.path.insert(0, '.'); from tests.launcher_cases import load_launcher\n"
        "launcher = load_launcher(); out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out): code = launcher.main(['--help'])\n"
        "import jax._src.xla_bridge as bridge; print(out.getvalue()); print('backend started:', "
        "bridge.backends_are_initialized(), 'exit', code)"
    )
    result = run_python(code, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = {line.split(" (")[0]: line for line in result.stdout.splitlines() if "=NAME" in line}
    groups = config_groups(CONFIGS)
    for title, group in (("Models", "model"), ("Offload presets", "offload"), ("Data", "data")):
        assert lines[title].split("): ")[1].rstrip(".").split(", ") == groups[group]
    assert [part.split(":")[0] for part in lines["Modes"].split("): ")[1].split("; ")] == ["train", "plan", "compile"]
    assert all(f"{name} (" in lines["Targets"] for name in target_names())
    assert "backend started: False exit 0" in result.stdout
