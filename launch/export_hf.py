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
import sys
from pathlib import Path

from ferry.config.paths import check_directory_to_write, nameable_path
from ferry.errors import FerryError
from ferry.hf import save_pretrained
from ferry.hf.pretrained import EXPORT_DTYPES
from ferry.run.saved_run import chosen_step, restored_model, run_config


class ExportError(FerryError, ValueError):
    """An export that cannot run: a missing run directory or checkpoint, an occupied output."""


def check_output(out_dir: Path) -> None:
    """The output is a new or empty directory (an export never mixes with other files) that this
    user can make and write (`ferry.config.paths`: not below a file, nor on /proc, nor too long)."""
    check_directory_to_write("OUT_DIR", str(out_dir))
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty directory; export into a new directory")


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
