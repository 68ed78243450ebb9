"""Tokenize a corpus once into token shards that training reads by random access:

    python launch/prepare_data.py data.prepared=DIR data.source=jsonl data.path=corpus/ data.tokenizer=tok.json

Takes the `data` group's keys (configs/data/), tokenizes with `data.workers` processes (default:
every core) and writes DIR/manifest.json and the shards. Interrupted, the same command resumes from
the shards already written; run again on the same input it finds nothing to do. Then train with
`python launch/run.py data.prepared=DIR data.tokenizer=tok.json ...`.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from ferry.config import ConfigError, from_dict
from ferry.data.config import DataConfig
from ferry.data.prepare import prepare_corpus
from ferry.data.shards import SPLITS
from ferry.data.tokenizer import load_tokenizer

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="prepare_data")
def main(cfg: DictConfig) -> None:
    console = Console()
    try:
        config = from_dict(DataConfig, OmegaConf.to_container(cfg.data, resolve=True), "data")
        if config.source == "synthetic":
            raise ConfigError("data=synthetic makes its tokens at start-up; there is nothing to prepare")
        if config.prepared is None:
            raise ConfigError("name the directory to write: data.prepared=DIR (training reads the same key)")
        tokenizer = load_tokenizer(config.tokenizer, config.eos_token)
        directory = Path(config.prepared).expanduser()
        prepared = prepare_corpus(config, directory, tokenizer, console)
    except (ValueError, FileNotFoundError) as error:  # ConfigError, PreparedDataError, DataSourceError
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print(f"interrupted: the same command resumes from the shards written in {config.prepared}")
        sys.exit(130)
    manifest = prepared.manifest
    counts = ", ".join(f"{manifest.documents(s):,} documents / {manifest.tokens(s):,} tokens {s}" for s in SPLITS)
    if prepared.units_written == 0:
        console.print(f"{directory} is up to date ({counts}): nothing to do", highlight=False)
        return
    rate = prepared.tokens_written / max(prepared.seconds, 1e-9)
    console.print(
        f"wrote {prepared.units_written} units ({prepared.tokens_written:,} tokens) in {prepared.seconds:.1f} s, "
        f"{rate:,.0f} tokens/s, into {directory}: {counts}",
        highlight=False,
    )


if __name__ == "__main__":
    main()
