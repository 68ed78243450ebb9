"""The offload preset of a command that names none (`ferry.run.default_policy`): a plan's offload=auto
choice where one of this step on this accelerator exists, else minimal, else full_remat when
minimal's compiled step does not fit; said at start-up in one line."""

import contextlib
import io
import json

import pytest

from ferry.plan.advice import step_identity
from ferry.run.default_policy import FASTEST, SMALLER, choose_default, names_preset, sets_offload_keys
from ferry.train.memory import InsufficientMemoryError
from tests.conftest import SMALL_RUN, compose_config, run_launcher
from tests.launcher_cases import load_launcher

PLANNED = "# offload=auto for v5e, chosen by mode=plan: estimated\nname: auto_v5e\nkeep_all: false\ndefault: remat\n"
PLANNED += "tensors:\n  decoder_layer_input: device\n  mlpwo: offload\n"


def write_plan(root, config, target="v5e", auto_fits=True):
    """A plan of `config`'s step for `target` as mode=plan writes it (plan.json, offload_auto.yaml)."""
    directory = root / "plan"
    directory.mkdir(parents=True)
    plans = [{"target": target, "policy": "auto", "fits": auto_fits, "device_bytes": 1, "estimate": {}}]
    (directory / "plan.json").write_text(json.dumps({"plans": plans, "auto": [], "step": step_identity(config)}))
    (directory / "offload_auto.yaml").write_text(PLANNED)
    return directory / "offload_auto.yaml"


@pytest.mark.parametrize(
    "argv, named, keys",
    [
        ([], False, False),
        (["offload=full_remat"], True, False),
        (["+offload=save_all", "train.steps=2"], True, False),
        (["offload.tensors.mlpwo=offload"], False, True),
        (["offload_x=1", "model=llama_tiny"], False, False),
    ],
)
def test_what_the_command_names(argv, named, keys):
    assert names_preset(argv) is named
    assert sets_offload_keys(argv) is keys


def test_no_plan_chooses_the_fastest_measured_preset(tmp_path):
    config = compose_config(*SMALL_RUN, f"run.root={tmp_path}")
    for accelerator in (None, "v5e"):
        choice = choose_default(config, accelerator)
        assert choice.name == FASTEST and choice.plan_preset is None and choice.may_fall_back()
        line = choice.line()
        assert line.startswith("offload: minimal (default: no plan") and "\n" not in line
    assert f"for v5e under run.root={tmp_path}" in choose_default(config, "v5e").line()
    fallback = choose_default(config, None).fallback("the compiled train step needs 9 GiB per device")
    assert fallback.name == SMALLER and not fallback.may_fall_back()
    assert "minimal's compiled step does not fit (the compiled train step needs 9 GiB" in fallback.line()


def test_a_plan_of_this_step_is_used(tmp_path):
    config = compose_config(*SMALL_RUN, f"run.root={tmp_path}")
    preset = write_plan(tmp_path, config)
    choice = choose_default(config, "v5e")
    assert choice.plan_preset == preset and not choice.may_fall_back()
    assert choice.line().startswith(f"offload: auto ({preset}) (default: mode=plan offload=auto's choice")
    assert choice.offload_node()["name"] == "auto_v5e"
    # another accelerator's plan, another step's, or offload.* keys set on the command: not used
    assert choose_default(config, "h100").plan_preset is None
    other = compose_config(*SMALL_RUN, "train.seq_len=64", f"run.root={tmp_path}")
    assert choose_default(other, "v5e").plan_preset is None
    keys = choose_default(config, "v5e", keys_set=True)
    assert keys.name == FASTEST and "because the command sets offload.* keys" in keys.line()


def test_a_plan_whose_choice_does_not_fit_is_not_used(tmp_path):
    config = compose_config(*SMALL_RUN, f"run.root={tmp_path}")
    write_plan(tmp_path, config, auto_fits=False)
    choice = choose_default(config, "v5e")
    assert choice.name == FASTEST and "has no offload=auto choice that fits" in choice.line()


def test_a_run_without_offload_says_why_and_uses_the_choice(tmp_path):
    run_dir = tmp_path / "run"
    result = run_launcher(*SMALL_RUN, f"run.dir={run_dir}", f"run.root={tmp_path}", old_default=False)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("offload: ")]
    assert lines == ["offload: minimal (default: the fastest measured preset; offload=NAME chooses another)"]
    report = [line for line in (run_dir / "startup.txt").read_text().splitlines() if line.startswith("offload: ")]
    assert len(report) == 1 and report[0].startswith("offload: minimal (default: no plan for this machine"), report
    assert json.loads((run_dir / "schedule.json").read_text())["policy"] == "minimal"
    assert "name: minimal\n" in (run_dir / "config.yaml").read_text()
    # the run ends with its summary (ferry.run.summary)
    assert "summary: done at step 4 of 4" in result.stdout
    assert f"last checkpoint: {run_dir / 'checkpoints' / '4'}" in result.stdout
    named = run_launcher(*SMALL_RUN, "offload=full_remat", f"run.dir={tmp_path / 'named'}", old_default=False)
    assert named.returncode == 0 and "offload: " not in named.stdout  # an explicit preset is never replaced


def launch(launcher, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = launcher.main(argv)
    return code, out.getvalue()


def test_with_a_plan_present_the_run_uses_auto(tmp_path, monkeypatch):
    argv = [*SMALL_RUN, "train.steps=2", f"run.dir={tmp_path / 'run'}", f"run.root={tmp_path}"]
    preset = write_plan(tmp_path, compose_config(*argv))
    launcher = load_launcher()
    monkeypatch.setattr(launcher, "accelerator", lambda: "v5e")  # as on the planned chip
    code, out = launch(launcher, argv)
    assert code == 0, out
    assert f"offload: auto ({preset}) (default: mode=plan offload=auto's choice for this step on v5e" in out
    assert json.loads((tmp_path / "run" / "schedule.json").read_text())["policy"] == "auto_v5e"


def test_minimal_over_the_device_falls_back_to_full_remat(tmp_path, monkeypatch):
    launcher = load_launcher()
    trained = []

    def train(prepared, config_yaml, console):  # minimal's compiled step over the device, full_remat's not
        trained.append(prepared.config.offload.name)
        if prepared.config.offload.name == FASTEST:
            raise InsufficientMemoryError("the compiled train step needs 99 GiB per device. Levers: ...")
        prepared.release()

    monkeypatch.setattr(launcher, "train", train)
    code, out = launch(launcher, [*SMALL_RUN, f"run.dir={tmp_path / 'run'}", f"run.root={tmp_path}"])
    assert code == 0, out
    assert trained == [FASTEST, SMALLER]
    assert "offload: full_remat (default: minimal's compiled step does not fit (the compiled train step needs 99" in out
    named, _ = launch(launcher, [*SMALL_RUN, "offload=minimal", f"run.dir={tmp_path / 'named'}"])
    assert named == 2  # a preset the command names is refused, not replaced
