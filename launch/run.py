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
from ferry.config import ConfigError
from ferry.memory import InsufficientMemoryError
from ferry.offload import PolicyError
from ferry.platform import apply_platform
from ferry.train.config import load_config
from ferry.train.run import RunDirectoryError, prepare, train

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
    except (
        ConfigError,
        PolicyError,
        InsufficientMemoryError,
        RunDirectoryError,
        ValueError,
        FileNotFoundError,
    ) as error:
        Console().print(f"[bold red]error:[/] {error}", highlight=False)
        sys.exit(2)
    train(prepared, OmegaConf.to_yaml(cfg), console)


if __name__ == "__main__":
    sys.argv[1:] = allow_new_tensor_overrides(sys.argv[1:])
    main()
