"""Faults of the disk under a running run: a disk that fills during a save stops the run at that
save (one line, exit 2, the earlier checkpoint whole, a resume bit for bit), a checkpoint
directory that is a file is refused at once with nothing changed, a save into a directory made a
file fails at once and the process exits, and a full disk at launch is refused before anything
is written."""

import asyncio
import errno
import io
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import types

import pytest
from rich.console import Console

import ferry.run.disk_space as disk_space
import ferry.run.lock as lock_module
from ferry.run.checkpoint import Checkpoints, _NoOrbaxRecords, _QuietAbortedWrites
from ferry.run.disk_space import DiskSpaceError, check_checkpoint_space
from ferry.run.lock import LOCK_FILE, RunDirectoryError, acquire
from ferry.run.preflight import prepare
from ferry.run.training import train
from tests.conftest import ROOT, SMALL_RUN, compose_config, run_launcher, run_python
from tests.run.test_bad_inputs import tree_digest

# Six steps of the small run, each logged, checkpoints at 2, 4 and 6.
FAULT_RUN = (*SMALL_RUN, "train.steps=6", "train.log_every=1", "offload=minimal_offloaded")  # the old default
# A tmpfs that holds one checkpoint of llama_tiny's state (1.5 MiB of arrays: the launch check
# asks for 2.5 MiB with Orbax's metadata) but not two: the save of step 4 fills it.
TMPFS_SIZE = "2816k"


def mount_namespaces_work(tmp_path) -> bool:
    """Whether this machine lets the test mount a tmpfs in a user and mount namespace of its own."""
    if shutil.which("unshare") is None:
        return False
    target = tmp_path / "probe"
    target.mkdir()
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(target))}"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_in_process(run_dir, *overrides):
    out = io.StringIO()
    console = Console(file=out, width=200)
    train(prepare(compose_config(*overrides, f"run.dir={run_dir}"), console), "config: test\n", console)
    return out.getvalue()


def test_a_disk_that_fills_during_a_save_stops_the_run_at_that_save(tmp_path):
    """The run writes to a small tmpfs (in a mount namespace of the test's own): step 2's
    checkpoint fits, step 4's fills the disk. The run stops at that save with one line naming
    the step, the directory and the cause, exit 2; only step 2 is left, whole; the same command
    on a disk with room resumes from step 2 and its losses equal the first attempt's bit for bit."""
    if not mount_namespaces_work(tmp_path):
        pytest.skip("this machine does not let an unprivileged test mount a tmpfs (unshare -rm is refused)")
    mount, saved = tmp_path / "small_disk", tmp_path / "saved"
    mount.mkdir()
    run_dir = mount / "run"
    command = shlex.join([sys.executable, str(ROOT / "launch" / "run.py"), *FAULT_RUN, f"run.dir={run_dir}"])
    stdout_path, stderr_path, code_path = (shlex.quote(str(tmp_path / n)) for n in ("stdout.txt", "stderr.txt", "code"))
    script = (
        f"mount -t tmpfs -o size={TMPFS_SIZE} tmpfs {shlex.quote(str(mount))} || exit 99; "
        f"{command} > {stdout_path} 2> {stderr_path}; echo $? > {code_path}; "
        f"cp -a {shlex.quote(str(run_dir))} {shlex.quote(str(saved))}"  # the tmpfs goes with the namespace
    )
    env = {**os.environ, "COLUMNS": "120"}
    finished = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=env, timeout=400)
    assert finished.returncode == 0
    code = int((tmp_path / "code").read_text())
    stdout, stderr = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert code == 2, stdout[-3000:] + stderr[-3000:]
    (error,) = [line for line in stdout.splitlines() if line.startswith("error:")]
    assert f"checkpoint step 4 could not be saved in {run_dir / 'checkpoints'}" in error, error
    assert "No space left on device" in error and "step 2, is left as it was" in error, error
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-3000:]
    assert sorted(os.listdir(saved / "checkpoints")) == ["2"]  # no later step, no partial directory left
    # the steps the first attempt logged: up to the boundary where the failed write was seen to end
    # (the next step's, on a disk that fails at once; the next save's at the latest)
    first = {r["step"]: r for r in records(saved / "metrics.jsonl") if "loss" in r}
    assert 4 <= max(first) <= 6

    output = run_in_process(saved, *FAULT_RUN)
    assert "resuming from step 2" in output
    resumed = {r["step"]: r for r in records(saved / "metrics.jsonl") if "loss" in r}
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(3, max(first) + 1):
        for key in ("loss", "grad_norm"):
            assert resumed[step][key] == first[step][key], (step, key)
    assert resumed[4]["eval_loss"] == first[4]["eval_loss"]


def unraisable(error: BaseException) -> types.SimpleNamespace:
    """What `sys.unraisablehook` gets when C code (TensorStore's callback) reports `error`: the
    traceback starts in the frame that raised, not in a Python caller."""
    tb = error.__traceback__
    return types.SimpleNamespace(
        exc_type=type(error), exc_value=error, exc_traceback=tb.tb_next, err_msg=None, object=None
    )


def test_a_failed_saves_straggling_writes_are_quiet_and_other_unraisable_errors_are_not():
    """The disk test's race, made certain: a write that finishes after Orbax closed the save's
    event loop raises in `call_soon_threadsafe`; that report is dropped, any other reaches the
    hook that was there before."""
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as error:
        straggler = unraisable(error)
    try:
        raise RuntimeError("Event loop is closed")  # the same words, raised elsewhere: kept
    except RuntimeError as error:
        elsewhere = types.SimpleNamespace(**{**vars(unraisable(error)), "exc_traceback": error.__traceback__})
    of_an_object = types.SimpleNamespace(**{**vars(straggler), "object": loop})
    reached = []
    hook = _QuietAbortedWrites(reached.append)
    for report in (straggler, elsewhere, of_an_object):
        hook(report)
    assert reached == [elsewhere, of_an_object]


def test_orbax_records_are_kept_off_the_console_and_others_are_not():
    """asyncio's "Task exception was never retrieved" for a failed Orbax write is Orbax's record
    (its traceback passes through Orbax) and is dropped; asyncio's record of any other task is kept."""

    def record_of(filename: str) -> logging.LogRecord:
        try:
            exec(compile("raise ValueError('No space left on device')", filename, "exec"))
        except ValueError:
            exc_info = sys.exc_info()
        return logging.LogRecord(
            "asyncio", logging.ERROR, asyncio.__file__, 1, "Task exception was never retrieved", None, exc_info
        )

    keep = _NoOrbaxRecords().filter
    assert not keep(record_of("/venv/site-packages/orbax/checkpoint/_src/serialization/serialization.py"))
    assert keep(record_of("/work/user/train.py"))
    assert keep(logging.LogRecord("asyncio", logging.ERROR, asyncio.__file__, 1, "no traceback", None, None))


def test_checkpoints_that_are_a_file_are_refused_at_once_and_nothing_changes(finished_run, tmp_path):
    """checkpoints/ replaced by a file: exit 2 within 30 s, one line naming it, every byte of the
    run directory as it was (no rewritten metrics, no lock, no config)."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").write_text("not a directory\n")
    before = tree_digest(run_dir)
    started = time.monotonic()
    result = run_launcher(*SMALL_RUN, "train.steps=8", f"run.dir={run_dir}", timeout=30)
    assert time.monotonic() - started < 30
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert f"{run_dir / 'checkpoints'} is a file, where ferry keeps a directory" in error, error
    assert "Traceback" not in result.stderr
    assert tree_digest(run_dir) == before


SAVE_INTO_A_FILE = """
import shutil, sys, time
from pathlib import Path
import jax.numpy as jnp
from ferry.run.checkpoint import Checkpoints, CheckpointSaveError
from ferry.config.root import CheckpointConfig
directory = Path(sys.argv[1])
checkpoints = Checkpoints(directory, CheckpointConfig(every=1))
checkpoints.save(1, {"x": jnp.zeros(3)}, {"next_index": 1}, {})
checkpoints.settle()
shutil.rmtree(directory)
directory.write_text("a file now")
started = time.monotonic()
try:
    checkpoints.save(2, {"x": jnp.ones(3)}, {"next_index": 2}, {})
except CheckpointSaveError as error:
    print(f"refused in {time.monotonic() - started:.1f} s: {error}")
"""


def test_a_save_into_a_directory_made_a_file_fails_at_once_and_the_process_exits(tmp_path):
    """The checkpoint directory made a file while the run goes on: the next save fails in
    `save` itself, naming its step, and the process exits by itself (Orbax's writer threads
    waited 20 minutes for a directory that never came)."""
    code = SAVE_INTO_A_FILE.replace("sys.argv[1]", repr(str(tmp_path / "checkpoints")))
    result = run_python(code, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint step 2 could not be saved in {tmp_path / 'checkpoints'}: [Errno 20] Not a directory" in (
        result.stdout
    )
    assert "Traceback" not in result.stderr


def test_a_disk_too_small_for_one_checkpoint_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """1 MiB free: refused before the run directory or its lock exists, saying what one
    checkpoint needs and what is free."""
    with pytest.raises(DiskSpaceError, match=r"needs about 3\.0 MiB .* has 1\.0 MiB free; free at least 2\.0 MiB"):
        check_checkpoint_space(tmp_path / "new", 2 * 2**20, free_bytes=lambda path: 2**20)
    check_checkpoint_space(tmp_path / "new", 2 * 2**20, free_bytes=lambda path: 4 * 2**20)

    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 2**20))
    run_dir = tmp_path / "run"
    with pytest.raises(DiskSpaceError, match=rf"run.dir={run_dir}: one checkpoint of this run needs about"):
        prepare(compose_config(*SMALL_RUN, f"run.dir={run_dir}"), Console(file=io.StringIO()))
    assert not run_dir.exists()


def test_a_lock_that_cannot_be_written_leaves_nothing_behind(tmp_path, monkeypatch):
    """A disk that fills between the space check and the lock: refused in one line, and neither
    the lock file nor the directory it made stays; an existing lock file gets its text back."""

    def full(fd, holder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock_module, "_write", full)
    with pytest.raises(RunDirectoryError, match="cannot be written \\(No space left on device\\)"):
        acquire(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / LOCK_FILE).write_text('{"host": "node7", "pid": 1, "since": "then"}\n')
    with pytest.raises(RunDirectoryError):
        acquire(tmp_path / "old")
    assert (tmp_path / "old" / LOCK_FILE).read_text() == '{"host": "node7", "pid": 1, "since": "then"}\n'


def test_a_refused_start_gives_an_existing_lock_file_its_text_back(tmp_path):
    (tmp_path / LOCK_FILE).write_text('{"host": "node7", "pid": 999999, "since": "yesterday"}')
    lock = acquire(tmp_path)
    assert "node7" not in (tmp_path / LOCK_FILE).read_text()  # this process holds it now
    lock.release()  # never started
    assert (tmp_path / LOCK_FILE).read_text() == '{"host": "node7", "pid": 999999, "since": "yesterday"}'


def test_an_unwritable_checkpoint_directory_is_one_refusal(tmp_path):
    """A checkpoints path below a file: the manager cannot be made, said in one line."""
    (tmp_path / "a_file").write_text("x")
    config = compose_config(*SMALL_RUN)
    with pytest.raises(OSError, match="checkpoints cannot be written in .*a_file/checkpoints"):
        Checkpoints(tmp_path / "a_file" / "checkpoints", config.checkpoint)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, whose writes fail with ENOSPC")
def test_metrics_on_a_full_disk_stop_the_run_in_one_line(tmp_path):
    """metrics.jsonl on a disk that is full (/dev/full): the write is refused naming the step and
    the file, and the file is closed, so the interpreter does not fail again on it at exit."""
    from ferry.config.root import LogConfig
    from ferry.run.loggers import RunLogError, RunLoggers

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    loggers = RunLoggers(tmp_path, LogConfig(tensorboard=False), None, True)
    with pytest.raises(RunLogError, match=r"step 3's metrics could not be written to .*metrics.jsonl \(No space left"):
        loggers.write({"step": 3, "loss": 1.0})
    loggers.close()
