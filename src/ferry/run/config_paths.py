"""The run's paths checked for kind and reach before the backend starts (`ferry.config.paths`): the
run directory (or the root a new one goes under), the token cache, a prepared directory, a
Hugging Face checkpoint and a saved dataset."""

import os
from collections.abc import Mapping
from pathlib import Path

from ferry.config.paths import check_directory_to_write, check_existing_directory, nameable_path
from ferry.config.root import FerryConfig
from ferry.errors import ConfigError
from ferry.platform import CACHE_VARIABLE, PlatformConfig


def check_config_paths(config: FerryConfig) -> None:
    """Refuse, naming the key, a path of the wrong kind or a directory that cannot be made. An
    existing run directory is left to the run directory's own checks (`ferry.run.directory`)."""
    run, data = config.run, config.data
    paths = {
        "run.dir": run.dir,
        "run.root": run.root,
        "data.path": data.path,
        "data.pattern": data.pattern,
        "data.cache_dir": data.cache_dir,
        "data.prepared": data.prepared,
        "data.tokenizer": data.tokenizer,
        "init.from_hf": config.init.from_hf,
    }
    for key, value in paths.items():
        if value is not None and not value.strip():
            raise ConfigError(
                f"{key} is empty, which would mean the current directory; give a path, or null where the key takes one"
            )
        if value is not None and key != "data.pattern":  # a pattern is matched, never opened
            nameable_path(key, value)
    if run.dir is not None:
        if not Path(run.dir).expanduser().exists():
            check_directory_to_write("run.dir", run.dir)
    else:
        check_directory_to_write("run.root", run.root)
    if data.cache_dir is not None and data.prepared is None and data.source != "synthetic":
        check_directory_to_write("data.cache_dir", data.cache_dir)
    if data.prepared is not None:
        check_existing_directory("data.prepared", data.prepared, "a directory written by launch/prepare_data.py")
    if data.source == "hf_dataset" and data.path is not None:
        check_existing_directory("data.path", data.path, "a directory written by datasets' save_to_disk")
    if config.init.from_hf is not None:
        check_existing_directory("init.from_hf", config.init.from_hf, "a Hugging Face checkpoint directory")
    cache = compilation_cache(config.platform, os.environ)
    if cache is not None:  # JAX would turn an unwritable cache off with a warning, and compile every time
        check_directory_to_write(*cache)


def compilation_cache(platform: PlatformConfig, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The JAX compilation cache a run uses, as (where it is set, the directory): an exported
    `JAX_COMPILATION_CACHE_DIR`, which wins, else `platform.compilation_cache` ($VARS expanded)."""
    if environ.get(CACHE_VARIABLE):
        return CACHE_VARIABLE, environ[CACHE_VARIABLE]
    if platform.compilation_cache is None:
        return None
    return "platform.compilation_cache", os.path.expandvars(platform.compilation_cache)
