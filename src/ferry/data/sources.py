"""Where documents come from: the stdlib corpus, local text / JSONL / Parquet / ArrayRecord files,
and a Hugging Face `datasets` directory written by `save_to_disk`.

Each source yields `(key, text)` pairs; the key (a relative path, `path:line` or `path#row`) picks
the held-out split by its hash, so the split does not depend on the order files are listed in.
Every problem with a path or a field is raised here, before anything is tokenized or compiled.
A text file is one document, or many when `data.separator` or `data.document_bytes` splits it
(read a block at a time, so one file of any size can be a corpus).
"""

import dataclasses
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from ferry.data.text_check import WHY, is_text, listed
from ferry.errors import FerryError

FILE_SOURCES = ("text", "jsonl", "parquet", "arrayrecord", "hf_dataset")
DEFAULT_PATTERNS = {
    "text": "*.txt",
    "jsonl": "*.jsonl",
    "parquet": "*.parquet",
    "arrayrecord": "*.array_record*",
    "hf_dataset": "*.arrow",
}
_READ_BLOCK = 16 * 2**20  # bytes of a large text file read at a time

Document = tuple[str, bytes]


class DataSourceError(FerryError, ValueError):
    """A data path, file or field that cannot give documents."""


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def stdlib_documents(root: Path | None = None) -> Iterator[Document]:
    """The Python standard library's own source files: real text on every machine, no download."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = stdlib_files(root)
    if not files:
        raise DataSourceError(f"no Python source files under {root}: the stdlib corpus is empty")
    for path in files:
        yield str(path.relative_to(root)), path.read_bytes()


def data_files(source: str, path: str | None, pattern: str | None = None) -> list[Path]:
    """The files of a file source: `path` itself, or its files matching `pattern` (recursively)."""
    root = _existing(source, path)
    if root.is_file():
        return [root]
    glob = pattern or DEFAULT_PATTERNS[source]
    files = sorted(p for p in root.rglob(glob) if p.is_file())
    if not files:
        raise DataSourceError(f"data.path={path} holds no files matching {glob!r}; set data.pattern to match yours")
    return files


def _key(path: Path, base: Path) -> str:
    """A file's name relative to data.path: the same wherever the data lies."""
    return str(path.relative_to(base)) if path != base else path.name


@dataclasses.dataclass(frozen=True)
class TextSplit:
    """How a text file becomes documents: whole, at each `separator`, or in pieces of about
    `document_bytes` (cut after the last newline of a piece's second half, else at a character
    boundary)."""

    separator: bytes | None = None
    document_bytes: int | None = None

    @staticmethod
    def of(separator: str | None, document_bytes: int | None) -> "TextSplit":
        """`separator` as typed: Python escapes such as \\n and \\t are read (a shell or Hydra passes them
        as two characters)."""
        if separator is None:
            return TextSplit(None, document_bytes)
        return TextSplit(separator.encode().decode("unicode_escape").encode("latin-1"), document_bytes)

    def documents(self, path: Path) -> Iterator[bytes]:
        if self.separator is None and self.document_bytes is None:
            yield path.read_bytes()
            return
        buffer = b""
        with path.open("rb") as file:
            while block := file.read(_READ_BLOCK):
                buffer += block
                pieces = self._pieces(buffer)
                buffer = pieces.pop()  # the unfinished last piece waits for the next block
                yield from (piece for piece in pieces if piece.strip())
        if buffer.strip():
            yield buffer

    def _pieces(self, buffer: bytes) -> list[bytes]:
        if self.separator is not None:
            return buffer.split(self.separator)
        size, pieces, start = self.document_bytes, [], 0
        assert size is not None
        while len(buffer) - start > size:
            end = start + size
            newline = buffer.rfind(b"\n", start + size // 2, end)
            if newline >= 0:
                end = newline + 1
            else:
                while end > start + 1 and buffer[end] & 0xC0 == 0x80:  # not inside a UTF-8 character
                    end -= 1
            pieces.append(buffer[start:end])
            start = end
        pieces.append(buffer[start:])
        return pieces


def text_files(source: str, files: list[Path], base: Path, skipped: list[str] | None) -> Iterator[tuple[Path, str]]:
    """Each file of a text or JSONL source that is text, with its key; the others' keys are added
    to `skipped` (`ferry.data.text_check`). Refuses the source, naming them, when none is text."""
    passed_over = []
    for path in files:
        key = _key(path, base)
        if is_text(path):
            yield path, key
        else:
            passed_over.append(key)
            if skipped is not None:
                skipped.append(key)
    if files and len(passed_over) == len(files):
        what = (
            f"{files[0]} is not text"
            if len(files) == 1
            else f"none of the {len(files)} files in data.path={base} is text ({listed(passed_over)})"
        )
        raise DataSourceError(
            f"data.source={source}: {what}: {WHY}; point data.path at UTF-8 text (convert another encoding with iconv)"
        )


def text_documents(
    files: list[Path], base: Path, split: TextSplit = TextSplit(), skipped: list[str] | None = None
) -> Iterator[Document]:
    """One document per file, or per piece of a file that `split` cuts; files that are not text
    are skipped (their keys added to `skipped`)."""
    whole = split.separator is None and split.document_bytes is None
    for path, key in text_files("text", files, base, skipped):
        for number, text in enumerate(split.documents(path)):
            yield (key if whole else f"{key}#{number}"), text


def jsonl_documents(files: list[Path], base: Path, field: str, skipped: list[str] | None = None) -> Iterator[Document]:
    """One document per line: the line's JSON object's `field` (a string); files that are not text
    are skipped (their keys added to `skipped`)."""
    for path, key in text_files("jsonl", files, base, skipped):
        with path.open("rb") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)[field]
                except json.JSONDecodeError as error:
                    raise DataSourceError(f"{path}:{number} is not JSON ({error})") from error
                except UnicodeDecodeError as error:  # binary, or text in another encoding
                    raise DataSourceError(
                        f"{path}:{number} is not JSON: not UTF-8 text ({error.reason} at byte {error.start}); "
                        "is it a JSONL file?"
                    ) from error
                except (KeyError, TypeError) as error:
                    raise DataSourceError(
                        f"{path}:{number} has no field {field!r}; set data.field to the field holding the text"
                    ) from error
                yield f"{key}:{number}", _text_bytes(value, f"{path}:{number}", field)


def chat_records(files: list[Path], base: Path, skipped: list[str] | None = None) -> Iterator[Document]:
    """One conversation per line, the line itself (checked here, before any tokenizing, for
    `messages` or `prompt` and `completion`: `ferry.data.chat`); files that are not text are
    skipped (their keys added to `skipped`)."""
    from ferry.data.chat import parse_record

    for path, key in text_files("jsonl", files, base, skipped):
        with path.open("rb") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    parse_record(line, f"{path}:{number}")
                    yield f"{key}:{number}", line.strip()


def parquet_documents(files: list[Path], base: Path, field: str) -> Iterator[Document]:
    """One document per row of column `field`."""
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise DataSourceError('data.source=parquet needs pyarrow: pip install -e ".[parquet]"') from error

    import pyarrow as pa

    for path in files:
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as error:
            raise DataSourceError(f"{path} is not a Parquet file ({' '.join(str(error).split())})") from error
        if field not in schema.names:
            raise DataSourceError(
                f"{path} has no column {field!r} (columns: {', '.join(schema.names)}); "
                "set data.field to the text column"
            )
        try:
            column = pq.read_table(path, columns=[field]).column(field).to_pylist()
        except (pa.ArrowException, OSError) as error:
            raise DataSourceError(
                f"{path}: column {field!r} cannot be read ({' '.join(str(error).split())})"
            ) from error
        for number, value in enumerate(column):
            yield f"{_key(path, base)}#{number}", _text_bytes(value, f"{path}#{number}", field)


def arrayrecord_documents(files: list[Path], base: Path) -> Iterator[Document]:
    """One document per record, each record a document's UTF-8 bytes."""
    import grain

    for path in files:
        try:
            source = grain.sources.ArrayRecordDataSource([str(path)])
            records = len(source)
        except (RuntimeError, ValueError, OSError) as error:  # the reader's damaged-file statuses
            raise DataSourceError(f"{path} is not an ArrayRecord file ({' '.join(str(error).split())})") from error
        for number in range(records):
            yield f"{_key(path, base)}#{number}", bytes(source[number])


def hf_dataset_documents(root: Path, field: str) -> Iterator[Document]:
    """One document per row of column `field` of a directory written by `datasets`'
    `save_to_disk`: a Dataset (state.json naming its Arrow stream files) or a DatasetDict
    (dataset_dict.json naming its splits, one such directory each). Read with pyarrow alone."""
    try:
        import pyarrow as pa
    except ImportError as error:
        raise DataSourceError('data.source=hf_dataset needs pyarrow: pip install -e ".[parquet]"') from error

    for split_dir in _hf_dataset_dirs(root):
        for name in _hf_arrow_files(split_dir):
            path = split_dir / name
            try:
                reader = pa.ipc.open_stream(path)
            except (pa.ArrowInvalid, OSError) as error:
                raise DataSourceError(f"{path} is not an Arrow stream file of a saved dataset ({error})") from error
            if field not in reader.schema.names:
                raise DataSourceError(
                    f"{path} has no column {field!r} (columns: {', '.join(reader.schema.names)}); "
                    "set data.field to the text column"
                )
            key, number = _key(path, root), 0
            for batch in reader:
                for value in batch.column(field).to_pylist():
                    yield f"{key}#{number}", _text_bytes(value, f"{path}#{number}", field)
                    number += 1


def _hf_dataset_dirs(root: Path) -> list[Path]:
    if (root / "dataset_dict.json").is_file():
        splits = _read_json(root / "dataset_dict.json").get("splits")
        if not isinstance(splits, list) or not splits:
            raise DataSourceError(f"{root / 'dataset_dict.json'} lists no splits; is it a saved DatasetDict?")
        return [root / split for split in splits]
    if (root / "state.json").is_file():
        return [root]
    raise DataSourceError(
        f"data.path={root} holds neither state.json nor dataset_dict.json: point data.source=hf_dataset at a "
        "directory written by datasets' save_to_disk"
    )


def _hf_arrow_files(split_dir: Path) -> list[str]:
    state = _read_json(split_dir / "state.json")
    try:
        return [entry["filename"] for entry in state["_data_files"]]
    except (KeyError, TypeError) as error:
        raise DataSourceError(f"{split_dir / 'state.json'} names no _data_files; is it a saved dataset?") from error


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DataSourceError(f"{path} is missing; the saved dataset is incomplete") from error
    except json.JSONDecodeError as error:
        raise DataSourceError(f"{path}:{error.lineno} is not JSON ({error.msg})") from error


def source_files(source: str, path: str | None, pattern: str | None = None) -> list[Path]:
    """Every file a source reads (what its fingerprint covers)."""
    if source == "stdlib":
        return stdlib_files(None if path is None else Path(path))
    if source == "hf_dataset":
        root = _existing(source, path)
        return sorted(p for p in root.rglob("*") if p.is_file() and p.name != ".lock")
    return data_files(source, path, pattern)


def _existing(source: str, path: str | None) -> Path:
    if path is None:
        raise DataSourceError(f"data.source={source} needs data.path (a file, or a directory of files)")
    root = Path(path).expanduser()
    if not root.exists():
        raise DataSourceError(f"data.path={path} does not exist; point it at a {source} file or a directory of them")
    return root


def _text_bytes(value: object, where: str, field: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise DataSourceError(f"{where}: field {field!r} holds {type(value).__name__}, not text")
    return value.encode()


def documents(
    source: str,
    path: str | None,
    field: str,
    pattern: str | None = None,
    split: TextSplit = TextSplit(),
    skipped: list[str] | None = None,
    chat: bool = False,
) -> Iterator[Document]:
    """The documents of a text source (every source but `synthetic`); the keys of the text and
    JSONL files skipped as not text are added to `skipped`. With `chat` (data.format=chat), a JSONL
    source's documents are its records, each a conversation."""
    if source == "stdlib":
        return stdlib_documents(None if path is None else Path(path))
    if source == "hf_dataset":
        return hf_dataset_documents(_existing(source, path), field)
    files = data_files(source, path, pattern)
    base = Path(path).expanduser()  # type: ignore[arg-type]  # data_files has refused None
    if source == "text":
        return text_documents(files, base, split, skipped)
    if source == "jsonl":
        return chat_records(files, base, skipped) if chat else jsonl_documents(files, base, field, skipped)
    if source == "parquet":
        return parquet_documents(files, base, field)
    if source == "arrayrecord":
        return arrayrecord_documents(files, base)
    raise DataSourceError(f"data.source is {source!r}; use stdlib, {', '.join(FILE_SOURCES)} or synthetic")
