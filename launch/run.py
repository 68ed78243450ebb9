"""ferry's entry point: `python launch/run.py model=llama3_1_8b offload=qkv_offload train.steps=100`.

Configs live in configs/ (Hydra); the arguments are Hydra overrides. A per-tensor override such as
`offload.tensors.mlpwo=offload` may name a tensor the preset does not list; the offload policy
then checks it against the names the model really tags.

Without `offload=`, the run uses offload=auto's choice where `mode=plan offload=auto` planned this
step for this accelerator under run.root, else minimal (the fastest measured preset), or full_remat
where minimal's compiled step does not fit; one start-up line says which and why
(`ferry.run.default_policy`). `--cfg job` prints the resolved config and exits without starting JAX.
`mode=compile target=v5e platform=tpu offload=<preset> ...` compiles the run's step for that TPU on
this machine's CPU into JAX's compilation cache, so the run on the chip starts without compiling
(`ferry.run.precompile`); `mode=plan target=...` plans presets for a target (the targets are below).

Exit status: 0 done (or stopped cleanly by SIGTERM), 2 refused (one line saying what and how to fix
it; nothing was changed), 3 stopped at a non-finite loss (the last good state checkpointed), 130
interrupted by Ctrl-C. Anything else is a bug, shown with its traceback.
"""

import os
import shutil
import signal
import sys
from collections.abc import Callable

EARLY_INTERRUPT = "interrupted before the run started; nothing was written"
EARLY_TERMINATED = "stopped by SIGTERM before the run started; nothing was written"


def exit_interrupted(line: str, code: int = 130) -> None:
    """Ctrl-C (or SIGTERM, `code` 0) where no Python code of ferry's can handle it (the imports,
    the interpreter's exit): one line, that exit status, at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":  # the imports below take seconds; Ctrl-C or SIGTERM during them is one line too
    signal.signal(signal.SIGINT, lambda signum, frame: exit_interrupted(EARLY_INTERRUPT))
    signal.signal(signal.SIGTERM, lambda signum, frame: exit_interrupted(EARLY_TERMINATED, 0))
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402

from ferry import distributed  # noqa: E402
from ferry.config.overrides import compose_node, config_groups, group_presets, preset_node  # noqa: E402
from ferry.config.root import FerryConfig, load_config  # noqa: E402
from ferry.config.train import OffloadConfig  # noqa: E402
from ferry.config_schema import from_dict  # noqa: E402
from ferry.errors import ConfigError, FerryError  # noqa: E402
from ferry.platform import PlatformConfig, apply_platform, check_gpu_jax, check_platform  # noqa: E402
from ferry.run.checkpoint import checkpoint_steps  # noqa: E402
from ferry.run.config_paths import check_config_paths  # noqa: E402
from ferry.run.default_policy import DefaultChoice, choose_default, names_preset, sets_offload_keys  # noqa: E402
from ferry.run.directory import resolve_run_dir  # noqa: E402
from ferry.run.libtpu_noise import quiet_libtpu  # noqa: E402
from ferry.run.nonfinite import NonFiniteLossError  # noqa: E402
from ferry.run.precompile import check_compile_target, precompile  # noqa: E402
from ferry.run.preemption import Terminated, check_terminated, stop_on_sigterm  # noqa: E402
from ferry.run.preflight import PreparedRun, prepare  # noqa: E402
from ferry.run.startup import StartupConsole, detail  # noqa: E402
from ferry.run.training import train  # noqa: E402
from ferry.train.memory import InsufficientMemoryError  # noqa: E402
from ferry.xla.hardware import accelerator_name  # noqa: E402
from ferry.xla.scheduler_costs import scheduler_target  # noqa: E402
from ferry.xla.targets import TARGETS, named_target, target_names  # noqa: E402

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
# the console width when output goes to a file (SLURM, a redirect): wide enough that no table is cut
FILE_WIDTH = 1000
# what `mode=plan` needs for each kind of target: the module and the package that provides it
PLAN_EXTRA = {"gpu": ("jax_plugins.xla_cuda12", "jax-cuda12-plugin"), "tpu": ("libtpu", "libtpu")}


def make_console(quiet: bool = False, verbose: bool = False) -> StartupConsole:
    """The console: the terminal's width on a terminal, otherwise $COLUMNS or wide enough for
    every table (a log file has no width, and rich would cut columns at 80); start-up details
    only in the run's startup.txt unless `verbose` (`ferry.run.startup`)."""
    terminal = sys.stdout.isatty()
    columns = os.environ.get("COLUMNS", "")
    width = shutil.get_terminal_size().columns if terminal else int(columns) if columns.isdigit() else FILE_WIDTH
    # markup and emoji codes off: a printed line's own brackets (an install hint's ".[gpu]") and a
    # user's value (`localhost:abc:` would become an emoji) are text
    return StartupConsole(verbose, quiet=quiet, width=width, soft_wrap=not terminal, markup=False, emoji=False)


def compose_overrides(argv: list[str]) -> dict:
    """The resolved config for these overrides, as a plain dict; every refusal (a bad override,
    an unknown key, a missing preset) a one-line ConfigError (`ferry.config.overrides`)."""
    for arg in argv:
        if arg.startswith("-"):  # `--cfg job` is taken by `config_request` before
            raise ConfigError(f"{arg}: ferry takes config overrides (key=value), not options; see {__file__}")
    return compose_node("train", argv, Path(CONFIG_DIR))


# --help's modes, in the order a user meets them
MODES = {
    "train": "train the model (the default)",
    "plan": "compile the step for target=NAME without its hardware and say what fits",
    "compile": "compile a TPU run's step for target=NAME into JAX's compilation cache",
}
# --help's config groups: the presets a user chooses by name
HELP_GROUPS = {"model": "Models", "offload": "Offload presets", "data": "Data", "platform": "Platforms"}


def targets_help() -> str:
    """--help's list of the targets `target=` names, read from `ferry.xla.targets.TARGETS`."""
    named = ", ".join(f"{name} ({target.description})" for name, target in TARGETS.items())
    return f"Targets (target=NAME; mode=compile takes the TPUs: {', '.join(target_names('tpu'))}): {named}."


def choices_help() -> str:
    """--help's lists of what a command chooses by name: the presets of configs/ (read from its
    folders), the modes and the targets."""
    groups = config_groups(Path(CONFIG_DIR))
    lines = [f"{title} ({group}=NAME): {', '.join(groups[group])}." for group, title in HELP_GROUPS.items()]
    lines.append("Modes (mode=NAME): " + "; ".join(f"{mode}: {what}" for mode, what in MODES.items()) + ".")
    return "\n".join([*lines, targets_help()])


def main(argv: list[str]) -> int:
    """Run the command `python launch/run.py ARGV...`; return its exit status."""
    console = make_console()
    if argv and argv[0] in ("-h", "--help"):
        console.print(f"{__doc__.strip()}\n\n{choices_help()}", highlight=False, markup=False)
        return 0
    runs: list[PreparedRun] = []  # prepared (more than one where the default preset's step did not fit)
    try:
        argv, show_config = config_request(argv)
        node = compose_overrides(argv)
        if show_config:  # Hydra's `--cfg job`: the resolved config, and no backend
            console.print(OmegaConf.to_yaml(node), highlight=False, markup=False, end="")
            return 0
        config = load_config(node)
        console = make_console(verbose=config.log.verbose)
        for note in config.notes:
            console.print(f"note: {note}", highlight=False)
        check_config_paths(config)
        if config.mode == "plan":
            return plan(config, console, node)
        if config.mode == "compile":
            if not names_preset(argv):  # a run without offload= chooses its preset at start-up
                raise ConfigError("mode=compile compiles one preset's step: name it, e.g. offload=full_remat")
            check_compile_target(config)
            check_plan_extra(config.target or "", mode="compile")
            with quiet_libtpu():  # libtpu's complaints about a machine that is no TPU VM
                console.print(precompile(config, console), highlight=False)
            return 0
        if config.platform.name == "gpu":
            check_gpu_jax("platform=gpu")  # before the CUDA backend starts
        variables = apply_platform(config.run_platform)  # before JAX starts its backend
        processes = distributed.initialize(config.distributed)  # likewise
        flags = ", ".join(f"{k}={v}" for k, v in variables.items())
        platform_line = f"platform {config.platform.name}: {flags or 'no extra flags'}; {processes}"
        detail(console, platform_line, brief=platform_line if flags else None)  # flags set are always shown
        check_platform(config.platform)
        check_terminated()  # JAX swallows what a plugin's start-up raises, a SIGTERM's Terminated too
        scheduler_target(config.platform, jax.devices()[0].device_kind)  # a device ferry can price, or refused now
        console.quiet = jax.process_index() != 0  # process 0 speaks for the run
        train_run(argv, node, config, console, runs)
        return 0
    except NonFiniteLossError as error:
        return refuse(error, code=3)
    except FerryError as error:
        return refuse(error)
    except KeyboardInterrupt:
        console.print(interrupted(runs[-1] if runs else None), highlight=False)
        return 130
    except Terminated:  # SIGTERM outside the step loop, which stops at a step by itself
        console.print(interrupted(runs[-1] if runs else None, "stopped by SIGTERM"), highlight=False)
        return 0
    finally:
        for prepared in runs:
            prepared.release()


def train_run(argv: list[str], node: dict, config: FerryConfig, console: Console, runs: list[PreparedRun]) -> None:
    """Prepare and train (each prepared run appended to `runs`); a command that names no preset
    trains with `ferry.run.default_policy`'s choice, full_remat where minimal's compiled step is over
    the device (refused before anything is written)."""
    choice = None if names_preset(argv) else choose_default(config, accelerator(), sets_offload_keys(argv))
    if config.offload.name == "auto":  # this machine's plan of this step, cached under run.root
        from ferry.plan.in_run import plan_for_run
        from ferry.run.preflight import checked_tokenizer

        checked_tokenizer(config)  # a bad tokenizer or prepared data is refused before the planning
        planned = plan_for_run(config, node, lambda line: console.print(line, highlight=False))
        console.print(planned.line, highlight=False)
        node = {**node, "offload": planned.offload}
        config = load_config(node)
    while True:
        if choice is not None:
            node, config = with_choice(choice, argv, node)
            detail(console, choice.line(), brief=choice.brief())
        runs.append(prepare(config, console))
        try:
            train(runs[-1], OmegaConf.to_yaml(node), console)
            return
        except InsufficientMemoryError as error:  # minimal's step over the device: full_remat's may fit
            if choice is None or not choice.may_fall_back() or wrote(runs[-1]):
                raise
            runs[-1].release()
            choice = choice.fallback(str(error).split(". ")[0])


def config_request(argv: list[str]) -> tuple[list[str], bool]:
    """The overrides without Hydra's `--cfg job` (`--cfg=job`, `-c job`), and whether it was given;
    Hydra's other `--cfg` parts (hydra, all) are not ferry's config and are refused."""
    rest, show = [], False
    for index, arg in enumerate(argv):
        if index > 0 and argv[index - 1] in ("--cfg", "-c") and "=" not in arg:
            continue  # the part, taken with its flag
        if arg in ("--cfg", "-c"):
            following = argv[index + 1] if index + 1 < len(argv) else ""
            arg = "--cfg=" + ("" if "=" in following else following)
        if arg.startswith("--cfg="):
            if arg != "--cfg=job":
                raise ConfigError(
                    f"{arg}: ferry prints its own config with --cfg job (Hydra's hydra and all parts are not used)"
                )
            show = True
        else:
            rest.append(arg)
    return rest, show


def wrote(prepared: PreparedRun) -> bool:
    """The run has written into its directory (past its step's memory check)."""
    lock = prepared.directory.lock
    return lock is not None and lock.started


def accelerator() -> str | None:
    """This machine's accelerator as the planner names it (h100, v5e, ...), or None (a CPU)."""
    return accelerator_name(jax.devices()[0].device_kind)


def with_choice(choice: DefaultChoice, argv: list[str], node: dict) -> tuple[dict, FerryConfig]:
    """The resolved config with the default preset chosen for a command that names none."""
    planned = choice.offload_node()
    node = compose_overrides([*argv, f"offload={choice.name}"]) if planned is None else {**node, "offload": planned}
    return node, load_config(node)


def refuse(error: Exception, code: int = 2) -> int:
    """One line (any newlines in the message folded), exit status `code`."""
    line = escape(" ".join(str(error).split()))  # a message's own brackets (".[plan]") are not markup
    Console(width=FILE_WIDTH, soft_wrap=True, emoji=False).print(f"[bold red]error:[/] {line}", highlight=False)
    return code


def interrupted(prepared: PreparedRun | None, what: str = "interrupted") -> str:
    """Ctrl-C's (or SIGTERM's) one line: where the run can continue from, if anywhere."""
    if prepared is None:
        return f"{what} before the run started; nothing was written"
    steps = checkpoint_steps(prepared.run_dir / "checkpoints")
    if steps:
        return f"{what}: {prepared.run_dir} holds checkpoints up to step {steps[-1]}; the same command resumes"
    if not wrote(prepared):
        return f"{what} before the run wrote anything in {prepared.run_dir}; nothing was written"
    return f"{what} before the first checkpoint of {prepared.run_dir}; the same command starts the run over"


def check_plan_extra(target: str, find_spec: Callable[[str], object] | None = None, mode: str = "plan") -> None:
    """`mode=plan` (and `mode=compile`) compile for GPUs with the CUDA plugin and for TPUs with
    libtpu: refuse an unknown target, and at once when the one the target needs is not installed."""
    import importlib.util

    find = find_spec or importlib.util.find_spec
    module, package = PLAN_EXTRA[named_target(target).platform]
    try:
        found = find(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ConfigError(
            f'mode={mode} target={target} compiles with {package}, which is not installed: pip install -e ".[plan]"'
        )


def plan(config: FerryConfig, console: Console, node: dict) -> int:
    """`mode=plan`: compile for `target` on this machine's CPU (never its own accelerator here);
    offload=auto's best candidates may then be timed on the accelerator, each in its own process
    (`offload.auto.measure`), as runs of the resolved config `node`."""
    jax.config.update("jax_platforms", "cpu")  # the CUDA plugin then only serves compile-only topologies
    # libtpu's lockfile keeps a second process off a TPU VM's chips; a plan only compiles, so it may
    # run beside a training run (or another plan) there
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    console = Console(  # the terminal's width; the cells hold user values (no markup, no emoji codes)
        width=console.width, soft_wrap=console.soft_wrap, markup=False, emoji=False
    )
    from ferry.plan.auto_measure import candidate_run, resolve_measure, subprocess_measurer
    from ferry.plan.measure import accelerator_present
    from ferry.plan.report import plan_presets, run_plan, target_platform, write_plan
    from ferry.run.compile_ahead import subprocess_compiler

    if config.target is None:  # FerryConfig refuses mode=plan without one; said again for the type checker
        raise ConfigError("mode=plan needs target=<target>")
    check_plan_extra(config.target)
    if TARGETS[config.target].platform == "gpu":  # the plan compiles with the same XLA:GPU as a run
        check_gpu_jax(f"mode=plan target={config.target}")

    def load_preset(name: str) -> OffloadConfig:
        if name not in group_presets(Path(CONFIG_DIR) / "offload"):
            raise ConfigError(f"plan.presets names {name!r}, which is not in configs/offload/")
        return from_dict(OffloadConfig, preset_node(Path(CONFIG_DIR), "offload", name), f"offload {name}")

    def load_platform(name: str) -> PlatformConfig:
        return from_dict(PlatformConfig, preset_node(Path(CONFIG_DIR), "platform", name), f"platform {name}")

    run_dir = resolve_run_dir(config)
    measure_one = compile_ahead = None
    if "auto" in plan_presets(config):
        target = TARGETS[config.target]
        settings = config.offload.auto
        measure, why = resolve_measure(settings, target.platform, accelerator_present())
        console.print(why, highlight=False)
        if measure:
            run_node = candidate_run(config, node, target_platform(config, target, load_platform), load_preset)
            measure_one = subprocess_measurer(run_node, settings)
            if target.platform == "tpu":  # libtpu compiles for the chip without it (`ferry.run.precompile`)
                compile_ahead = subprocess_compiler(run_node, config.target)
    try:
        with quiet_libtpu():  # libtpu's complaints about a machine that is no TPU VM
            plans, choices, measured = run_plan(config, load_preset, load_platform, console, measure_one, compile_ahead)
    except ValueError as error:  # the planner's checks of the target's device count and topology
        if isinstance(error, FerryError):
            raise
        raise ConfigError(str(error)) from error
    written = write_plan(plans, choices, run_dir, config, measured)
    console.print("plan written to " + ", ".join(str(path) for path in written))
    return 0


def script(argv: list[str]) -> int:
    """`main` as the command runs it: Ctrl-C anywhere, before `main`'s own handling starts or
    after it ends (while the interpreter exits), is one line and exit status 130."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop_on_sigterm()  # until the step loop listens for it itself (`ferry.run.preemption`)
        code = main(argv)
    except KeyboardInterrupt:
        print("interrupted; the same command resumes from the run directory's latest checkpoint, if any")
        code = 130
    except Terminated:
        print("stopped by SIGTERM; the same command resumes from the run directory's latest checkpoint, if any")
        code = 0
    signal.signal(signal.SIGINT, lambda signum, frame: exit_interrupted("interrupted while exiting"))
    signal.signal(signal.SIGTERM, lambda signum, frame: exit_interrupted("stopped by SIGTERM while exiting", 0))
    return code


if __name__ == "__main__":
    from ferry.run.process_exit import exit_process

    exit_process(script(sys.argv[1:]))  # a thread left blocked by a failed save does not hold the exit
