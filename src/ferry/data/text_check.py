"""Files that are not text. A text or JSONL source reads whatever files `data.path` and
`data.pattern` name; an executable, an archive, a compressed or a UTF-16 file among them would be
tokenized byte for byte and trained on without a word.

Each file is judged on its first MiB, as git judges a file by its first 8,000 bytes: a binary file
shows itself at once, and reading every byte twice would double the cost of preparing a large
corpus (past the first MiB, the byte tokenizer drops NUL bytes and a Hugging Face tokenizer reads
invalid UTF-8 as U+FFFD, so a stray byte there costs a character, not the run).

A file is not text when NUL bytes and bytes that are not UTF-8 make up more than 1% of what was
read. Binary files sit far above that: random or compressed bytes about 43%, executables and
images 45 to 85%, UTF-16 text 50% (a NUL beside every ASCII letter). UTF-8 text has no NUL and no
invalid byte at all, and one with a stray byte of another encoding here and there (a Latin-1 name
in a UTF-8 file) stays well under 1%, where a replaced character is all it costs; Latin-1 text
throughout (French: about 15%) is over it, and is better converted (iconv) than read as damaged
UTF-8.

The decision is per file: a file that is not text is skipped, the others are read, and the
preparation says in one line how many were skipped and which; when no file is left, the source is
refused naming them.
"""

import codecs
import re
from pathlib import Path

SNIFF_BYTES = 2**20  # the part of a file judged
NOT_TEXT_FRACTION = 0.01  # NUL and invalid UTF-8 bytes above this fraction of it: not text
_ESCAPED = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins: one per byte that is not UTF-8


def unreadable_bytes(head: bytes, whole: bool) -> int:
    """NUL bytes and bytes that are not UTF-8 in `head`; a character cut at its end counts only
    when `head` is the whole file."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    text = decoder.decode(head, final=whole)
    return head.count(b"\0") + len(_ESCAPED.findall(text))


def is_text(path: Path) -> bool:
    """Whether `path` reads as text (see the module docstring)."""
    with path.open("rb") as file:
        head = file.read(SNIFF_BYTES + 1)
    whole = len(head) <= SNIFF_BYTES
    head = head[:SNIFF_BYTES]
    return unreadable_bytes(head, whole) <= NOT_TEXT_FRACTION * len(head)


WHY = "NUL bytes or invalid UTF-8 in over 1% of the first MiB"


def listed(files: list[str] | tuple[str, ...], shown: int = 3) -> str:
    """The first few of `files`, and how many more."""
    more = f" and {len(files) - shown} more" if len(files) > shown else ""
    return ", ".join(files[:shown]) + more


def skipped_line(skipped: tuple[str, ...], total: int, where: str) -> str | None:
    """The one line saying which files of `where` were skipped as not text, or None."""
    if not skipped:
        return None
    return f"note: skipped {len(skipped)} of the {total} files in {where} that are not text ({WHY}): {listed(skipped)}"
