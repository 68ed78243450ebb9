"""XLA flags checked against the flags XLA knows, before the backend starts: XLA reads `XLA_FLAGS`
when the backend starts and aborts the process on a name it does not know (a fatal log line, exit
1), after ferry has printed its start-up and perhaps claimed a run directory.

XLA registers every flag under its literal name, so each name is a NUL-terminated string in the
library that parses them (jaxlib's `libjax_common.so`; `xla_extension.so` in older jaxlibs; a
PJRT plugin's own library). Looking a name up there is a byte search of a file the process maps
anyway (a fraction of a second). A name not found is confirmed by XLA itself before it is refused:
a child process starts the CPU backend with the flags and its fatal line is the reason given, so
a flag the search misses is never refused.
"""

import mmap
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from ferry.errors import ConfigError

# libraries smaller than this hold no flag registry (jaxlib's small extension modules)
_MIN_LIBRARY_BYTES = 10 * 2**20
_CHILD = "import jax; jax.devices()"
# flags ferry sets itself (platform.cpu_devices), known to every XLA it runs on: not looked up
FERRY_FLAGS = frozenset({"xla_force_host_platform_device_count"})
_CHILD_TIMEOUT_S = 120


class XlaFlagError(ConfigError):
    """An XLA flag XLA does not know (or a value it cannot parse)."""


def flag_names(flags: str) -> list[str]:
    """The names in a flag string (`--name=value --other`), in order."""
    names = []
    for token in flags.split():
        if token.startswith("--"):
            names.append(token[2:].split("=", 1)[0])
    return names


def flag_libraries() -> list[Path]:
    """The libraries that register XLA's flags in this environment: jaxlib's large shared
    objects and any installed PJRT plugin's."""
    import importlib.util

    folders = []
    for package in ("jaxlib", "jax_plugins"):
        spec = importlib.util.find_spec(package)
        if spec is not None:
            folders += [Path(p) for p in (spec.submodule_search_locations or [])]
    return sorted(
        path for folder in folders for path in folder.rglob("*.so") if path.stat().st_size >= _MIN_LIBRARY_BYTES
    )


def unmentioned(names: Iterable[str], libraries: Iterable[Path]) -> list[str]:
    """The names no library holds as a NUL-terminated string (one byte search per name)."""
    missing = list(dict.fromkeys(names))
    for library in libraries:
        if not missing:
            break
        with open(library, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            missing = [name for name in missing if data.find(name.encode() + b"\0") < 0]
    return missing


def xla_refusal(flags: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """XLA's own reason for refusing `flags` as XLA_FLAGS (its fatal log line), from a child
    process that starts the CPU backend with them; None when XLA accepts them."""
    env = {**environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    try:
        child = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return None  # no verdict: let the run's own start find out
    if child.returncode == 0:
        return None
    lines = [line for line in child.stderr.splitlines() if "flag" in line.lower()]
    fatal = next((line for line in lines if "XLA_FLAGS" in line or "Flag parsing failed" in line), None)
    if fatal is None:
        return None  # it failed for another reason; not the flags' doing
    return fatal.split("] ", 1)[-1].strip()


def check_xla_flags(variable: str, flags: str, libraries: list[Path] | None = None, confirm=xla_refusal) -> None:
    """Refuse flags XLA does not know, naming them, before the backend starts. Only XLA_FLAGS is
    checked (libtpu reads LIBTPU_INIT_ARGS, with flags of its own)."""
    if variable != "XLA_FLAGS" or not flags.strip():
        return
    names = [name for name in flag_names(flags) if name not in FERRY_FLAGS]
    if not names:
        return
    missing = unmentioned(names, flag_libraries() if libraries is None else libraries)
    if not missing:
        return
    reason = confirm(flags)
    if reason is None:
        return  # XLA takes them: the search missed a name
    listed = ", ".join(missing)
    raise XlaFlagError(
        f"XLA does not know the flag(s) {listed} (XLA_FLAGS: {reason}); fix the name in platform.xla_flags or in "
        "the exported XLA_FLAGS (XLA's flags: XLA_FLAGS=--help python -c 'import jax; jax.devices()')"
    )
