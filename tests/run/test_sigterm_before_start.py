"""SIGTERM before the step loop listens for it (the launcher's imports, its config, the backend's
start, the data, the compile): one line, exit status 0, and nothing written. In the loop SIGTERM
saves a checkpoint after the step in flight (tests/run/test_training_run.py)."""

import signal
import sys
import time

import pytest

from tests.conftest import SMALL_RUN, start_launcher


def sigterm_launcher(tmp_path, after: str | None, delay: float = 0.0) -> tuple[int, str, str]:
    """`launch/run.py` sent SIGTERM `delay` seconds after its stdout shows `after` (after its
    start where None); its exit status and output."""
    log = tmp_path / "log"
    # log.verbose=true: the start-up lines it waits for (the platform, the loss head) on stdout
    process = start_launcher(*SMALL_RUN, f"run.dir={tmp_path / 'run'}", "log.verbose=true", log_dir=log)
    deadline = time.monotonic() + 120
    while after is not None and after not in process.stdout_path.read_text() and time.monotonic() < deadline:
        assert process.process.poll() is None, process.stdout_path.read_text() + process.stderr_path.read_text()
        time.sleep(0.02)
    time.sleep(delay)
    process.process.send_signal(signal.SIGTERM)
    return process.wait(timeout=120)


@pytest.mark.parametrize(
    "after, delay",
    [(None, 0.6), ("platform cpu", 0.0), ("loss head:", 0.0)],
    ids=["imports", "backend start", "before the compile"],
)
def test_sigterm_before_the_first_step_is_one_line_and_a_clean_stop(tmp_path, after, delay):
    """SIGTERM (a preemption, a scheduler's time limit) before the step loop listens for it: one
    line, exit status 0, and the run directory it had claimed taken away again. JAX swallows what
    a backend plugin's start-up raises, the stop too: the launcher asks again once the backend is up."""
    code, stdout, stderr = sigterm_launcher(tmp_path, after, delay)
    assert code == 0 and "Traceback" not in stderr, stdout + stderr
    assert stdout.strip().splitlines()[-1].startswith("stopped by SIGTERM before the run"), stdout
    assert "nothing was written" in stdout and "step 1" not in stdout
    assert not (tmp_path / "run").exists()


def test_a_stop_raised_where_it_cannot_unwind_is_kept_and_not_printed(capsys, monkeypatch):
    """CI caught SIGTERM landing in JAX's garbage-collector callback: Python printed the swallowed
    `Terminated` with a traceback although the launcher then stopped cleanly. The request is kept
    for `check_terminated`; the print goes, and any other swallowed exception is still printed."""
    from ferry.run import preemption

    monkeypatch.setattr(preemption._Request, "made", False)
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        preemption.stop_on_sigterm()

        class StopsInDel:
            def __del__(self):
                preemption._raise_terminated(signal.SIGTERM, None)

        class FailsInDel:
            def __del__(self):
                raise ValueError("still reported")

        StopsInDel()
        assert "Traceback" not in capsys.readouterr().err
        with pytest.raises(preemption.Terminated):
            preemption.check_terminated()
        FailsInDel()
        assert "still reported" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, previous)
