"""The `data` config group: where documents come from, how they are tokenized, stored and batched."""

import dataclasses
from pathlib import Path

from ferry.data.sources import FILE_SOURCES

SOURCES = ("stdlib", *FILE_SOURCES, "synthetic")
FORMATS = ("text", "chat")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # stdlib | text | jsonl | parquet | arrayrecord | hf_dataset | synthetic
    path: str | None = None  # a file, or a directory of them (stdlib: another source tree)
    pattern: str | None = None  # files of a directory to read (default per source, e.g. *.jsonl)
    field: str = "text"  # jsonl: the field holding a document's text; parquet / hf_dataset: the column
    separator: str | None = None  # text: split each file into documents at this string ("\n\n"; escapes read)
    document_bytes: int | None = None  # text: or cut each file into documents of about this many bytes
    tokenizer: str = "byte"  # byte, or the path of a Hugging Face tokenizer.json
    eos_token: str | None = None  # Hugging Face tokenizers: the token that ends a document
    eval_fraction: float = 0.05  # documents held out, picked by a hash of their key
    seed: int = 0  # shuffling (and synthetic tokens)
    synthetic_tokens: int = 1_000_000  # synthetic: tokens in the train split
    prefetch: int = 4  # batches built ahead in a background thread
    prepared: str | None = None  # a directory of token shards written by launch/prepare_data.py
    cache_dir: str | None = None  # raw sources: where their tokens are cached (default ~/.cache/ferry/tokens)
    workers: int | None = None  # tokenizing processes (default: every core)
    shard_bytes: int = 64 * 2**20  # source text per shard (and per unit of work)
    document_mask: bool = False  # attention does not cross documents; positions restart at each
    loss_across_documents: bool = True  # document_mask: also predict a document's first token from the last one's end
    format: str = "text"  # text: every token is a target; chat: jsonl conversations, the loss on the replies only

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source is {self.source!r}; use one of {', '.join(SOURCES)}")
        if self.format not in FORMATS:
            raise ValueError(f"data.format is {self.format!r}; use one of {', '.join(FORMATS)}")
        if self.format == "chat" and self.source != "jsonl" and self.prepared is None:
            raise ValueError(
                f"data.format=chat reads conversations from JSONL records and data.source is {self.source}; "
                "set data.source=jsonl data.path=YOUR.jsonl (or data.prepared=DIR of a prepared chat corpus)"
            )
        if self.format == "chat" and self.tokenizer == "byte":
            raise ValueError(
                "data.format=chat formats conversations with a tokenizer's chat template, and data.tokenizer=byte has "
                "none; set data.tokenizer to a Hugging Face tokenizer directory whose tokenizer_config.json holds a "
                "chat_template"
            )
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"data.eval_fraction must lie in (0, 1), got {self.eval_fraction}")
        if self.synthetic_tokens < 2:
            raise ValueError(f"data.synthetic_tokens must be at least 2, got {self.synthetic_tokens}")
        if not 0 <= self.seed <= 2**32 - 1:
            raise ValueError(
                f"data.seed={self.seed} must lie in [0, {2**32 - 1}] (Grain's shuffle takes a 32-bit seed)"
            )
        if self.prefetch < 1:
            raise ValueError(f"data.prefetch must be at least 1, got {self.prefetch}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"data.workers must be at least 1 (or null: every core), got {self.workers}")
        if self.shard_bytes < 1:
            raise ValueError(f"data.shard_bytes must be at least 1, got {self.shard_bytes}")
        if self.pattern is not None and (Path(self.pattern).is_absolute() or self.pattern.startswith("~")):
            folder, _, name = self.pattern.rpartition("/")
            raise ValueError(
                f"data.pattern={self.pattern} is a path; it matches files under data.path: set "
                f"data.path={folder or '/'} data.pattern={name or '*'}"
            )
        if self.separator is not None and self.document_bytes is not None:
            raise ValueError("set data.separator or data.document_bytes, not both: a file is split one way")
        if (self.separator is not None or self.document_bytes is not None) and self.source != "text":
            raise ValueError(
                f"data.separator and data.document_bytes split text files; data.source is {self.source}, "
                "whose documents are its records"
            )
        if self.separator == "":
            raise ValueError('data.separator is empty; use a string that ends a document, e.g. "\\n\\n"')
        if self.document_bytes is not None and self.document_bytes < 1:
            raise ValueError(f"data.document_bytes must be at least 1, got {self.document_bytes}")
        if self.document_mask and self.source == "synthetic":
            raise ValueError(
                "data.document_mask=true needs documents; data=synthetic has none. Use a text source or data.prepared"
            )
        if self.eos_token is not None and self.tokenizer == "byte":
            raise ValueError(
                f"data.eos_token={self.eos_token} names a token of a Hugging Face tokenizer, but data.tokenizer=byte "
                "ends every document with byte 0 and has no other end-of-document token; drop data.eos_token, or "
                "set data.tokenizer to the tokenizer.json that holds it"
            )
        if self.prepared is not None and self.source == "synthetic":
            raise ValueError("data=synthetic makes random tokens; data.prepared reads token shards. Drop one of them")

    def ignored(self) -> list[str]:
        """Keys set away from their defaults that this source does not read (a note each at
        start-up: `data=synthetic data.path=corpus/` would otherwise train on random tokens
        without a word)."""
        unread: tuple[str, ...]
        if self.source == "synthetic":
            unread, why = ("path", "pattern", "field", "cache_dir"), "makes random tokens"
        elif self.prepared is not None:
            unread = ("path", "pattern", "field", "separator", "document_bytes", "cache_dir", "workers", "shard_bytes")
            unread, why = (*unread, "eval_fraction"), f"reads the shards in data.prepared={self.prepared} as written"
        elif self.source in ("stdlib", "text", "arrayrecord"):
            unread = ("field",) if self.source != "stdlib" else ("field", "pattern")
            why = "reads whole files" if self.source != "arrayrecord" else "reads whole records"
        elif self.format == "chat":
            unread, why = ("field",), "with data.format=chat reads each record's messages, or prompt and completion"
        else:
            return []
        defaults = DataConfig()
        where = f"data.source={self.source}" if self.prepared is None or self.source == "synthetic" else "a run"
        return [
            f"data.{name}={getattr(self, name)} is not read: {where} {why}"
            for name in unread
            if getattr(self, name) != getattr(defaults, name)
        ]
