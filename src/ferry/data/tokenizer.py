"""Tokenizers: byte-level (256 ids, no files needed) or a Hugging Face `tokenizer.json` from a
local path. Both end every document with an end-of-document id, so packed windows that cross
documents still mark where one ends."""

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Tried in order when `data.eos_token` is not set.
END_OF_DOCUMENT_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<｜end▁of▁sentence｜>")


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def end_of_document(self) -> int: ...

    @property
    def identity(self) -> str:  # what a prepared corpus records: the same ids for the same text
        ...

    def encode_documents(self, texts: Sequence[bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: np.ndarray) -> str: ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """256 ids, one per byte; NUL (absent from text) ends a document."""

    vocab_size: int = 256
    end_of_document: int = 0
    identity: str = "byte"

    def encode_document(self, data: bytes) -> np.ndarray:
        ids = np.frombuffer(data.replace(b"\0", b""), dtype=np.uint8)
        return np.append(ids, np.uint8(self.end_of_document))

    def encode_documents(self, texts: Sequence[bytes]) -> list[np.ndarray]:
        return [self.encode_document(text) for text in texts]

    def decode(self, ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class HuggingFaceTokenizer:
    """A `tokenizers.Tokenizer` loaded from a local tokenizer.json (nothing is downloaded)."""

    tokenizer: Any
    end_of_document: int
    vocab_size: int
    identity: str  # the tokenizer.json's SHA-256 and the end-of-document id
    path: Path  # the tokenizer.json read (an export copies it)

    def encode_documents(self, texts: Sequence[bytes]) -> list[np.ndarray]:
        decoded = [text.decode("utf-8", errors="replace") for text in texts]
        encodings = self.tokenizer.encode_batch(decoded, add_special_tokens=False)  # in parallel, in Rust
        return [np.append(np.asarray(e.ids, np.uint32), np.uint32(self.end_of_document)) for e in encodings]

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """`byte`, or the path of a Hugging Face tokenizer.json (or of the directory holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"data.tokenizer={spec}: no tokenizer.json there; use data.tokenizer=byte or the path of a "
            "Hugging Face tokenizer.json"
        )
    from tokenizers import Tokenizer as RustTokenizer

    try:
        tokenizer = RustTokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception on a malformed file
        raise ValueError(f"data.tokenizer={spec} is not a Hugging Face tokenizer.json: {error}") from error
    candidates = (eos_token,) if eos_token is not None else END_OF_DOCUMENT_TOKENS
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            identity = f"tokenizer.json sha256:{hashlib.sha256(path.read_bytes()).hexdigest()} eos:{token_id}"
            vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
            return HuggingFaceTokenizer(tokenizer, token_id, vocab_size, identity, path)
    raise ValueError(
        f"the tokenizer {path} has no end-of-document token "
        + (f"{eos_token!r}" if eos_token is not None else f"among {list(END_OF_DOCUMENT_TOKENS)}")
        + "; set data.eos_token to the token that ends a document"
    )
