"""A run directory `launch/run.py` wrote, read back after training: its config, its tokenizer,
its checkpoint steps and the model of one of them. The launchers that use a trained run (`launch/export_hf.py`,
`launch/sample.py`) refuse a directory that is not one in one line, before restoring anything."""

import dataclasses
from pathlib import Path

import jax
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ferry.config.paths import nameable_path
from ferry.config.root import FerryConfig, load_config
from ferry.data.tokenizer import Tokenizer, load_tokenizer
from ferry.errors import FerryError
from ferry.models.base import AbstractLanguageModel
from ferry.run.checkpoint import Checkpoints, checkpoint_steps
from ferry.sharding import MeshConfig, make_mesh
from ferry.train.state_layout import run_state_layout


class SavedRunError(FerryError, ValueError):
    """A directory that is not a trained run: no config.yaml, no checkpoint, no such step."""


def run_config(run_dir: Path) -> FerryConfig:
    """The config the run trained with, from its config.yaml."""
    if not run_dir.is_dir():
        raise SavedRunError(f"{run_dir} is not a directory; pass a run directory launch/run.py wrote")
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise SavedRunError(f"{run_dir} has no config.yaml; pass a run directory launch/run.py wrote")
    node = read_yaml(config_file)
    if not isinstance(node, dict) or "model" not in node:
        raise SavedRunError(
            f"{config_file} holds no run config (no model key); pass a run directory launch/run.py wrote"
        )
    return load_config(node)


def read_yaml(config_file: Path) -> object:
    """The YAML in `config_file`, resolved; a file that does not parse (or holds one bare value, which
    OmegaConf refuses) is refused naming it and where, in one line."""
    try:
        return OmegaConf.to_container(OmegaConf.load(config_file), resolve=True)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise SavedRunError(
            f"{config_file} is not valid YAML ({problem}{where}); fix it, or pass another run"
        ) from error
    except (OmegaConfBaseException, OSError, UnicodeDecodeError) as error:
        raise SavedRunError(
            f"{config_file} holds no run config ({' '.join(str(error).split()[:12])}); "
            "pass a run directory launch/run.py wrote"
        ) from error


def run_tokenizer(config: FerryConfig) -> Tokenizer:
    """The tokenizer the run trained with (`data.tokenizer`, `data.eos_token`), refused in one
    line where it is no longer there or no longer fits the model."""
    try:
        tokenizer = load_tokenizer(config.data.tokenizer, config.data.eos_token)
    except (FileNotFoundError, ValueError) as error:
        raise SavedRunError(
            f"the run's tokenizer cannot be loaded ({' '.join(str(error).split())}); a relative data.tokenizer is read "
            "from this directory: run from where the run was started, or put the tokenizer.json back"
        ) from error
    if tokenizer.vocab_size > config.model.vocab_size:
        raise SavedRunError(
            f"the run's tokenizer data.tokenizer={config.data.tokenizer} has {tokenizer.vocab_size} ids but the "
            f"model's vocabulary is {config.model.vocab_size}: the file changed since training; put the run's "
            "tokenizer.json back"
        )
    return tokenizer


def chosen_step(run_dir: Path, step: int | None) -> int:
    """`step`, or the latest checkpoint of the run; refused when there is none."""
    steps = checkpoint_steps(run_dir / "checkpoints")
    if not steps:
        raise SavedRunError(f"{run_dir} holds no checkpoint (checkpoints/ is empty or missing); nothing to restore")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise SavedRunError(f"{run_dir} has no checkpoint of step {step}; its checkpoints are steps {steps}")
    return step


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """A run directory checked to hold a run: its config, the checkpoint step chosen, its tokenizer."""

    directory: Path
    config: FerryConfig
    step: int
    tokenizer: Tokenizer

    def model(self) -> AbstractLanguageModel:
        """The model of the chosen checkpoint (`restored_model`)."""
        return restored_model(self.config, self.directory, self.step)


def saved_run(run_dir: Path, step: int | None = None) -> SavedRun:
    """`run_dir` checked to be a run (`RUN_DIR`: a path the file system can name) with checkpoint
    `step` (default: its latest) and its tokenizer, before anything is restored."""
    nameable_path("RUN_DIR", str(run_dir))
    config = run_config(run_dir)
    step = chosen_step(run_dir, step)
    return SavedRun(run_dir, config, step, run_tokenizer(config))


def restored_model(config: FerryConfig, run_dir: Path, step: int) -> AbstractLanguageModel:
    """The model of checkpoint `step`, restored (its checksums checked) onto this process's devices
    as one replica, whatever mesh trained it. The whole train state is restored (AdamW's moments
    too), so the host needs about three times the parameters' float32 bytes."""
    single = dataclasses.replace(config, mesh=MeshConfig())  # any mesh restores a checkpoint
    layout = run_state_layout(single, make_mesh(MeshConfig(data=jax.device_count())))
    checkpoints = Checkpoints(run_dir / "checkpoints", config.checkpoint)
    try:
        arrays, _ = checkpoints.restore(step, layout.abstract())
    finally:
        checkpoints.manager.close()
    model = layout.assemble(arrays).model
    assert isinstance(model, AbstractLanguageModel), "a run's train state holds its language model"
    return model
