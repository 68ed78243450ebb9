"""Byte-level tokenization: 256 ids, one per byte; NUL (absent from text) ends a document."""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    vocab_size: int = 256
    end_of_document: int = 0

    def encode_document(self, data: bytes) -> np.ndarray:
        ids = np.frombuffer(data.replace(b"\0", b""), dtype=np.uint8)
        return np.append(ids, np.uint8(self.end_of_document))

    def decode(self, ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")
