"""XLA flags and environment for the backend a run targets, applied before the backend starts.

XLA reads `XLA_FLAGS` (CPU and GPU), `LIBTPU_INIT_ARGS` (TPU) and `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`
(the GPU's pinned host pool) once, when JAX first touches a device, so they must be set before
that; setting them later would silently do nothing, which is why `apply_platform` refuses.
"""

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Iterator, Mapping

from ferry.errors import ConfigError, FerryError
from ferry.xla.flags import check_xla_flags

_FLAG_VARIABLE = {"cpu": "XLA_FLAGS", "gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}
# JAX's name of each platform's backend: the only one a run starts, so a CPU run never wakes the
# CUDA plugin or libtpu (their start-up noise on a machine without that hardware), and a GPU or
# TPU run without that hardware fails at once instead of training on the CPU
_JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
# who times the ops XLA:GPU's latency-hiding scheduler orders (`PlatformConfig.scheduler_costs`)
SCHEDULER_COSTS = ("ferry", "xla")
# virtual CPU devices are threads and buffers on this host; more than this is a typo, not a mesh
MAX_CPU_DEVICES = 1024
# ferry runs on jax >= 0.10.2 on CPU and TPU; XLA:GPU below 0.12 walks an offloaded scan
# residual's host reads in the backward loop forwards (openxla/xla #46231, fixed with #46308 in
# the XLA of jax 0.12): silently wrong gradients for every preset that offloads
GPU_MIN_JAX = (0, 12)
CACHE_VARIABLE = "JAX_COMPILATION_CACHE_DIR"  # JAX's persistent compilation cache (`compilation_cache`)


class PlatformError(FerryError, RuntimeError):
    """The platform a run asks for is not on this machine, or can no longer be configured."""


@dataclasses.dataclass(frozen=True)
class PlatformConfig:
    """`name`: cpu | gpu | tpu. `xla_flags`: flag name -> value; `env`: variable -> value.
    `scheduler_costs`: what XLA:GPU's latency-hiding scheduler times the step's ops with: `ferry`,
    the plan's cost model (`ferry.xla.scheduler_costs`; two compiles where XLA autotunes), or
    `xla`, its own fixed estimates. `scheduler_costs_cached`: keep ferry's priced profiles on disk
    (`ProfileCache`), so a program compiled again (a re-plan, a restarted run) is not priced again
    and, where XLA autotunes, compiles once. `compilation_cache`: the directory of JAX's persistent
    compilation cache (`~` and `$VARS` expanded; an exported `JAX_COMPILATION_CACHE_DIR` wins).
    `host_offload_flags`: flags added to `xla_flags` for a run that copies to pinned host
    (`for_host_copies`): the scheduler settings that let its copies overlap compute."""

    name: str = "cpu"  # cpu | gpu | tpu, as platform=NAME chooses it: the backend the run expects
    # XLA flag name -> value, set before JAX starts (XLA_FLAGS on CPU and GPU, LIBTPU_INIT_ARGS on TPU;
    # flags the user exported win); printed at start-up
    xla_flags: Mapping[str, object] = dataclasses.field(default_factory=dict)
    # environment variable -> value, set before JAX starts
    env: Mapping[str, object] = dataclasses.field(default_factory=dict)
    cpu_devices: int | None = None  # CPU only: split the host into this many virtual devices
    # ferry | xla: what XLA:GPU's latency-hiding scheduler times the step's ops with (ferry's cost
    # model, or XLA's own estimates)
    scheduler_costs: str = "xla"
    scheduler_costs_cached: bool = True  # keep ferry's priced profiles on disk (read with scheduler_costs=ferry only)
    # JAX's persistent compilation cache: a program compiled before (a restarted or resumed run,
    # the same model under another preset) is read from here instead of compiled; null: none
    compilation_cache: str | None = None
    # flags added to xla_flags for a run that copies to pinned host: the scheduler settings that let
    # its copies overlap compute (xla_flags win on a name both set)
    host_offload_flags: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in _FLAG_VARIABLE:
            raise ConfigError(f"platform.name is {self.name!r}; use one of {', '.join(_FLAG_VARIABLE)}")
        if self.scheduler_costs not in SCHEDULER_COSTS:
            raise ConfigError(
                f"platform.scheduler_costs is {self.scheduler_costs!r}; use one of {', '.join(SCHEDULER_COSTS)}"
            )
        if self.scheduler_costs == "ferry" and self.name != "gpu":
            raise ConfigError(
                f"platform.scheduler_costs=ferry is for platform=gpu (XLA:GPU's latency-hiding scheduler); "
                f"platform={self.name} schedules with its own estimates: set platform.scheduler_costs=xla"
            )
        if self.cpu_devices is not None and (self.name != "cpu" or self.cpu_devices < 1):
            raise ConfigError(f"platform.cpu_devices={self.cpu_devices} needs platform=cpu and a count of at least 1")
        if self.cpu_devices is not None and self.cpu_devices > MAX_CPU_DEVICES:
            raise ConfigError(
                f"platform.cpu_devices={self.cpu_devices} is more than {MAX_CPU_DEVICES}: virtual CPU devices share "
                f"this host's cores and memory, so use at most {MAX_CPU_DEVICES} to try a mesh"
            )

    def for_host_copies(self, copies: bool) -> "PlatformConfig":
        """This platform for a run that does (or does not) copy to pinned host: `host_offload_flags`
        joined to `xla_flags` where it does, the run's own `xla_flags` winning on a name both set."""
        if not copies or not self.host_offload_flags:
            return self
        return dataclasses.replace(self, xla_flags={**self.host_offload_flags, **self.xla_flags})

    @property
    def flag_variable(self) -> str:
        return _FLAG_VARIABLE[self.name]

    def flag_string(self) -> str:
        """The flags as XLA parses them: --name=value, booleans lower-case."""
        flags = dict(self.xla_flags)
        if self.cpu_devices is not None:
            flags["xla_force_host_platform_device_count"] = self.cpu_devices
        return " ".join(f"--{name}={_flag_value(value)}" for name, value in sorted(flags.items()))

    def environment(self, current: Mapping[str, str]) -> dict[str, str]:
        """The variables to set: the flags appended to any the user already exported (so an
        explicit XLA_FLAGS still wins on conflicts, being read last), plus `env`."""
        out = {name: str(value) for name, value in self.env.items()}
        if self.compilation_cache is not None and not current.get(CACHE_VARIABLE):
            out[CACHE_VARIABLE] = os.path.expanduser(os.path.expandvars(self.compilation_cache))
        flags = self.flag_string()
        if flags:
            existing = current.get(self.flag_variable, "")
            out[self.flag_variable] = f"{flags} {existing}".strip()
        return out


def _flag_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def backend_started() -> bool:
    """Has JAX created a backend in this process (after which XLA ignores new flags)?"""
    from jax._src import xla_bridge  # no public API answers this

    return xla_bridge.backends_are_initialized()


def apply_platform(config: PlatformConfig) -> dict[str, str]:
    """Export the platform's variables into this process and start only its JAX backend; return
    the variables (for printing). In a process whose backend has started already, the same
    platform is accepted as it is (nothing would change) and any other refused."""
    import jax

    check_jax_platforms(config, os.environ)
    variables = config.environment(os.environ)
    variable = config.flag_variable
    check_xla_flags(variable, variables.get(variable, ""))  # XLA would abort the process on a name it does not know
    if backend_started():
        if _already_applied(config):
            return config.environment({config.flag_variable: ""})
        raise PlatformError(
            "the JAX backend has already started, so XLA flags can no longer take effect; "
            "apply the platform config before any JAX computation"
        )
    os.environ.update(variables)
    jax.config.update("jax_platforms", _JAX_PLATFORM[config.name])
    if CACHE_VARIABLE in variables:  # JAX read its variables at import; children inherit the export
        jax.config.update("jax_compilation_cache_dir", variables[CACHE_VARIABLE])
    return variables


# JAX_PLATFORMS names that start each platform's backend
_JAX_NAMES = {"cpu": {"cpu"}, "gpu": {"cuda", "gpu"}, "tpu": {"tpu"}}


def check_jax_platforms(config: PlatformConfig, environ: Mapping[str, str]) -> None:
    """`JAX_PLATFORMS`, exported or in `platform.env`, must not name another backend than
    `platform=`'s: ferry starts that one alone, so `JAX_PLATFORMS=tpu` with platform=cpu would train
    on the CPU behind a start-up line that shows it applied. An exported `cpu` alone is let be: it
    is what ferry itself exports on a machine without an accelerator (`ferry.cpu_only`), where a
    platform=gpu or tpu is refused when its backend cannot start."""
    sources = (
        ("platform.env.JAX_PLATFORMS", config.env.get("JAX_PLATFORMS"), "drop platform.env.JAX_PLATFORMS"),
        ("JAX_PLATFORMS", environ.get("JAX_PLATFORMS"), "unset JAX_PLATFORMS"),
    )
    for where, value, fix in sources:
        names = {n.strip().lower() for n in str(value or "").split(",") if n.strip()}
        if not names or names & _JAX_NAMES[config.name] or (where == "JAX_PLATFORMS" and names == {"cpu"}):
            continue
        asked = sorted(p for p, jax_names in _JAX_NAMES.items() if names & jax_names)
        choose = " or ".join(f"platform={p}" for p in asked) or "platform=cpu|gpu|tpu"
        raise PlatformError(
            f"{where}={value} asks JAX for another backend than platform={config.name}'s, and ferry starts "
            f"platform={config.name}'s alone, so the run would not use it: choose the hardware with {choose} "
            f"and {fix}"
        )


def _already_applied(config: PlatformConfig) -> bool:
    """Whether this process runs `config`'s backend with its flags and variables already."""
    import jax

    flags = config.flag_string()
    same_flags = not flags or flags in os.environ.get(config.flag_variable, "")
    same_env = all(os.environ.get(name) == str(value) for name, value in config.env.items())
    return same_flags and same_env and jax.config.jax_platforms == _JAX_PLATFORM[config.name]


def jax_release(version: str) -> tuple[int, ...]:
    """The numeric release of a JAX version string: "0.12.0.1" -> (0, 12, 0, 1), "0.10.2.dev20" -> (0, 10, 2)."""
    numbers = []
    for part in version.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.group() != part:
            break
    return tuple(numbers)


def check_gpu_jax(what: str, version: str | None = None) -> None:
    """Refuse GPU work (`what`: a run's or a plan's words for it) with a JAX older than
    `GPU_MIN_JAX`, whose XLA:GPU miscompiles host offloads in loops (#46231)."""
    import jax

    version = jax.__version__ if version is None else version
    if jax_release(version) < GPU_MIN_JAX:
        need = ".".join(str(n) for n in GPU_MIN_JAX)
        raise PlatformError(
            f"{what} needs jax >= {need}, and this is jax {version}: its XLA:GPU reads an offloaded layer's "
            f"residuals in the backward loop in the wrong order (openxla/xla #46231, fixed in jax {need}), which "
            f'trains on silently wrong gradients. Upgrade jax: pip install -U "jax[cuda12]>={need}" '
            f'(or pip install -e ".[gpu]"); jax {version} serves platform=cpu and platform=tpu'
        )


def check_platform(config: PlatformConfig) -> None:
    """Start the platform's backend: `platform=gpu` or `tpu` on a machine without one is refused
    in one line (JAX would log the plugin's traceback, then fail inside its own bookkeeping)."""
    import jax

    with _plugin_errors() as plugin_errors:
        try:
            devices = jax.devices()
        except Exception as error:  # any failure to start the one backend asked for: RuntimeError, AssertionError
            reasons = plugin_errors + [str(error).strip().splitlines()[0] if str(error).strip() else ""]
            reason = next((r for r in reasons if r), type(error).__name__)
            raise PlatformError(
                f"platform={config.name} but JAX cannot start a {config.name.upper()} backend on this machine "
                f"({reason}); run with platform=cpu here, or install ferry's {config.name} extra on a machine with "
                f'one (pip install -e ".[{config.name}]")'
            ) from error
    expected = {"cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}[config.name]
    if devices[0].platform != expected:
        raise PlatformError(
            f"platform={config.name} but JAX's devices are {devices[0].platform} ({devices[0].device_kind}); "
            f"run with platform={devices[0].platform}"
        )


@contextlib.contextmanager
def _plugin_errors() -> Iterator[list[str]]:
    """The first line of each error JAX logs while starting a backend (a plugin that cannot find
    its hardware logs a traceback), held back from the console and handed to the caller."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            error = record.exc_info[1] if record.exc_info else None
            text = str(error) if error is not None else record.getMessage()
            messages.append(text.strip().splitlines()[0] if text.strip() else "")

    logger = logging.getLogger("jax._src.xla_bridge")
    handler, propagate = Collect(level=logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
