"""The `data` config group: where documents come from, how they are tokenized and batched."""

import dataclasses

from ferry.data.sources import FILE_SOURCES

SOURCES = ("stdlib", *FILE_SOURCES, "synthetic")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # stdlib | text | jsonl | parquet | arrayrecord | synthetic
    path: str | None = None  # a file, or a directory of them (stdlib: another source tree)
    pattern: str | None = None  # files of a directory to read (default per source, e.g. *.jsonl)
    field: str = "text"  # jsonl: the field holding a document's text; parquet: the column
    tokenizer: str = "byte"  # byte, or the path of a Hugging Face tokenizer.json
    eos_token: str | None = None  # Hugging Face tokenizers: the token that ends a document
    eval_fraction: float = 0.05  # documents held out, picked by a hash of their key
    seed: int = 0  # shuffling (and synthetic tokens)
    synthetic_tokens: int = 1_000_000  # synthetic: tokens in the train split
    prefetch: int = 4  # batches built ahead in a background thread

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source is {self.source!r}; use one of {', '.join(SOURCES)}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"data.eval_fraction must lie in (0, 1), got {self.eval_fraction}")
        if self.synthetic_tokens < 2:
            raise ValueError(f"data.synthetic_tokens must be at least 2, got {self.synthetic_tokens}")
        if self.prefetch < 1:
            raise ValueError(f"data.prefetch must be at least 1, got {self.prefetch}")
