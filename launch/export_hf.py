"""Export a trained run as a Hugging Face checkpoint directory (config.json, safetensors, the
tokenizer and generation_config.json):

    python launch/export_hf.py RUN_DIR OUT_DIR                 # the run's latest checkpoint
    python launch/export_hf.py RUN_DIR OUT_DIR --step 200 --dtype bfloat16

RUN_DIR is a directory `launch/run.py` wrote (its config.yaml and checkpoints/). The checkpoint is
restored as a resume would restore it (its checksums checked), on this machine's devices whatever
mesh trained it, and its parameters written with `ferry.hf.save_pretrained`: `init.from_hf=OUT_DIR`
and `transformers`' `from_pretrained` read it. The run's tokenizer goes with it: its tokenizer.json
copied with a tokenizer_config.json, or for the byte-level default an equivalent tokenizer.json of
the 256 bytes, so `AutoTokenizer.from_pretrained(OUT_DIR)` loads it; generation_config.json ends
generation at the run's end-of-document id. The whole train state (AdamW's moments too) is
restored, so the host needs about three times the parameters' float32 bytes.

Exit status: 0 written; 2 refused (one line: no run directory, no checkpoint, an output directory
that is not empty, ...; nothing written).
"""

import argparse
import dataclasses
import sys
from pathlib import Path

from ferry.config.paths import check_directory_to_write
from ferry.errors import FerryError
from ferry.hf import save_pretrained
from ferry.hf.pretrained import EXPORT_DTYPES
from ferry.hf.tokenizer_files import write_generation_config, write_tokenizer_files
from ferry.run.saved_run import saved_run


class ExportError(FerryError, ValueError):
    """An export that cannot run: a missing run directory or checkpoint, an occupied output."""


def check_output(out_dir: Path) -> None:
    """The output is a new or empty directory (an export never mixes with other files) that this
    user can make and write (`ferry.config.paths`: not below a file, nor on /proc, nor too long)."""
    check_directory_to_write("OUT_DIR", str(out_dir))
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty directory; export into a new directory")


@dataclasses.dataclass(frozen=True)
class Export:
    files: list[Path]  # every file written
    tokenizer: str  # what was written for the run's tokenizer, in one line


def export(run_dir: Path, out_dir: Path, step: int | None = None, dtype: str = "float32") -> Export:
    """Write checkpoint `step` (default: the latest) of `run_dir` into `out_dir`, with the run's
    tokenizer and generation settings."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {dtype}: export as one of {sorted(EXPORT_DTYPES)}")
    run = saved_run(run_dir, step)
    check_output(out_dir)
    model = run.model()
    try:
        written = save_pretrained(model, out_dir, dtype=dtype)
        written += write_tokenizer_files(run.tokenizer, out_dir, run.config.train.seq_len)
        written.append(write_generation_config(run.tokenizer, out_dir))
        return Export(written, tokenizer_line(run.config.data.tokenizer))
    except OSError as error:  # a disk filled, or a directory taken away, since the checks
        raise ExportError(
            f"{out_dir} cannot be written ({error.strerror or error}); free space there or export elsewhere"
        ) from error


def tokenizer_line(config_tokenizer: str) -> str:
    """What the export says of the tokenizer it wrote."""
    if config_tokenizer == "byte":
        return (
            "tokenizer: ferry's byte-level ids, written as a tokenizer.json of the 256 bytes "
            "(transformers' AutoTokenizer loads it)"
        )
    return (
        f"tokenizer: {config_tokenizer} copied, with a tokenizer_config.json (transformers' AutoTokenizer loads it; "
        "ferry's training encoded documents without special tokens: add_special_tokens=False reads text the same way)"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory launch/run.py wrote")
    parser.add_argument("out_dir", type=Path, help="a new (or empty) directory for the Hugging Face checkpoint")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--dtype", default="float32", help="float32 (ferry's master weights) or bfloat16")
    args = parser.parse_args(argv)
    try:
        exported = export(args.run_dir, args.out_dir, args.step, args.dtype)
    except FerryError as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    print(f"exported {args.run_dir} as a Hugging Face checkpoint: {len(exported.files)} files in {args.out_dir}")
    print(exported.tokenizer)
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main(sys.argv[1:]))
