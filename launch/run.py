"""ferry's entry point: `python launch/run.py model=llama3_1_8b offload=qkv_offload train.steps=100`.

Configs live in configs/ (Hydra). A per-tensor override such as `offload.tensors.mlpwo=offload`
may name a tensor the preset does not list; the offload policy then checks it against the names
the model really tags.
"""

import re
import sys
from pathlib import Path

import hydra
import jax
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from ferry import distributed
from ferry.config import ConfigError, from_dict
from ferry.hf import CheckpointError as HFCheckpointError
from ferry.memory import InsufficientMemoryError
from ferry.offload import PolicyError
from ferry.platform import PlatformConfig, apply_platform
from ferry.train.checkpoint import CheckpointError
from ferry.train.config import FerryConfig, OffloadConfig, load_config
from ferry.train.run import NonFiniteLossError, RunDirectoryError, prepare, resolve_run_dir, train

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
_TENSOR_OVERRIDE = re.compile(r"^offload\.tensors\.\w+=")


def allow_new_tensor_overrides(argv: list[str]) -> list[str]:
    """Hydra refuses keys a preset does not list unless prefixed with ++; tensor names are
    validated against the model instead, so add the prefix for them."""
    return [f"++{arg}" if _TENSOR_OVERRIDE.match(arg) else arg for arg in argv]


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    console = Console()
    try:
        config = load_config(OmegaConf.to_container(cfg, resolve=True))
        if config.mode == "plan":
            sys.exit(plan(config, console))
        variables = apply_platform(config.platform)  # before JAX starts its backend
        processes = distributed.initialize(config.distributed)  # likewise
        console = Console(quiet=jax.process_index() != 0)  # process 0 speaks for the run
        console.print(
            f"platform {config.platform.name}: "
            + (", ".join(f"{k}={v}" for k, v in variables.items()) or "no extra flags")
            + f"; {processes}",
            highlight=False,
        )
        prepared = prepare(config, console)
    except REFUSALS as error:
        refuse(error)
    try:
        train(prepared, OmegaConf.to_yaml(cfg), console)
    except (CheckpointError, HFCheckpointError) as error:  # raised before anything is written
        refuse(error)
    except NonFiniteLossError as error:
        refuse(error, code=3)


REFUSALS = (ConfigError, PolicyError, InsufficientMemoryError, RunDirectoryError, ValueError, FileNotFoundError)


def refuse(error: Exception, code: int = 2) -> None:
    Console().print(f"[bold red]error:[/] {error}", highlight=False)
    sys.exit(code)


def plan(config: FerryConfig, console: Console) -> int:
    """`mode=plan`: compile for `target` on this machine's CPU (never its own accelerator)."""
    jax.config.update("jax_platforms", "cpu")  # the CUDA plugin then only serves compile-only topologies
    console = Console(width=max(console.width, 150))  # the tables are wide; keep them whole in logs
    from ferry.plan.planner import PlanError
    from ferry.plan.report import run_plan, write_plan

    def load_preset(name: str) -> OffloadConfig:
        path = Path(CONFIG_DIR) / "offload" / f"{name}.yaml"
        if not path.exists():
            raise ConfigError(f"plan.presets names {name!r}, which is not in configs/offload/")
        return from_dict(OffloadConfig, OmegaConf.to_container(OmegaConf.load(path)), f"offload {name}")

    def load_platform(name: str) -> PlatformConfig:
        path = Path(CONFIG_DIR) / "platform" / f"{name}.yaml"
        return from_dict(PlatformConfig, OmegaConf.to_container(OmegaConf.load(path)), f"platform {name}")

    try:
        run_dir = resolve_run_dir(config)
        plans, choices = run_plan(config, load_preset, load_platform, console)
    except (*REFUSALS, PlanError) as error:
        refuse(error)
    except ImportError as error:
        refuse(ImportError(f'the planner needs the CUDA plugin or libtpu: pip install -e ".[plan]" ({error})'))
    written = write_plan(plans, choices, run_dir)
    console.print("plan written to " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.argv[1:] = allow_new_tensor_overrides(sys.argv[1:])
    main()
