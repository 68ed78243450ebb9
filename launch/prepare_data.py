"""Tokenize a corpus once into token shards that training reads by random access:

    python launch/prepare_data.py data.prepared=DIR data.source=jsonl data.path=corpus/ data.tokenizer=tok.json

Takes the `data` group's keys (configs/data/), tokenizes with `data.workers` processes (default:
every core) and writes DIR/manifest.json and the shards. Interrupted, the same command resumes from
the shards already written; run again on the same input it finds nothing to do. Then train with
`python launch/run.py data.prepared=DIR data.tokenizer=tok.json ...`.

Exit status: 0 done, 2 refused (one line saying what and how to fix it), 130 interrupted by Ctrl-C.
"""

import os
import signal
import sys


def exit_interrupted(line: str) -> None:
    """Ctrl-C where no code of ferry's can handle it (the imports, the interpreter's exit): one
    line, exit status 130, at once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    os._exit(130)


if __name__ == "__main__":  # the imports below take seconds; Ctrl-C during them is one line too
    signal.signal(signal.SIGINT, lambda signum, frame: exit_interrupted("interrupted before anything was written"))
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine

from pathlib import Path  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402

from ferry.config.overrides import compose_node  # noqa: E402
from ferry.config.paths import check_directory_to_write, nameable_path  # noqa: E402
from ferry.config_schema import from_dict  # noqa: E402
from ferry.data.config import DataConfig  # noqa: E402
from ferry.data.corpus import skipped_note  # noqa: E402
from ferry.data.prepare import Prepared, prepare_corpus  # noqa: E402
from ferry.data.shards import SPLITS  # noqa: E402
from ferry.data.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from ferry.errors import ConfigError, FerryError  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def load_data_config(argv: list[str]) -> DataConfig:
    """The `data` config these overrides give; this command takes `data.*` keys only (a training
    key such as `train.steps` is refused in one line, naming the command that takes it)."""
    for arg in argv:
        if arg.startswith("-"):
            raise ConfigError(f"{arg}: prepare_data.py takes data.* overrides (key=value), not options")
    try:
        node = compose_node("prepare_data", argv, CONFIG_DIR, allowed_groups=("data",))
    except ConfigError as error:
        if "is not a key of this command" in str(error):
            raise ConfigError(f"{error}; training keys go to launch/run.py") from error
        raise
    config = from_dict(DataConfig, node.get("data", {}), "data")
    if config.source == "synthetic":
        raise ConfigError("data=synthetic makes its tokens at start-up; there is nothing to prepare")
    if config.prepared is None:
        raise ConfigError("name the directory to write: data.prepared=DIR (training reads the same key)")
    check_directory_to_write("data.prepared", config.prepared)
    for key in ("path", "tokenizer", "cache_dir"):  # a name too long for the file system, refused naming the key
        if getattr(config, key) is not None:
            nameable_path(f"data.{key}", getattr(config, key))
    return config


LOCK = ".lock"  # the lock file prepare_corpus holds in the directory it writes


def prepare_or_take_back(config: DataConfig, directory: Path, tokenizer: Tokenizer, console: Console) -> Prepared:
    """`prepare_corpus`, and on a refusal nothing of this command's left behind: its lock file
    (one that held this process's name: another's it took over since is left) and the directories
    made for it that stayed empty. What it refused, the user's own files, stays as it was."""
    made = [d for d in (directory, *directory.parents) if not d.exists()]  # deepest first
    lock, ours = directory / LOCK, f"pid {os.getpid()} on {os.uname().nodename}"  # as prepare_corpus writes it
    had_lock = lock.exists()
    try:
        return prepare_corpus(config, directory, tokenizer, console)
    except (FerryError, ValueError, FileNotFoundError):
        if not had_lock and lock.is_file() and lock.read_text() == ours:
            lock.unlink()
        for made_dir in made:
            if not made_dir.is_dir() or any(made_dir.iterdir()):
                break
            made_dir.rmdir()
        raise


def main(argv: list[str]) -> int:
    console = Console(markup=False, emoji=False)  # a path's brackets or colons are text
    config: DataConfig | None = None
    try:
        config = load_data_config(argv)
        tokenizer = load_tokenizer(config.tokenizer, config.eos_token)
        directory = Path(config.prepared).expanduser()
        prepared = prepare_or_take_back(config, directory, tokenizer, console)
    except (FerryError, ValueError, FileNotFoundError) as error:  # ConfigError, PreparedDataError, DataSourceError
        line = escape(" ".join(str(error).split()))  # one line whatever the width, its brackets not markup
        console.print(f"[bold red]error:[/] {line}", highlight=False, soft_wrap=True, markup=True)
        return 2
    except KeyboardInterrupt:
        if config is None:
            console.print("interrupted before anything was written", highlight=False)
        else:
            console.print(f"interrupted: the same command resumes from the shards written in {config.prepared}")
        return 130
    manifest = prepared.manifest
    if (note := skipped_note(manifest)) is not None:
        console.print(note, highlight=False, markup=False)
    counts = ", ".join(f"{manifest.documents(s):,} documents / {manifest.tokens(s):,} tokens {s}" for s in SPLITS)
    if prepared.units_written == 0:
        console.print(f"{directory} is up to date ({counts}): nothing to do", highlight=False)
        return 0
    rate = prepared.tokens_written / max(prepared.seconds, 1e-9)
    console.print(
        f"wrote {prepared.units_written} units ({prepared.tokens_written:,} tokens) in {prepared.seconds:.1f} s, "
        f"{rate:,.0f} tokens/s, into {directory}: {counts}",
        highlight=False,
    )
    return 0


def script(argv: list[str]) -> int:
    """`main` as the command runs it: Ctrl-C outside `main`'s own handling is one line and 130."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = main(argv)
    except KeyboardInterrupt:
        print("interrupted: the same command resumes from the shards written, if any")
        code = 130
    signal.signal(signal.SIGINT, lambda signum, frame: exit_interrupted("interrupted while exiting"))
    return code


if __name__ == "__main__":
    sys.exit(script(sys.argv[1:]))
