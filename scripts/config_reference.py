"""Writes docs/reference/config.md, the config reference, from the config dataclasses themselves:
every key of the root config (`FerryConfig`) and of the dataclasses nested in it, with its type,
its default and the comment or docstring beside its field, and every model family's config (the
`model` group, one class per family of the registry). `tests/test_docs.py` checks the committed
page equals a fresh one, so it cannot go stale.

    python scripts/config_reference.py            # rewrite docs/reference/config.md
    python scripts/config_reference.py --check    # exit 1 when the committed page differs
"""

import argparse
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ferry.config.root import FerryConfig as ROOT  # the one import naming where the root config lives
from ferry.models.registry import FAMILIES

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"
# the root's fields that no override sets: derived from the model group, or printed notes
DERIVED = {"model_name": "model.name", "notes": None}


FIELD = re.compile(r"^    (\w+)\s*:")


def field_comments(cls: type) -> dict[str, str]:
    """Each commented field's comment in `cls`'s source: the full-line comments just above it and
    the one at its line's end, joined (a field declared again without one keeps its base's)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in source.splitlines():
        if line.startswith("    #"):
            above.append(line.strip().lstrip("#").strip())
            continue
        match = FIELD.match(line)
        text = " ".join([*above, _line_comment(line)]).strip() if match else ""
        if match and text:
            comments.setdefault(match.group(1), text)
        above = []  # a comment block belongs to the line right below it
    return comments


def _line_comment(line: str) -> str:
    """The comment at the end of one source line ('' if none, or if the line does not tokenize alone)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return ""
    return next((t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT), "")


def all_comments(cls: type) -> dict[str, str]:
    """Field comments of `cls` and the classes it inherits fields from (nearest first)."""
    merged: dict[str, str] = {}
    for base in cls.__mro__:
        if dataclasses.is_dataclass(base):
            for name, text in field_comments(base).items():
                merged.setdefault(name, text)
    return merged


def type_name(annotation: Any) -> str:
    """A type as a reader writes it: `int or None`, `Mapping[str, str]`."""
    if isinstance(annotation, str):
        return annotation.replace(" | ", " or ")
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    origin = typing.get_origin(annotation)
    if origin is not None and args:
        shown = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{shown}]"
    return str(annotation).replace("typing.", "")


def nested_dataclass(annotation: Any) -> type | None:
    """The dataclass a field holds (through `X | None`), or None."""
    candidates = typing.get_args(annotation) or (annotation,)
    found = [c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)]
    return found[0] if len(found) == 1 else None


def default_text(field: dataclasses.Field) -> str:
    value: Any
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "see below" if plain_default(value) else f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, dict | list | tuple) and not value:
        return "`{}`" if isinstance(value, dict) else "`[]`"
    return f"`{value!r}`"


def plain_default(value: Any) -> bool:
    """`value` is its class built with no arguments (its keys' own defaults, shown row by row)."""
    try:
        return bool(type(value)() == value)
    except TypeError:  # the class has required fields
        return False


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a forward reference the module cannot resolve: the written annotation
        return {f.name: f.type for f in dataclasses.fields(cls)}


def sections(cls: type, prefix: str) -> Iterator[tuple[str, type]]:
    """`cls` under the key `prefix`, then every dataclass nested in it, depth first (the root's
    `model`, a family's own config, has the model section of its own)."""
    yield prefix, cls
    annotations = hints(cls)
    for field in dataclasses.fields(cls):
        nested = nested_dataclass(annotations.get(field.name, field.type))
        if nested is not None and field.name not in DERIVED and not (field.name == "model" and not prefix):
            yield from sections(nested, f"{prefix}.{field.name}" if prefix else field.name)


def table(cls: type, prefix: str, inline_nested: bool = False) -> list[str]:
    """The Markdown table of `cls`'s keys: a nested dataclass links to its own section, or with
    `inline_nested` its keys are rows of this table."""
    return ["| key | type | default | what it does |", "|---|---|---|---|", *rows(cls, prefix, inline_nested)]


def rows(cls: type, prefix: str, inline_nested: bool) -> Iterator[str]:
    annotations, comments = hints(cls), all_comments(cls)
    for field in dataclasses.fields(cls):
        if not prefix and field.name in DERIVED:
            continue
        annotation = annotations.get(field.name, field.type)
        key = f"{prefix}.{field.name}" if prefix else field.name
        comment = comments.get(field.name, "")
        nested = nested_dataclass(annotation)
        if key == "model":
            yield "| `model` | a family's config | required | [`model`](#model): the model group |"
        elif nested is not None and not inline_nested:
            yield f"| `{key}` | `{type_name(annotation)}` | see below | [`{key}`](#{anchor(key)}) |"
        elif nested is not None:
            yield f"| `{key}` | `{cell(type_name(annotation))}` | {cell(default_text(field))} | {cell(comment)} |"
            yield from rows(nested, key, inline_nested)
        else:
            yield f"| `{key}` | `{cell(type_name(annotation))}` | {cell(default_text(field))} | {cell(comment)} |"


def anchor(key: str) -> str:
    return key.replace(".", "")


def doc_of(cls: type) -> str:
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):  # dataclasses' generated signature: no docstring
        return ""
    return " ".join(doc.split())


def section(key: str, cls: type) -> list[str]:
    title = f"`{key}`" if key else "Top-level keys"
    lines = [f"## {title} {{#{anchor(key) or 'top-level-keys'}}}", "", f"`{cls.__module__}.{cls.__name__}`", ""]
    if doc_of(cls):
        lines += [doc_of(cls), ""]
    return lines + table(cls, key) + [""]


def model_sections() -> list[str]:
    lines = [
        "## `model` {#model}",
        "",
        "The `model` group picks a family with `model.family` (a file of `configs/model/` sets it) "
        "and `model.name` labels the run. The other keys are the family's config class:",
        "",
    ]
    for name, family in sorted(FAMILIES.items()):
        cls = family.config
        lines += [f"### `model.family: {name}`", "", f"`{cls.__module__}.{cls.__name__}`", ""]
        if doc_of(cls):
            lines += [doc_of(cls), ""]
        lines += table(cls, "model", inline_nested=True) + [""]
    return lines


def reference() -> str:
    """The whole page."""
    lines = [
        "# Config reference",
        "",
        "<!-- Generated by scripts/config_reference.py from the config dataclasses; do not edit by hand. -->",
        "",
        "Every key a run reads, as `python launch/run.py KEY=VALUE` sets it. Defaults are the dataclasses'; "
        "a preset of `configs/` (e.g. `offload=minimal_offloaded`, `platform=gpu`) sets some of them "
        "otherwise. An unknown key or a value of the wrong type is refused before anything runs.",
        "",
    ]
    for key, cls in sections(ROOT, ""):
        lines += section(key, cls)
        if not key:
            lines += model_sections()
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is stale")
    args = parser.parse_args(argv)
    page = reference()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is stale: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main(sys.argv[1:]))
