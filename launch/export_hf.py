"""Export a trained run as a Hugging Face checkpoint directory (config.json + safetensors):

    python launch/export_hf.py RUN_DIR OUT_DIR                 # the run's latest checkpoint
    python launch/export_hf.py RUN_DIR OUT_DIR --step 200 --dtype bfloat16

RUN_DIR is a directory `launch/run.py` wrote (its config.yaml and checkpoints/). The checkpoint is
restored as a resume would restore it (its checksums checked), on this machine's devices whatever
mesh trained it, and its parameters written with `ferry.hf.save_pretrained`: `init.from_hf=OUT_DIR`
and `transformers`' `from_pretrained` read it. The whole train state (AdamW's moments too) is
restored, so the host needs about three times the parameters' float32 bytes.

Exit status: 0 written; 2 refused (one line: no run directory, no checkpoint, an output directory
that is not empty, ...; nothing written).
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ferry.config.paths import check_directory_to_write, nameable_path
from ferry.config.root import FerryConfig, load_config
from ferry.errors import FerryError
from ferry.hf import save_pretrained
from ferry.hf.pretrained import EXPORT_DTYPES
from ferry.run.checkpoint import Checkpoints, checkpoint_steps
from ferry.sharding import MeshConfig, make_mesh
from ferry.train.state_layout import run_state_layout


class ExportError(FerryError, ValueError):
    """An export that cannot run: a missing run directory or checkpoint, an occupied output."""


def run_config(run_dir: Path) -> FerryConfig:
    """The config the run trained with, from its config.yaml."""
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} is not a directory; pass a run directory launch/run.py wrote")
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ExportError(f"{run_dir} has no config.yaml; pass a run directory launch/run.py wrote")
    node = read_yaml(config_file)
    if not isinstance(node, dict) or "model" not in node:
        raise ExportError(f"{config_file} holds no run config (no model key); pass a run directory launch/run.py wrote")
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
        raise ExportError(f"{config_file} is not valid YAML ({problem}{where}); fix it, or pass another run") from error
    except (OmegaConfBaseException, OSError, UnicodeDecodeError) as error:
        raise ExportError(
            f"{config_file} holds no run config ({' '.join(str(error).split()[:12])}); "
            "pass a run directory launch/run.py wrote"
        ) from error


def chosen_step(run_dir: Path, step: int | None) -> int:
    """`step`, or the latest checkpoint of the run; refused when there is none."""
    steps = checkpoint_steps(run_dir / "checkpoints")
    if not steps:
        raise ExportError(f"{run_dir} holds no checkpoint (checkpoints/ is empty or missing); nothing to export")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ExportError(f"{run_dir} has no checkpoint of step {step}; its checkpoints are steps {steps}")
    return step


def check_output(out_dir: Path) -> None:
    """The output is a new or empty directory (an export never mixes with other files) that this
    user can make and write (`ferry.config.paths`: not below a file, nor on /proc, nor too long)."""
    check_directory_to_write("OUT_DIR", str(out_dir))
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty directory; export into a new directory")


def restored_model(config: FerryConfig, run_dir: Path, step: int) -> object:
    """The model of checkpoint `step`, restored onto this process's devices as one replica."""
    single = dataclasses.replace(config, mesh=MeshConfig())  # any mesh restores a checkpoint
    layout = run_state_layout(single, make_mesh(MeshConfig(data=jax.device_count())))
    checkpoints = Checkpoints(run_dir / "checkpoints", config.checkpoint)
    try:
        arrays, _ = checkpoints.restore(step, layout.abstract())
    finally:
        checkpoints.manager.close()
    return layout.assemble(arrays).model


def export(run_dir: Path, out_dir: Path, step: int | None = None, dtype: str = "float32") -> list[Path]:
    """Write checkpoint `step` (default: the latest) of `run_dir` into `out_dir`; the files written."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {dtype}: export as one of {sorted(EXPORT_DTYPES)}")
    nameable_path("RUN_DIR", str(run_dir))
    config = run_config(run_dir)
    step = chosen_step(run_dir, step)
    check_output(out_dir)
    model = restored_model(config, run_dir, step)
    try:
        return save_pretrained(model, out_dir, dtype=dtype)
    except OSError as error:  # a disk filled, or a directory taken away, since the checks
        raise ExportError(
            f"{out_dir} cannot be written ({error.strerror or error}); free space there or export elsewhere"
        ) from error


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory launch/run.py wrote")
    parser.add_argument("out_dir", type=Path, help="a new (or empty) directory for the Hugging Face checkpoint")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--dtype", default="float32", help="float32 (ferry's master weights) or bfloat16")
    args = parser.parse_args(argv)
    try:
        written = export(args.run_dir, args.out_dir, args.step, args.dtype)
    except FerryError as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    print(f"exported {args.run_dir} as a Hugging Face checkpoint: {len(written)} files in {args.out_dir}")
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main(sys.argv[1:]))
