"""The launcher's exit: the interpreter joins every non-daemon thread (and every thread pool's
workers) before it exits, so one left blocked (a checkpoint writer of a failed save, waiting for a
signal that never comes) would hang the process after its error was printed. A watchdog gives the
interpreter's clean-up a grace period, then ends the process with the same status."""

import os
import sys
import threading
import time
from typing import NoReturn


def exit_process(code: int, grace_s: float = 10.0) -> NoReturn:
    """Exit with `code`; if the interpreter's shutdown is still waiting on threads after
    `grace_s` seconds, say so on stderr and end the process anyway."""

    def force_exit() -> None:
        time.sleep(grace_s)
        stuck = sorted({t.name for t in threading.enumerate() if t.is_alive() and not t.daemon})
        try:
            print(
                f"note: exiting without {len(stuck)} background thread(s) still blocked ({', '.join(stuck)})",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
        finally:
            os._exit(code)

    threading.Thread(target=force_exit, name="ferry-exit-watchdog", daemon=True).start()
    sys.exit(code)
