"""Nothing resumes or trains on the wrong thing (issue 64, part A): a checkpoint step that is not
its own (a symlink, a copy, a rename of another step, or another run's) is refused naming both
steps unless run.allow_foreign_checkpoint=true; a step saved before steps recorded themselves
resumes with a note; changed optimizer, schedule or loss settings are refused as `key: then ->
now` unless run.allow_change names them, and then recorded in run.json; an old step rotation
cannot remove is said as that while the run goes on; a truncated checkpoint is one short line,
its details in the run's ferry.log. Every refusal is exit status 2, one line, and leaves the run
directory as it was (but for ferry.log)."""

import contextlib
import errno
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from ferry.config.train import UPDATE_SETTINGS
from ferry.run.checkpoint import checkpoint_steps
from ferry.run.details_log import DETAILS_LOG, short_cause
from ferry.run.preflight import prepare
from ferry.run.rotation import steps_to_remove
from ferry.run.run_record import RUN_RECORD
from ferry.run.training import train
from tests.conftest import SMALL_RUN, compose_config
from tests.run.test_bad_inputs import run_cases, tree_digest
from tests.run.test_resume_data import copy_run

# a valid value other than SMALL_RUN's for every setting a resume compares
OTHER_VALUES = {
    "train.learning_rate": "0.001",
    "train.warmup_steps": "2",
    "train.min_learning_rate_ratio": "0.2",
    "train.adam_b1": "0.8",
    "train.adam_b2": "0.99",
    "train.adam_eps": "1e-06",
    "train.weight_decay": "0.01",
    "train.grad_clip_norm": "0.5",
    "train.z_loss_weight": "0.0001",
}
SAVED_VALUES = {"train.learning_rate": 0.003, "train.warmup_steps": 1, "train.min_learning_rate_ratio": 0.1}
SAVED_VALUES |= {"train.adam_b1": 0.9, "train.adam_b2": 0.95, "train.adam_eps": 1e-08, "train.weight_decay": 0.1}
SAVED_VALUES |= {"train.grad_clip_norm": 1.0, "train.z_loss_weight": 0.0}


def run_in_process(run_dir, *overrides):
    out = io.StringIO()
    console = Console(file=out, width=400, soft_wrap=True)
    train(prepare(compose_config(*SMALL_RUN, *overrides, f"run.dir={run_dir}"), console), "config: test\n", console)
    return out.getvalue()


def rewrite_json(path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def as_before_records(run_dir):
    """What a ferry before step records wrote: no custom metadata, checkpoint format 2, no
    training settings in the model item, no run.json."""
    for step in (run_dir / "checkpoints").iterdir():
        rewrite_json(step / "_CHECKPOINT_METADATA", lambda m: m.update(custom_metadata={}))
        rewrite_json(step / "model" / "metadata", lambda m: (m.pop("train"), m.update(checkpoint_format=2)))
    (run_dir / RUN_RECORD).unlink()


def truncate_largest_array_file(run_dir):
    files = [p for p in (run_dir / "checkpoints" / "4" / "state").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])


# name: (damage to a copy of the finished run, extra overrides, what the one line must hold)
REFUSED = {
    "symlinked step": (
        lambda d: (d / "checkpoints" / "6").symlink_to("4"),
        [],
        ["checkpoint step 6 holds step 4's checkpoint", "is a symlink to 4", "resume from step 4"],
    ),
    "copied step": (
        lambda d: shutil.copytree(d / "checkpoints" / "4", d / "checkpoints" / "6", symlinks=True),
        [],
        ["checkpoint step 6 holds step 4's checkpoint", "a copy or a rename of step 4", "resume from step 4"],
    ),
    "renamed step": (
        lambda d: (d / "checkpoints" / "4").rename(d / "checkpoints" / "6"),
        [],
        ["checkpoint step 6 holds step 4's checkpoint", "a copy or a rename of step 4", "resume from step 2"],
    ),
    "another run's step": (
        lambda d: rewrite_json(d / RUN_RECORD, lambda r: r.update(run_id="0" * 32)),
        [],
        ["checkpoint step 4", "was saved by another run", f"not this run's {'0' * 32}"],
    ),
    "record lost": (
        lambda d: rewrite_json(
            d / "checkpoints" / "4" / "_CHECKPOINT_METADATA", lambda m: m.update(custom_metadata={})
        ),
        [],
        ["checkpoint step 4", "has lost the record", "run.allow_foreign_checkpoint=true"],
    ),
    "data position edited": (
        lambda d: rewrite_json(d / "checkpoints" / "4" / "data" / "metadata", lambda m: m.update(next_index=3)),
        [],
        ["checkpoint step 4", "its metadata (model, data position or checksums) changed", "resume from step 2"],
    ),
    "truncated array file": (truncate_largest_array_file, [], ["checkpoint step 4", "cannot be read", DETAILS_LOG]),
    "array metadata gone": (
        lambda d: (d / "checkpoints" / "4" / "state" / "manifest.ocdbt").unlink(),
        [],
        ["checkpoint step 4", "cannot be read", DETAILS_LOG, "resume from step 2"],
    ),
    "two settings, one allowed": (
        None,
        ["train.learning_rate=0.001", "train.adam_b1=0.8", "run.allow_change=[train.learning_rate]"],
        ["train.adam_b1: 0.9 -> 0.8", "run.allow_change=[train.learning_rate,train.adam_b1]"],
    ),
    "allow_change of a data key": (
        None,
        ["run.allow_change=[train.seq_len]"],
        ["run.allow_change names train.seq_len"],
    ),
}
for key, value in OTHER_VALUES.items():
    REFUSED[key] = (
        None,
        [f"{key}={value}"],
        [
            f"{key}: {SAVED_VALUES[key]} -> {float(value) if '.' in value or 'e' in value else int(value)}",
            f"run.allow_change=[{key}]",
        ],
    )


@pytest.fixture(scope="module")
def refused(finished_run, tmp_path_factory):
    """Each refused case against its own copy of the finished run, all in one launcher process:
    the copies, their digests before, and the launcher's results."""
    root = tmp_path_factory.mktemp("refused")
    runs, digests, cases = {}, {}, []
    for name, (damage, overrides, _) in REFUSED.items():
        runs[name] = copy_run(finished_run, root, re.sub(r"\W+", "_", name), damage)
        digests[name] = tree_digest(runs[name])
        cases.append([*SMALL_RUN, "train.steps=8", *overrides, f"run.dir={runs[name]}"])
    return runs, digests, dict(zip(REFUSED, run_cases(cases), strict=True))


def test_every_setting_a_resume_compares_is_in_the_table():
    assert set(OTHER_VALUES) == set(UPDATE_SETTINGS)


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_resume_onto_the_wrong_thing_is_refused_in_one_line(refused, name):
    """Exit 2, one line naming what is wrong and the way out, no traceback; the run directory as
    it was (no lock left, no run.json or config written), but for ferry.log's details."""
    runs, digests, results = refused
    result, wanted = results[name], REFUSED[name][2]
    assert result["code"] == 2, (name, result["stdout"][-3000:], result["stderr"][-3000:])
    assert "Traceback" not in result["stdout"] + result["stderr"], result["stderr"][-3000:]
    (error,) = [line for line in result["stdout"].splitlines() if line.startswith("error:")]
    for part in wanted:
        assert part in error, (name, error)
    after = tree_digest(runs[name])
    logged = after.pop(DETAILS_LOG, None)
    assert after == digests[name], name
    assert (logged is not None) == (DETAILS_LOG in error), name


@pytest.mark.parametrize("name", ["truncated array file", "array metadata gone"])
def test_an_unreadable_checkpoint_is_a_short_line_and_its_details_go_to_the_log(refused, name):
    runs, _, results = refused
    (error,) = [line for line in results[name]["stdout"].splitlines() if line.startswith("error:")]
    assert "tensorstore_spec" not in error and "bound method" not in error, error
    assert len(error.replace(str(runs[name]), "RUN")) < 420, error  # TensorStore's own line ran to 2,000
    details = (runs[name] / DETAILS_LOG).read_text()
    assert f"checkpoint step 4 in {runs[name] / 'checkpoints'} cannot be read" in details
    assert "Traceback" in details and len(details) > len(error)


def test_a_tensorstore_explanation_is_cut_before_its_spec():
    spec = "{" + '\\"driver\\":\\"zarr\\",' * 120 + "}"
    long = (
        f'NOT_FOUND: Error opening "zarr" driver: Metadata at "w/.zarray" does not exist [tensorstore_spec=\'{spec}\']'
    )
    assert short_cause(ValueError(long)) == (
        'NOT_FOUND: Error opening "zarr" driver: Metadata at "w/.zarray" does not exist',
        True,
    )
    assert short_cause(OSError(28, "No space left on device")) == ("[Errno 28] No space left on device", False)
    cause, cut = short_cause(ValueError("x" * 5000))
    assert cut and len(cause) == 200
    where = '"/runs/a/checkpoints/4.orbax-checkpoint-tmp-1/state/": ' + "Error writing local file: " * 20
    full = f"RESOURCE_EXHAUSTED: Error writing in OCDBT database at local file {where}[OS error 28: {os.strerror(28)}]"
    cause, cut = short_cause(ValueError(f"{full} [tensorstore_spec='{spec}']"), Path("/runs/a"))
    assert cut and len(cause) <= 200 and cause.endswith("... [OS error 28: No space left on device]"), cause
    assert 'local file "checkpoints/4.orbax-checkpoint-tmp-1/state/"' in cause, cause


def test_a_foreign_step_allowed_on_purpose_resumes_and_is_recorded(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path, "run", lambda d: (d / "checkpoints" / "6").symlink_to("4"))
    output = run_in_process(run_dir, "train.steps=8", "run.allow_foreign_checkpoint=true")
    assert "note: run.allow_foreign_checkpoint=true: checkpoint step 6 holds step 4's checkpoint" in output, output
    assert "resuming from step 6" in output
    (change,) = [c for c in json.loads((run_dir / RUN_RECORD).read_text())["changes"] if c["key"] == "checkpoints/6"]
    assert change["step"] == 6 and change["allowed_by"] == "run.allow_foreign_checkpoint"
    assert (run_dir / "checkpoints" / "4").is_dir() and 8 in checkpoint_steps(run_dir / "checkpoints")


def test_changed_settings_allowed_on_purpose_are_said_and_recorded_with_their_step(finished_run, tmp_path):
    """run.allow_change names the changes: the resume says them and records them in run.json with
    the step; the new checkpoints hold the new settings, so the same command resumes them as they are."""
    run_dir = copy_run(finished_run, tmp_path, "run")
    allow = ("train.learning_rate=0.001", "train.adam_b1=0.8", "run.allow_change=[train.learning_rate,train.adam_b1]")
    output = run_in_process(run_dir, "train.steps=6", *allow)
    assert (
        "note: run.allow_change: resuming step 4 with changed settings "
        "(train.learning_rate: 0.003 -> 0.001; train.adam_b1: 0.9 -> 0.8)" in output
    ), output
    assert "train.steps: 4 -> 6: the learning rate's cosine decay now ends at step 6" in output
    record = json.loads((run_dir / RUN_RECORD).read_text())
    changes = {c["key"]: c for c in record["changes"]}
    assert changes["train.learning_rate"]["step"] == 4 and changes["train.learning_rate"]["then"] == 0.003
    assert changes["train.adam_b1"] == {
        **changes["train.adam_b1"],
        "then": 0.9,
        "now": 0.8,
        "allowed_by": "run.allow_change",
    }
    assert changes["train.steps"]["now"] == 6
    saved = json.loads((run_dir / "checkpoints" / "6" / "model" / "metadata").read_text())
    assert saved["train"]["train.learning_rate"] == 0.001 and saved["train"]["train.adam_b1"] == 0.8
    custom = json.loads((run_dir / "checkpoints" / "6" / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
    assert custom["ferry_step"]["step"] == 6 and custom["ferry_step"]["run"] == record["run_id"]


def test_a_checkpoint_saved_before_step_records_still_resumes_with_a_note(finished_run, tmp_path):
    run_dir = copy_run(finished_run, tmp_path, "run", as_before_records)
    output = run_in_process(run_dir, "train.steps=6")
    assert (
        "note: checkpoint step 4 was saved before ferry recorded each step's identity (checkpoint format 2)" in output
    )
    assert "did not record its training settings" in output and "resuming from step 4" in output, output
    record = json.loads((run_dir / RUN_RECORD).read_text())
    assert record["since"]["step"] == 4
    custom = json.loads((run_dir / "checkpoints" / "6" / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
    assert custom["ferry_step"] == {**custom["ferry_step"], "step": 6, "run": record["run_id"]}


def test_rotation_keeps_orbaxs_rule():
    assert steps_to_remove([2, 4, 6, 8, 10], keep=2, keep_every=None) == [2, 4, 6]
    assert steps_to_remove([2, 4, 6, 8, 10], keep=2, keep_every=4) == [2, 6]
    assert steps_to_remove([4], keep=1, keep_every=None) == []


def chattr_works(path) -> bool:
    if shutil.which("chattr") is None:
        return False
    probe = path / "probe"
    probe.write_text("x")
    if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
        return False
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    return True


@contextlib.contextmanager
def protected(file, directory, monkeypatch, real):
    """`file` and `directory` made immutable (`chattr +i`, where this machine allows it), or their
    removal refused as an immutable inode's would be (EPERM) by patched `os.unlink`/`os.rename`."""
    if real:
        subprocess.run(["chattr", "+i", str(file), str(directory)], check=True)
    else:
        unlink, rename, inode = os.unlink, os.rename, file.stat().st_ino

        def refuse_unlink(path, *args, **kwargs):  # rmtree names a file relative to its directory's fd
            if os.stat(path, dir_fd=kwargs.get("dir_fd"), follow_symlinks=False).st_ino == inode:
                raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), os.fspath(path))
            return unlink(path, *args, **kwargs)

        def refuse_rename(source, *args, **kwargs):
            if os.fspath(source) == os.fspath(directory):
                raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), os.fspath(source))
            return rename(source, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", refuse_unlink)
        monkeypatch.setattr(os, "rename", refuse_rename)
    try:
        yield
    finally:
        if real:
            leftovers = [p for p in directory.parent.rglob(file.name) if p.is_file()]
            subprocess.run(["chattr", "-i", str(directory), *map(str, leftovers)], check=False)


def test_an_old_step_rotation_cannot_remove_is_said_and_the_run_goes_on(finished_run, tmp_path, monkeypatch):
    """checkpoint.keep=1: saving step 6 removes steps 2 and 4. A file of step 2 and step 4's
    directory are immutable: the run goes on to its end, each failure said in one line naming the
    saved step and what is left (step 4 whole, step 2 partly deleted under another name), and only
    whole checkpoints carry a step's name."""
    run_dir = copy_run(finished_run, tmp_path, "run")
    step_2, step_4 = run_dir / "checkpoints" / "2", run_dir / "checkpoints" / "4"
    (sharding,) = step_2.glob("state/_sharding")
    with protected(sharding, step_4, monkeypatch, chattr_works(tmp_path)):
        output = run_in_process(run_dir, "train.steps=8", "checkpoint.keep=1")
        assert checkpoint_steps(run_dir / "checkpoints") == [4, 8]
        assert (run_dir / "checkpoints" / "2.removing").is_dir()
    lines = [line for line in output.splitlines() if line.startswith("warning:")]
    assert len(lines) == 2, output
    assert "checkpoint step 6 was saved in" in lines[0] and "could not remove the older step 2" in lines[0]
    assert "step 2 is left partly deleted as" in lines[0] and "2.removing" in lines[0]
    assert "could not remove the older step 4" in lines[1] and "step 4 is left whole" in lines[1]
    assert all("The run goes on" in line for line in lines)
    assert "summary: done at step 8 of 8" in output
