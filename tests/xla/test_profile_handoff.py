"""A leased file whose content is made when it is first opened (`ferry.xla.profile_handoff`):
the mechanism that lets one compile hand XLA's scheduler a profile priced from its own module."""

import tempfile
import threading
import time
from pathlib import Path

import pytest

from ferry.xla.profile_handoff import leases_supported, written_when_opened

pytestmark = pytest.mark.skipif(
    not leases_supported(Path(tempfile.gettempdir())),
    reason="this filesystem takes no write leases",
)


def read_in_thread(path, into: list) -> threading.Thread:
    reader = threading.Thread(target=lambda: into.append(path.read_text()))
    reader.start()
    return reader


def test_an_open_waits_for_the_content_made_when_it_opens(tmp_path):
    """The content is made only once the file is opened, after what it depends on exists, and
    the opener reads all of it: a read of a file written in advance would see neither."""
    path, made, read = tmp_path / "profile.pbtxt", threading.Event(), []

    def content() -> str:
        made.set()
        time.sleep(0.2)  # the opener waits through it
        return "costs " * 100_000

    with written_when_opened(path, content) as handoff:
        assert path.stat().st_size == 0  # a stat does not wait
        assert not made.wait(0.1)  # nobody opened it: nothing made
        read_in_thread(path, read).join()
    assert made.is_set() and handoff.opened and handoff.delivered
    assert read == ["costs " * 100_000]


def test_unopened_the_content_is_never_made(tmp_path):
    path = tmp_path / "profile.pbtxt"
    with written_when_opened(path, lambda: pytest.fail("made without an open")) as handoff:
        assert path.stat().st_size == 0
    assert not handoff.opened and not handoff.delivered and handoff.error is None
    assert path.read_text() == ""  # the lease is gone: an open no longer waits


def test_a_failing_content_lets_the_opener_go_and_is_kept(tmp_path):
    """A content that raises must not leave the opener (XLA's compile) waiting: it reads the
    empty file, and the error is kept for the caller to raise."""
    path, read = tmp_path / "profile.pbtxt", []

    def content() -> str:
        raise ValueError("no module to price")

    with written_when_opened(path, content) as handoff:
        read_in_thread(path, read).join(timeout=10)
    assert read == [""] and handoff.opened and not handoff.delivered
    assert isinstance(handoff.error, ValueError)
