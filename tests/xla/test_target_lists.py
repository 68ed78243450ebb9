"""Every list of targets a user reads comes from the one registry, `ferry.xla.targets.TARGETS`: the
refusal of an unknown target, mode=plan's and mode=compile's refusals without one, mode=compile's
TPUs, the launcher's --help, configs/train.yaml's comment and the planning guide's list. Adding a
target is a row there (and its facts in `ferry.xla.hardware`); nothing else names them by hand."""

import re

import pytest

from ferry.config.overrides import compose_node
from ferry.config.root import load_config
from ferry.errors import ConfigError
from ferry.run.precompile import check_compile_target
from ferry.xla.hardware import BF16_PEAK_FLOPS, DEVICE_KINDS
from ferry.xla.targets import TARGETS, named_target, target_names
from tests.conftest import CONFIGS, ROOT
from tests.launcher_cases import load_launcher

TPUS = [name for name, target in TARGETS.items() if target.platform == "tpu"]


def config_refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        load_config(compose_node("train", list(overrides), CONFIGS))
    return str(refused.value)


def test_the_registry_lists_its_targets():
    assert TPUS and list(target_names("tpu")) == TPUS
    assert list(target_names()) == list(TARGETS) and set(target_names("gpu")) | set(TPUS) == set(TARGETS)


def test_an_unknown_target_is_refused_naming_exactly_the_registrys_targets():
    with pytest.raises(ConfigError, match=r"target=h100x is not a target the planner knows") as refused:
        named_target("h100x")
    assert str(refused.value).split("use one of ")[1].split(", ") == list(TARGETS)
    with pytest.raises(ConfigError) as launcher_refused:  # the launcher's check before mode=plan compiles
        load_launcher().check_plan_extra("h100x")
    assert str(launcher_refused.value) == str(refused.value)


def test_a_plan_without_a_target_names_every_target():
    text = config_refusal("mode=plan")
    assert text.split("target=")[1].split("|") == list(TARGETS)


def test_mode_compile_names_the_tpu_targets():
    assert config_refusal("mode=compile").split("add target=")[1].split("|") == TPUS
    config = load_config(compose_node("train", ["mode=compile", "target=h200", "platform=tpu"], CONFIGS))
    with pytest.raises(ConfigError, match=r"it compiles for TPUs \(([\w, ]+)\)") as refused:
        check_compile_target(config)
    assert re.search(r"TPUs \(([\w, ]+)\)", str(refused.value))[1].split(", ") == TPUS
    for name in TPUS:  # every TPU target is one mode=compile takes
        tpu = load_config(compose_node("train", ["mode=compile", f"target={name}", "platform=tpu"], CONFIGS))
        assert check_compile_target(tpu) is TARGETS[name]


def test_the_launchers_help_lists_the_targets(capsys):
    assert load_launcher().main(["--help"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Targets (")]
    assert re.findall(r"(\w+) \(", line.split("): ")[1]) == list(TARGETS)
    assert line.split("mode=compile takes the TPUs: ")[1].split("): ")[0].split(", ") == TPUS


def test_train_yaml_points_at_the_registry():
    (line,) = [line for line in (CONFIGS / "train.yaml").read_text().splitlines() if line.startswith("target:")]
    assert "ferry.xla.targets.TARGETS" in line and "launch/run.py --help" in line


def test_the_planning_guide_names_every_target():
    text = " ".join((ROOT / "docs" / "guides" / "planning.md").read_text().split())
    sentence = text.split("Targets: ")[1].split(" (")[0]
    assert re.findall(r"`(\w+)`", sentence) == list(TARGETS)


def test_every_target_has_its_hardware_facts():
    """A target's peak and the device kind a run recognises it by live in `ferry.xla.hardware`."""
    assert set(BF16_PEAK_FLOPS) == set(TARGETS) == {name for _, name in DEVICE_KINDS}
    assert all(target.bf16_peak_flops == BF16_PEAK_FLOPS[name] for name, target in TARGETS.items())
