"""`<run dir>/ferry.log`: the details a one-line message leaves out. Orbax and TensorStore explain
a damaged checkpoint in one line of a few thousand characters, most of it the escaped JSON spec
of the array they could not open; the console gets its first words, this file the whole error
with its traceback, and the line names the file."""

import datetime
import re
import traceback
from pathlib import Path

from ferry.distributed import is_main_process

DETAILS_LOG = "ferry.log"
# where TensorStore's explanation turns into the spec of what it opened
SPEC_MARKERS = (" [tensorstore_spec", " See full TensorStore details", "tensorstore_spec=")
LONGEST_CAUSE = 200
# the operating system's reason for a failed read or write, as Python and as TensorStore write it
OS_REASONS = (
    re.compile(r"\[OS error (?P<code>\d+): (?P<text>[^\]]*)\]"),
    re.compile(r"(?P<text>[^:\[\]\"]+?)\s*\[os_error_code='?(?P<code>\d+)'?\]"),
)


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def short_cause(error: BaseException, base: Path | None = None) -> tuple[str, bool]:
    """The error's first words, up to TensorStore's spec and at most `LONGEST_CAUSE` characters
    (paths under `base` written relative to it), ending with the operating system's reason where
    it gave one (`[OS error 28: No space left on device]`), and whether that left anything out."""
    ends = " .:;,("
    whole = (str(error).strip() or type(error).__name__).rstrip(ends)
    text = first_line(error)
    for marker in SPEC_MARKERS:
        text = text.split(marker)[0]
    if base is not None:
        text = text.replace(f"{base}/", "").replace(str(base), ".")
    tail = ""
    for pattern in OS_REASONS:
        found = pattern.search(whole)
        if found is not None and not tail:
            tail = f" [OS error {found['code']}: {found['text'].strip()}]"
        text = pattern.sub("", text)
    text = text.rstrip(ends)
    if len(text) + len(tail) > LONGEST_CAUSE:
        text = text[: LONGEST_CAUSE - len(tail) - 3].rstrip() + "..."
    return text + tail, text + tail != whole


def log_details(run_dir: Path, what: str, error: BaseException) -> Path | None:
    """Append `what` and the whole `error` (its traceback, its causes) to the run's ferry.log, on
    process 0; the file, or None where it cannot be written (the run directory may be what
    failed)."""
    path = run_dir / DETAILS_LOG
    if not is_main_process():
        return path
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    text = "".join(traceback.format_exception(error))
    try:
        with path.open("a") as log:
            log.write(f"--- {stamp} {what}\n{text}\n")
    except OSError:
        return None
    return path


def cause_and_details(run_dir: Path, what: str, error: BaseException) -> str:
    """The error's cause for a one-line message: short, naming ferry.log where the rest went."""
    cause, shortened = short_cause(error, run_dir)
    if not shortened:
        return cause
    written = log_details(run_dir, what, error)
    return f"{cause}; the full error is in {written}" if written else f"{cause} (the rest could not be logged)"
