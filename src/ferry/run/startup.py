"""A run's start-up report: the terminal gets the few lines a user acts on (notes, the preset
chosen, the model and data in one line, the run directory), the run directory's `startup.txt`
gets everything (the platform's flags, the mesh, the attention kernel, the loss head, the transfer
schedule, the compiled step's memory, the peak MFU is measured against); `log.verbose=true` puts
all of it on the terminal too."""

import datetime
import io
from pathlib import Path
from typing import Any

from rich.console import Console

STARTUP_REPORT = "startup.txt"
# the report is a file: wide enough that no table in it is cut or wrapped
REPORT_WIDTH = 1000


class StartupConsole(Console):
    """The console of a run: what it prints before the first step is also kept for the start-up
    report, and `detail` lines reach the terminal only with `verbose`. Once the report is written
    (`write_report`) it is an ordinary console."""

    def __init__(self, verbose: bool = False, **console_options: Any) -> None:
        super().__init__(**console_options)
        self.verbose = verbose
        self.report: Console | None = Console(
            file=io.StringIO(), record=True, width=REPORT_WIDTH, soft_wrap=True, markup=False, emoji=False
        )

    def print(self, *objects: Any, **options: Any) -> None:
        """Print on the terminal, and keep it for the report until the report is written."""
        if self.report is not None:
            self.report.print(*objects, **options)
        super().print(*objects, **options)

    def detail(self, *objects: Any, brief: str | None = None, **options: Any) -> None:
        """Keep `objects` for the report; on the terminal, them with `verbose`, else `brief` (if any)."""
        if self.report is None or self.verbose:
            self.print(*objects, **options)
            return
        self.report.print(*objects, **options)
        if brief is not None:
            super().print(brief, highlight=False)

    def write_report(self, run_dir: Path) -> Path | None:
        """Append what was kept to `run_dir`/startup.txt under the time of this start (a resumed
        run adds its own start), and keep no more; the file, or None where it cannot be written."""
        if self.report is None:
            return None
        text, self.report = self.report.export_text(), None
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        path = run_dir / STARTUP_REPORT
        try:
            with path.open("a") as report:
                report.write(f"--- start-up at {stamp}\n{text}\n")
        except OSError:
            return None
        return path


def detail(console: Console, *objects: Any, brief: str | None = None) -> None:
    """A start-up detail: on a run's StartupConsole, into its report (and on the terminal with
    log.verbose=true, else `brief`); on any other console, printed."""
    if isinstance(console, StartupConsole):
        console.detail(*objects, brief=brief, highlight=False)
    else:
        console.print(*objects, highlight=False)


def end_startup(console: Console, run_dir: Path) -> None:
    """The start-up is over: a run's StartupConsole writes its report into `run_dir` (any other
    console printed everything already)."""
    if isinstance(console, StartupConsole):
        console.write_report(run_dir)


def verbose_hint(console: Console) -> str:
    """Where the details the terminal leaves out are, for the run directory's line ('' where
    they are printed)."""
    quiet = isinstance(console, StartupConsole) and not console.verbose
    return f" (details: {STARTUP_REPORT}, or log.verbose=true)" if quiet else ""
