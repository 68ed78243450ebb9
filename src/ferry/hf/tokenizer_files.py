"""The tokenizer and generation files of a Hugging Face export, so that
`AutoTokenizer.from_pretrained(OUT)` reads text as the run did and `generate` stops where the run's
documents end. A run's tokenizer.json is copied with a tokenizer_config.json naming its
end-of-document token; the byte-level tokenizer (ids 0-255 are the bytes) is written as an
equivalent tokenizer.json: a byte-level BPE of the 256 bytes and no merges."""

import json
import shutil
from pathlib import Path

from ferry.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def byte_level_characters() -> dict[int, str]:
    """GPT-2's map of each byte to the printable character a byte-level tokenizer stands it for:
    the printable Latin-1 bytes are themselves, the other 68 are U+0100 onward in byte order
    (what `tokenizers.pre_tokenizers.ByteLevel` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def byte_tokenizer_json(path: Path) -> None:
    """A tokenizer.json whose ids are ferry's byte-level ids: every UTF-8 byte of the text is its
    own token, byte b is id b. (ferry drops a NUL byte from the text, its end-of-document id; this
    tokenizer encodes it as id 0.)"""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocabulary = {character: byte for byte, character in byte_level_characters().items()}
    tokenizer = RustTokenizer(models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))


def write_tokenizer_files(tokenizer: Tokenizer, directory: Path, context: int) -> list[Path]:
    """tokenizer.json and tokenizer_config.json for `tokenizer` (the run's) in `directory`;
    `context` (the run's train.seq_len) is the longest input the model was trained on."""
    settings: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "clean_up_tokenization_spaces": False,
    }
    if isinstance(tokenizer, HuggingFaceTokenizer):
        shutil.copyfile(tokenizer.path, directory / TOKENIZER_FILE)
        settings["eos_token"] = tokenizer.tokenizer.id_to_token(tokenizer.end_of_document)
    else:
        assert isinstance(tokenizer, ByteTokenizer), f"a tokenizer ferry exports: not {type(tokenizer).__name__}"
        byte_tokenizer_json(directory / TOKENIZER_FILE)  # no eos_token: byte 0 named as one would match text
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return [directory / TOKENIZER_FILE, directory / TOKENIZER_CONFIG_FILE]


def write_generation_config(tokenizer: Tokenizer, directory: Path) -> Path:
    """generation_config.json: generation ends at the run's end-of-document id. No bos_token_id:
    ferry's training puts no beginning-of-text token before a document."""
    settings = {"eos_token_id": tokenizer.end_of_document}
    (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return directory / GENERATION_CONFIG_FILE
