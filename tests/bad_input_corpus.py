"""A corpus of bad inputs generated from the config schema: every key of the frozen dataclass
configs a run composes (`FerryConfig` and the groups nested in it, the model family's config),
given a value of the wrong type and, where the field is numeric, values out of any range a
setting means (a negative count, a number that is not finite), plus the path keys pointed at
places a path cannot be (below a file, too long a name, a kernel filesystem) and at malformed
files. `tests/run/test_bad_input_corpus.py` feeds them to the entry points.
"""

import dataclasses
import json
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ferry.config.root import FerryConfig
from ferry.models.registry import FAMILIES

# the root's fields that are no key of their own (model_name, notes) or a whole group (model: below)
NOT_KEYS = {"model_name", "notes", "model"}
# keys holding a path ferry opens or makes, and what belongs there
PATH_KEYS = {
    "run.dir": "dir",
    "run.root": "dir",
    "data.path": "any",
    "data.cache_dir": "dir",
    "data.prepared": "dir",
    "data.tokenizer": "file",
    "init.from_hf": "dir",
    "platform.compilation_cache": "dir",
}
# a value of the wrong type for each kind of field (Hydra's parse of it: a string, a list, a number)
WRONG_TYPE = {bool: "maybe", int: "abc", float: "abc", str: "[1,2]"}
OUT_OF_RANGE = {int: ("-1", "-1000000000000"), float: ("-1e30", "nan", "inf")}
# string keys that take one of a few names: a name that is none of them
NOT_A_CHOICE = {
    "train.adam_moments_dtype": "float16",
    "train.loss_head": "fusd",
    "data.format": "html",
    "mode": "trian",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One command's arguments and the key its refusal must name."""

    key: str
    overrides: tuple[str, ...]
    why: str  # "wrong type", "out of range", "path", "malformed file"

    @property
    def name(self) -> str:
        return f"{self.why}: {' '.join(self.overrides)}"


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(m for m in typing.get_args(hint) if m is not type(None))
    return (hint,)


def schema_keys(cls: type = FerryConfig, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, type hint) of every leaf field of `cls`, nested dataclasses walked; the model
    group as its families' configs hold it (llama_tiny's family, what a command runs by default)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not prefix and field.name in NOT_KEYS:
            continue
        key, hint = f"{prefix}{field.name}", hints[field.name]
        nested = [m for m in _members(hint) if isinstance(m, type) and dataclasses.is_dataclass(m)]
        if nested:
            yield key, hint
            yield from schema_keys(nested[0], f"{key}.")
        else:
            yield key, hint
    if not prefix:
        yield from (("model.name", str), ("model.family", str))  # read by the registry, not fields of the class
        yield from schema_keys(FAMILIES["llama"].config, "model.")


def _kind(hint: Any) -> Any:
    member = _members(hint)[0]
    origin = typing.get_origin(member)
    if isinstance(origin, type) and issubclass(origin, Mapping) or origin is tuple:
        return "container"
    if isinstance(member, type) and dataclasses.is_dataclass(member):
        return "container"
    return member


def value_cases(keys: list[tuple[str, Any]]) -> list[Case]:
    """A wrong-typed value for every key, and out-of-range values for the numeric ones."""
    cases = []
    for key, hint in keys:
        kind = _kind(hint)
        wrong = "5" if kind == "container" else WRONG_TYPE.get(kind)
        if wrong is not None:
            cases.append(Case(key, (f"{key}={wrong}",), "wrong type"))
        for value in OUT_OF_RANGE.get(kind, ()):
            cases.append(Case(key, (f"{key}={value}",), "out of range"))
        if key in NOT_A_CHOICE:
            cases.append(Case(key, (f"{key}={NOT_A_CHOICE[key]}",), "not a choice"))
    return cases


def path_cases(root: Path) -> list[Case]:
    """Each path key below a file, with a name too long for the file system, on /proc (where it
    is made), and at a file where a directory belongs (or a directory where a file does); with
    the keys that make the run read it (a source of text files for data.path and data.cache_dir)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a_file").write_text("precious\n")
    (root / "a_dir").mkdir(exist_ok=True)
    (root / "corpus").mkdir(exist_ok=True)
    (root / "corpus" / "a.txt").write_text("some text\n" * 50)
    read_by = {
        "data.path": ("data.source=text",),
        "data.cache_dir": ("data.source=text", f"data.path={root / 'corpus'}"),
    }
    cases = []
    for key, kind in PATH_KEYS.items():
        values = [root / "a_file" / "below", root / ("n" * 300) / "x"]
        values += [root / "a_file"] if kind == "dir" else [root / "a_dir"] if kind == "file" else []
        values += [Path("/proc/ferry-corpus/x")] if kind == "dir" and Path("/proc/self").is_dir() else []
        cases += [Case(key, (*read_by.get(key, ()), f"{key}={value}"), "path") for value in values]
    return cases


# (the key that reads it, its file, what the file holds, the overrides that point the key at it)
MALFORMED = [
    ("data.tokenizer", "tok.json", bytes(range(256)) * 4, ("data.tokenizer={dir}/tok.json",)),
    ("data.tokenizer", "tok_list.json", "[1, 2]", ("data.tokenizer={dir}/tok_list.json",)),
    ("init.from_hf", "hf_garbage/config.json", "{not json", ("init.from_hf={dir}/hf_garbage",)),
    ("init.from_hf", "hf_number/config.json", "5", ("init.from_hf={dir}/hf_number",)),
    ("init.from_hf", "hf_tensors/model.safetensors", bytes(range(256)) * 4, ("init.from_hf={dir}/hf_tensors",)),
    ("data.prepared", "prepared/manifest.json", "{not json", ("data=stdlib", "data.prepared={dir}/prepared")),
    ("data.prepared", "prepared_list/manifest.json", "[]", ("data=stdlib", "data.prepared={dir}/prepared_list")),
    ("corpus.jsonl", "corpus.jsonl", bytes(range(256)) * 8, ("data.source=jsonl", "data.path={dir}/corpus.jsonl")),
    ("list.jsonl", "list.jsonl", '[1, 2]\n"text"\n', ("data.source=jsonl", "data.path={dir}/list.jsonl")),
]


def malformed_files(root: Path) -> list[Case]:
    """Files a run reads, holding garbage or the wrong JSON: a tokenizer.json, a checkpoint's
    config.json and safetensors, a prepared corpus's manifest, a JSON-lines corpus. The refusal
    names the key, or the file where the key is the source's."""
    cases = []
    for key, name, content, overrides in MALFORMED:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        cases.append(Case(key, tuple(o.format(dir=root) for o in overrides), "malformed file"))
    (root / "hf_tensors" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return cases
