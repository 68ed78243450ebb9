"""Bad input through the launcher: every one is refused with exit status 2 and one line naming the
key (or file) at fault, no traceback, and nothing changed in the run directory it pointed at.

The table points every command at a real, finished run (`finished_run` in conftest: its
checkpoints, metrics and lock file), so a refusal that touched it would show. The commands share one launcher
process (see `tests/launcher_cases.py`); those that need a backend of their own run as separate processes.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest

from ferry.train.lock import acquire
from tests.conftest import ROOT, SMALL_RUN, run_launcher

COMMON = SMALL_RUN

# (overrides, what the one-line message must name)
BAD_INPUTS = [
    (["train.steps=7.5"], "train.steps"),
    (["train.steps=abc"], "train.steps"),
    (["train.steps=0"], "train.steps"),
    (["train.steps=-5"], "train.steps"),
    (["train.steps=true"], "train.steps"),
    (["train.learning_rate=abc"], "train.learning_rate"),
    (["train.learning_rate=-1"], "train.learning_rate"),
    (["train.learning_rate=nan"], "train.learning_rate"),
    (["train.learning_rate=inf"], "train.learning_rate"),
    (["train.global_batch_size=0"], "train.global_batch_size"),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], "train.global_batch_size"),
    (["train.seq_len=0"], "train.seq_len"),
    (["train.seq_len=1.5"], "train.seq_len"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["train.warmup_steps=-1"], "train.warmup_steps"),
    (["train.on_nonfinite=ignore"], "train.on_nonfinite"),
    (["train.compute_dtype=float16"], "train.compute_dtype"),
    (["train.adam_b1=1.5"], "train.adam_b1"),
    (["train.weight_decay=-0.1"], "train.weight_decay"),
    (["train.eval_batches=-1"], "train.eval_batches"),
    (["train.log_every=0"], "train.log_every"),
    (["train.z_loss_weight=abc"], "train.z_loss_weight"),
    (["train.grad_clip_norm=-1"], "train.grad_clip_norm"),
    (["train.stepz=5"], "train.stepz"),
    (["model=nope"], "model/nope"),
    (["model.num_layers=0"], "model.num_layers"),
    (["model.vocab_size=0"], "model.vocab_size"),
    (["model.dim=abc"], "model.dim"),
    (["model.num_heads=3"], "num_heads"),
    (["data=stdlib", "model.vocab_size=100"], "vocab_size"),
    (["offload=nope"], "offload/nope"),
    (["offload.tensors.mlpwoo=offload"], "mlpwoo"),
    (["offload.tensors.mlpwo=host"], "mlpwo"),
    (["offload=auto"], "offload=auto"),
    (["offload=auto", "offload.auto.steps=0"], "offload.auto.steps"),
    (["offload=auto", "offload.auto.measure=maybe"], "offload.auto.measure"),
    (["checkpoint.every=-1"], "checkpoint.every"),
    (["checkpoint.keep=0"], "checkpoint.keep"),
    (["checkpoint.keep_every=0"], "checkpoint.keep_every"),
    (["profile.start_step=0"], "profile.start_step"),
    (["mesh.fsdp=0"], "mesh.fsdp"),
    (["mesh.fsdp=2"], "mesh"),
    (["mode=banana"], "mode"),
    (["mode=plan"], "target"),
    (["mode=plan", "target=h100x"], "target"),
    (["platform.cpu_devices=0"], "platform.cpu_devices"),
    (["platform.cpu_devices=100000"], "platform.cpu_devices"),
    (["platform.scheduler_costs=measured"], "platform.scheduler_costs"),
    (["platform.scheduler_costs=ferry"], "platform.scheduler_costs=xla"),  # only XLA:GPU's scheduler takes them
    (["data.source=banana"], "data.source"),
    (["data.source=text", "data.path=/nonexistent/corpus", "train.steps=6"], "data.path"),  # after the claim
    (["data.eval_fraction=2"], "data.eval_fraction"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer"),
    (["init.from_hf=/nonexistent/checkpoint"], "init.from_hf"),
    (["distributed.num_processes=2"], "distributed"),
    (["log.wandb=maybe"], "log.wandb"),
    (["run.resume=maybe"], "run.resume"),
    (["run.resume=false"], "run.resume"),
    (["model.dim=32"], "dim: 64 -> 32"),
    (["plan.capacity_gib=-1"], "plan.capacity_gib"),
    (["--cfg", "job"], "--cfg"),
]


def tree_digest(path):
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


def run_cases(cases: list[list[str]]) -> list[dict]:
    """Each argument list through the launcher, all in one process (tests/launcher_cases.py)."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.launcher_cases"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def run_dir_cases(root):
    """Commands whose run.dir is the problem, or is new: (name, overrides), in `root`."""
    (root / "a_file").write_text("precious\n")
    cases = {
        "held": [f"run.dir={root / 'held'}"],
        "a file": [f"run.dir={root / 'a_file'}"],
        "below a file": [f"run.dir={root / 'a_file' / 'below'}"],
        "new, then no data": ["data.source=text", "data.path=/nonexistent/corpus", f"run.dir={root / 'new'}"],
    }
    if os.geteuid() != 0:  # root writes through permission bits
        (root / "unwritable").mkdir(mode=0o500)
        cases["unwritable"] = [f"run.dir={root / 'unwritable' / 'run'}"]
    return cases


@pytest.fixture(scope="module")
def refused(finished_run, tmp_path_factory):
    """The table's commands against the finished run and the run-directory commands, in one
    launcher process; the finished run's digest before them."""
    before = tree_digest(finished_run)
    root = tmp_path_factory.mktemp("run_dirs")
    by_dir = run_dir_cases(root)
    cases = [[*COMMON, *overrides, f"run.dir={finished_run}"] for overrides, _ in BAD_INPUTS]
    cases += [[*COMMON, *overrides] for overrides in by_dir.values()]
    held = acquire(root / "held")  # this process is the first run there
    try:
        results = run_cases(cases)
    finally:
        held.release()
    table = dict(zip((tuple(o) for o, _ in BAD_INPUTS), results[: len(BAD_INPUTS)], strict=True))
    return before, table, dict(zip(by_dir, results[len(BAD_INPUTS) :], strict=True)), root


def test_the_table_is_large():
    assert len(BAD_INPUTS) >= 40


def assert_refused(result, key):
    output = result["stdout"] + result["stderr"]
    assert result["code"] == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in result["stdout"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert key in errors[0], errors[0]


@pytest.mark.parametrize("overrides, key", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_is_refused_in_one_line_naming_the_key(refused, overrides, key):
    assert_refused(refused[1][tuple(overrides)], key)


def test_refusals_leave_the_run_directory_as_it_was(refused, finished_run):
    assert tree_digest(finished_run) == refused[0]


def test_a_run_dir_that_is_a_file_or_below_one_is_refused(refused):
    _, _, by_dir, root = refused
    assert_refused(by_dir["a file"], "is a file, not a directory")
    assert_refused(by_dir["below a file"], "a part of its path is a file")
    assert (root / "a_file").read_text() == "precious\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_an_unwritable_run_dir_is_refused(refused):
    assert_refused(refused[2]["unwritable"], "permission denied")


def test_a_second_launch_into_a_run_dir_in_use_is_refused_naming_the_holder(refused):
    _, _, by_dir, root = refused
    assert_refused(by_dir["held"], f"in use by another ferry run (pid {os.getpid()} on host {socket.gethostname()}")
    assert not (root / "held").exists()  # the holder made it and never started: it is gone with the lock


def test_a_refusal_after_claiming_a_new_directory_takes_it_away(refused):
    """The data is missing, found once the directory was claimed: the directory made for the
    run and its lock file are gone again."""
    _, _, by_dir, root = refused
    assert_refused(by_dir["new, then no data"], "data.path")
    assert not (root / "new").exists()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_a_platform_this_machine_lacks_is_refused(tmp_path, platform):
    """Its own process: starting a GPU or TPU backend is a one-way door."""
    result = run_launcher(*COMMON, f"platform={platform}", f"run.dir={tmp_path / 'run'}", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert f"platform={platform}" in error and "platform=cpu" in error
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
