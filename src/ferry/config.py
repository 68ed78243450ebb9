"""Frozen dataclass configs, built from plain dicts (Hydra nodes) with unknown keys refused."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that names a key the schema does not have, or has a value of the wrong kind."""


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclass fields."""
    where = where or cls.__name__
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        nested = _dataclass_in(hints[name])
        if nested is not None and isinstance(value, Mapping):
            value = from_dict(nested, value, f"{where}.{name}")
        values[name] = value
    try:
        return cls(**values)
    except TypeError as error:
        raise ConfigError(f"{where}: {error}") from error


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds, also through `X | None`."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None
