"""Where documents come from: the stdlib corpus, local text / JSONL / Parquet / ArrayRecord files.

Each source yields `(key, text)` pairs; the key (a relative path, `path:line` or `path#row`) picks
the held-out split by its hash, so the split does not depend on the order files are listed in.
Every problem with a path or a field is raised here, before anything is tokenized or compiled.
"""

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

FILE_SOURCES = ("text", "jsonl", "parquet", "arrayrecord")
DEFAULT_PATTERNS = {"text": "*.txt", "jsonl": "*.jsonl", "parquet": "*.parquet", "arrayrecord": "*.array_record*"}

Document = tuple[str, bytes]


class DataSourceError(ValueError):
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
    if path is None:
        raise DataSourceError(f"data.source={source} needs data.path (a file, or a directory of files)")
    root = Path(path).expanduser()
    if not root.exists():
        raise DataSourceError(f"data.path={path} does not exist; point it at a {source} file or a directory of them")
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


def text_documents(files: list[Path], base: Path) -> Iterator[Document]:
    """One document per file."""
    for path in files:
        yield _key(path, base), path.read_bytes()


def jsonl_documents(files: list[Path], base: Path, field: str) -> Iterator[Document]:
    """One document per line: the line's JSON object's `field` (a string)."""
    for path in files:
        key = _key(path, base)
        with path.open("rb") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)[field]
                except json.JSONDecodeError as error:
                    raise DataSourceError(f"{path}:{number} is not JSON ({error})") from error
                except (KeyError, TypeError) as error:
                    raise DataSourceError(
                        f"{path}:{number} has no field {field!r}; set data.field to the field holding the text"
                    ) from error
                yield f"{key}:{number}", _text_bytes(value, f"{path}:{number}", field)


def parquet_documents(files: list[Path], base: Path, field: str) -> Iterator[Document]:
    """One document per row of column `field`."""
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise DataSourceError('data.source=parquet needs pyarrow: pip install -e ".[parquet]"') from error

    for path in files:
        schema = pq.read_schema(path)
        if field not in schema.names:
            raise DataSourceError(
                f"{path} has no column {field!r} (columns: {', '.join(schema.names)}); "
                "set data.field to the text column"
            )
        for number, value in enumerate(pq.read_table(path, columns=[field]).column(field).to_pylist()):
            yield f"{_key(path, base)}#{number}", _text_bytes(value, f"{path}#{number}", field)


def arrayrecord_documents(files: list[Path], base: Path) -> Iterator[Document]:
    """One document per record, each record a document's UTF-8 bytes."""
    import grain

    for path in files:
        source = grain.sources.ArrayRecordDataSource([str(path)])
        for number in range(len(source)):
            yield f"{_key(path, base)}#{number}", bytes(source[number])


def _text_bytes(value: object, where: str, field: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise DataSourceError(f"{where}: field {field!r} holds {type(value).__name__}, not text")
    return value.encode()


def documents(source: str, path: str | None, field: str, pattern: str | None = None) -> Iterator[Document]:
    """The documents of a text source (every source but `synthetic`)."""
    if source == "stdlib":
        return stdlib_documents(None if path is None else Path(path))
    files = data_files(source, path, pattern)
    base = Path(path).expanduser()  # type: ignore[arg-type]  # data_files has refused None
    if source == "text":
        return text_documents(files, base)
    if source == "jsonl":
        return jsonl_documents(files, base, field)
    if source == "parquet":
        return parquet_documents(files, base, field)
    if source == "arrayrecord":
        return arrayrecord_documents(files, base)
    raise DataSourceError(f"data.source is {source!r}; use stdlib, {', '.join(FILE_SOURCES)} or synthetic")
