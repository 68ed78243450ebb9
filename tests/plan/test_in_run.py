"""`offload=auto` in a run (`ferry.plan.in_run`): a run plans its step for this machine (here the
CPU), trains with the pick and caches it under run.root, keyed by the step's signature; a second
run of the same step reads the cache and plans nothing; another step misses it; a cache file that
is not a plan of this step is said in one line and planned over."""

import contextlib
import io
import json

import pytest
import yaml

from ferry.plan import in_run
from ferry.plan.in_run import PLANS, cache_path, plan_for_run, read_cache, step_signature
from tests.conftest import SMALL_RUN, compose_config
from tests.launcher_cases import load_launcher

AUTO_RUN = (*SMALL_RUN, "offload=auto", "train.steps=2", "checkpoint.every=0")


def launch(launcher, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = launcher.main(argv)
    return code, out.getvalue()


def no_planning(*args, **kwargs):
    raise AssertionError("the planner ran although the plan is cached")


def test_a_run_plans_trains_with_the_pick_caches_it_and_a_second_run_reuses_it(tmp_path, monkeypatch):
    launcher = load_launcher()
    code, out = launch(launcher, [*AUTO_RUN, f"run.root={tmp_path}", f"run.dir={tmp_path / 'first'}"])
    assert code == 0, out
    assert "offload=auto: this machine is a CPU, so the plan is the CPU's" in out
    breakdown = [line for line in out.splitlines() if line.startswith("offload=auto: planned for this CPU in ")]
    assert len(breakdown) == 1 and "compiled 1 candidates in " in breakdown[0] and "timed none" in breakdown[0]
    cached = list((tmp_path / PLANS).glob("*.yaml"))
    assert len(cached) == 1
    assert "offload: auto_cpu (offload=auto's plan for this CPU: " in out and f"cached at {cached[0]}" in out
    record = yaml.safe_load(cached[0].read_text())
    assert record["planned"]["compiled"] == 1 and record["offload"]["name"] == "auto_cpu"
    # the run trained with the pick, and its config.yaml names it (a resume trains the same step)
    assert json.loads((tmp_path / "first" / "schedule.json").read_text())["policy"] == "auto_cpu"
    config = yaml.safe_load((tmp_path / "first" / "config.yaml").read_text())
    assert config["offload"]["tensors"] == record["offload"]["tensors"]
    assert "summary: done at step 2 of 2" in out

    monkeypatch.setattr(in_run, "plan_here", no_planning)
    code, out = launch(launcher, [*AUTO_RUN, f"run.root={tmp_path}", f"run.dir={tmp_path / 'second'}"])
    assert code == 0, out
    assert f"offload=auto: the plan cached at {cached[0]}, no planning: offload: auto_cpu" in out
    assert "planned for this CPU" not in out
    assert json.loads((tmp_path / "second" / "schedule.json").read_text())["policy"] == "auto_cpu"


def fake_plan(calls):
    def plan_here(config, node, say):
        calls.append(config.train.seq_len)
        offload = {"name": "auto_cpu", "tensors": {"mlpwo": "remat"}}
        return offload, {"device": "CPU", "chose": "auto_cpu (a test's plan)"}

    return plan_here


def test_another_shape_misses_the_cache(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(in_run, "plan_here", fake_plan(calls))
    config = compose_config(*AUTO_RUN, f"run.root={tmp_path}")
    longer = compose_config(*AUTO_RUN, "train.seq_len=64", f"run.root={tmp_path}")
    plan_for_run(config, {}, print)
    plan_for_run(config, {}, print)
    plan_for_run(longer, {}, print)
    assert calls == [32, 64]
    assert cache_path(tmp_path, step_signature(config)) != cache_path(tmp_path, step_signature(longer))
    assert len(list((tmp_path / PLANS).glob("*.yaml"))) == 2
    # what changes no compiled step (when to stop, the learning rate, the seed) keeps the cache
    same = compose_config(
        *AUTO_RUN, "train.steps=9", "train.learning_rate=1e-4", "train.seed=3", f"run.root={tmp_path}"
    )
    assert step_signature(same) == step_signature(config)
    for changed in ("train.loss_head=fused", "train.compute_dtype=float32", "model.num_layers=3"):
        assert step_signature(compose_config(*AUTO_RUN, changed)) != step_signature(config), changed


@pytest.mark.parametrize(
    "text, why",
    [
        ("planned: {\n  - not yaml", "not readable YAML"),
        ("- a list\n", "it holds no offload preset"),
        ("offload: {name: auto_cpu}\nsignature: {}\n", "it holds no offload preset"),
        ("offload: {name: auto_cpu}\nplanned: {}\nsignature: {jax: '0.0'}\n", "it holds the plan of another step"),
        (None, "offload.tensors.mlpwo=sideways"),
    ],
)
def test_a_cache_file_that_is_not_this_steps_plan_is_said_and_planned_over(tmp_path, monkeypatch, text, why):
    calls: list[int] = []
    monkeypatch.setattr(in_run, "plan_here", fake_plan(calls))
    config = compose_config(*AUTO_RUN, f"run.root={tmp_path}")
    signature = step_signature(config)
    path = cache_path(tmp_path, signature)
    path.parent.mkdir(parents=True)
    if text is None:  # the right step, but an offload preset no run accepts
        bad = {"name": "x", "tensors": {"mlpwo": "sideways"}}
        text = yaml.safe_dump({"offload": bad, "planned": {}, "signature": signature})
    path.write_text(text)
    said: list[str] = []
    planned = plan_for_run(config, {}, said.append)
    assert calls == [32] and planned.offload["tensors"] == {"mlpwo": "remat"}
    assert len(said) == 1 and said[0].startswith(f"offload=auto: the cached plan {path} is not used (")
    assert why in said[0] and said[0].endswith("; planning again") and "\n" not in said[0]
    assert read_cache(path, signature) is not None  # planned over: the next run reads it
