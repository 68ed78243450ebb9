"""ferry's entry point: `python launch/run.py model=llama3_1_8b offload=qkv_offload train.steps=100`.

Configs live in configs/ (Hydra); the arguments are Hydra overrides. A per-tensor override such as
`offload.tensors.mlpwo=offload` may name a tensor the preset does not list; the offload policy
then checks it against the names the model really tags.

Exit status: 0 done (or stopped cleanly by SIGTERM), 2 refused (one line saying what and how to fix
it; nothing was changed), 3 stopped at a non-finite loss (the last good state checkpointed), 130
interrupted by Ctrl-C. Anything else is a bug, shown with its traceback.
"""

import re
import sys
from pathlib import Path

import jax
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from ferry import distributed
from ferry.config import ConfigError, from_dict
from ferry.errors import FerryError
from ferry.plan.scheduler_costs import scheduler_target
from ferry.platform import PlatformConfig, apply_platform, check_platform
from ferry.train.checkpoint import checkpoint_steps
from ferry.train.config import FerryConfig, OffloadConfig, load_config
from ferry.train.nonfinite import NonFiniteLossError
from ferry.train.prepare import PreparedRun, prepare
from ferry.train.run import train
from ferry.train.run_dir import resolve_run_dir

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
_TENSOR_OVERRIDE = re.compile(r"^offload\.tensors\.\w+=")
# the console width when output goes to a file (SLURM, a redirect): wide enough that no table is cut
FILE_WIDTH = 1000
# what `mode=plan` needs for each kind of target: the module and the package that provides it
PLAN_EXTRA = {"gpu": ("jax_plugins.xla_cuda12", "jax-cuda12-plugin"), "tpu": ("libtpu", "libtpu")}


def allow_new_tensor_overrides(argv: list[str]) -> list[str]:
    """Hydra refuses keys a preset does not list unless prefixed with ++; tensor names are
    validated against the model instead, so add the prefix for them."""
    return [f"++{arg}" if _TENSOR_OVERRIDE.match(arg) else arg for arg in argv]


def make_console(quiet: bool = False) -> Console:
    """The console: the terminal's width on a terminal, otherwise wide enough for every table
    (a log file has no width, and rich would cut columns at 80)."""
    terminal = sys.stdout.isatty()
    return Console(quiet=quiet, width=None if terminal else FILE_WIDTH, soft_wrap=not terminal)


def compose_overrides(argv: list[str]) -> dict:
    """The resolved config for these overrides, as a plain dict; Hydra's refusals (an unknown
    key, a bad override, a missing preset) become one-line ConfigErrors."""
    for arg in argv:
        if arg.startswith("-"):
            raise ConfigError(f"{arg}: ferry takes config overrides (key=value), not options; see {__file__}")
    try:
        with initialize_config_dir(CONFIG_DIR, version_base=None):
            cfg = compose("train", overrides=allow_new_tensor_overrides(argv))
        return OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as error:
        reasons = [str(error)] + ([str(error.__cause__)] if error.__cause__ is not None else [])
        text = " ".join(" ".join(reason.split()) for reason in reasons if reason.strip())
        text = text.split(" Config search path:")[0]  # Hydra's search path says nothing to fix
        raise ConfigError(text or type(error).__name__) from error


def main(argv: list[str]) -> int:
    """Run the command `python launch/run.py ARGV...`; return its exit status."""
    console = make_console()
    if argv and argv[0] in ("-h", "--help"):
        console.print(__doc__.strip(), highlight=False, markup=False)
        return 0
    prepared: PreparedRun | None = None
    try:
        node = compose_overrides(argv)
        config = load_config(node)
        for note in config.notes:
            console.print(f"note: {note}", highlight=False)
        if config.mode == "plan":
            return plan(config, console, node)
        variables = apply_platform(config.platform)  # before JAX starts its backend
        processes = distributed.initialize(config.distributed)  # likewise
        console.print(
            f"platform {config.platform.name}: "
            + (", ".join(f"{k}={v}" for k, v in variables.items()) or "no extra flags")
            + f"; {processes}",
            highlight=False,
        )
        check_platform(config.platform)
        scheduler_target(config.platform, jax.devices()[0].device_kind)  # a device ferry can price, or refused now
        console = make_console(quiet=jax.process_index() != 0)  # process 0 speaks for the run
        prepared = prepare(config, console)
        train(prepared, OmegaConf.to_yaml(node), console)
        return 0
    except NonFiniteLossError as error:
        return refuse(error, code=3)
    except FerryError as error:
        return refuse(error)
    except KeyboardInterrupt:
        console.print(interrupted(prepared), highlight=False)
        return 130
    finally:
        if prepared is not None:
            prepared.release()


def refuse(error: Exception, code: int = 2) -> int:
    """One line (any newlines in the message folded), exit status `code`."""
    line = " ".join(str(error).split())
    Console(width=FILE_WIDTH, soft_wrap=True).print(f"[bold red]error:[/] {line}", highlight=False)
    return code


def interrupted(prepared: PreparedRun | None) -> str:
    """Ctrl-C's one line: where the run can continue from, if anywhere."""
    if prepared is None:
        return "interrupted before the run started; nothing was written"
    steps = checkpoint_steps(prepared.run_dir / "checkpoints")
    if steps:
        return f"interrupted: {prepared.run_dir} holds checkpoints up to step {steps[-1]}; the same command resumes"
    return f"interrupted before the first checkpoint of {prepared.run_dir}; the same command starts the run over"


def check_plan_extra(target: str, find_spec: object = None) -> None:
    """`mode=plan` compiles for GPUs with the CUDA plugin and for TPUs with libtpu: refuse an
    unknown target, and at once when the one the target needs is not installed."""
    import importlib.util

    from ferry.plan.targets import TARGETS

    find = find_spec or importlib.util.find_spec
    spec = TARGETS.get(target)
    if spec is None:
        raise ConfigError(f"target={target} is not a target the planner knows; use one of {', '.join(TARGETS)}")
    module, package = PLAN_EXTRA[spec.platform]
    try:
        found = find(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ConfigError(
            f'mode=plan target={target} compiles with {package}, which is not installed: pip install -e ".[plan]"'
        )


def plan(config: FerryConfig, console: Console, node: dict) -> int:
    """`mode=plan`: compile for `target` on this machine's CPU (never its own accelerator here);
    offload=auto's best candidates may then be timed on the accelerator, each in its own process
    (`offload.auto.measure`), as runs of the resolved config `node`."""
    jax.config.update("jax_platforms", "cpu")  # the CUDA plugin then only serves compile-only topologies
    console = Console(width=max(console.width, 150), soft_wrap=console.soft_wrap)  # the tables are wide
    from ferry.plan.auto_measure import resolve_measure, subprocess_measurer
    from ferry.plan.measure import accelerator_present
    from ferry.plan.report import plan_presets, run_plan, target_platform, write_plan
    from ferry.plan.targets import TARGETS

    check_plan_extra(config.target)

    def load_preset(name: str) -> OffloadConfig:
        path = Path(CONFIG_DIR) / "offload" / f"{name}.yaml"
        if not path.exists():
            raise ConfigError(f"plan.presets names {name!r}, which is not in configs/offload/")
        return from_dict(OffloadConfig, OmegaConf.to_container(OmegaConf.load(path)), f"offload {name}")

    def load_platform(name: str) -> PlatformConfig:
        path = Path(CONFIG_DIR) / "platform" / f"{name}.yaml"
        return from_dict(PlatformConfig, OmegaConf.to_container(OmegaConf.load(path)), f"platform {name}")

    run_dir = resolve_run_dir(config)
    measure_one = None
    if "auto" in plan_presets(config):
        target = TARGETS[config.target]
        settings = config.offload.auto
        measure, why = resolve_measure(settings, target.platform, accelerator_present())
        console.print(why, highlight=False)
        if measure:
            platform = target_platform(config, target, load_platform)
            measure_one = subprocess_measurer(config, node, platform, load_preset, settings)
    try:
        plans, choices, measured = run_plan(config, load_preset, load_platform, console, measure_one)
    except ValueError as error:  # the planner's checks of the target's device count and topology
        if isinstance(error, FerryError):
            raise
        raise ConfigError(str(error)) from error
    written = write_plan(plans, choices, run_dir, measured)
    console.print("plan written to " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
