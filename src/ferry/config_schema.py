"""Frozen dataclass configs, built from plain dicts (Hydra nodes) with unknown keys refused and
every value checked against its field's type when the dataclass is built: `train.steps=7.5` is
refused naming the key, the value and the type, not found out by a `TypeError` after compiling."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from ferry.errors import ConfigError, FerryError

T = TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclass fields. Each value is
    checked (and numbers widened: an int for a float field) against the field's type; a value
    the dataclass's own validation rejects is refused as a ConfigError naming `where`."""
    where = where or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {data!r}")
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
        else:
            value = checked_value(f"{where}.{name}", value, hints[name])
        values[name] = value
    try:
        return cls(**values)
    except FerryError:
        raise
    except (TypeError, ValueError) as error:  # the dataclass's own checks of its values
        message = str(error)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from error


def checked_value(key: str, value: Any, hint: Any) -> Any:
    """`value` as field type `hint` takes it, or a ConfigError naming the key, the value and the
    type. Hydra parses `7.5` as a float and `abc` as a string, so this is where they are caught."""
    options = _union_members(hint)
    if options is not None:
        if value is None and type(None) in options:
            return None
        for option in (o for o in options if o is not type(None)):
            try:
                return checked_value(key, value, option)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r}: expected {_type_name(hint)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} ({type(value).__name__}): expected a boolean, true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} ({type(value).__name__}): expected an integer")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}={value!r} ({type(value).__name__}): expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):  # Hydra parsed a name as a number
            return str(value)
        raise ConfigError(f"{key}={value!r} ({type(value).__name__}): expected a string")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and not isinstance(value, hint):
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"{key}={shown}: expected a mapping of its keys ({', '.join(_field_names(hint))})")
    origin = typing.get_origin(hint)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        if isinstance(value, Mapping):
            return value
        raise ConfigError(f"{key}={value!r}: expected a mapping of names to values")
    if origin is tuple:
        if isinstance(value, list | tuple):
            return tuple(value)
        raise ConfigError(f"{key}={value!r}: expected a list")
    return value  # a type this checker does not know (a nested dataclass given as an object)


def require_finite(key: str, value: float) -> None:
    """NaN and infinities parse as floats; no setting of a run means them."""
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not a finite number")


def require_positive(key: str, value: float, why: str) -> None:
    """A value that only a positive number makes sense of (an epsilon, a base, a factor): zero or
    a negative one can only give NaN or infinities once training starts, so it is refused now."""
    require_finite(key, value)
    if not value > 0:
        raise ConfigError(f"{key}={value} must be greater than 0: {why}")


def require_non_negative(key: str, value: float, why: str) -> None:
    """A weight or a rate whose sign flips what it does (a negative loss weight is maximised)."""
    require_finite(key, value)
    if not value >= 0:
        raise ConfigError(f"{key}={value} must be 0 or more: {why}")


def _union_members(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


def _field_names(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _type_name(hint: Any) -> str:
    members = _union_members(hint)
    if members is not None:
        return " or ".join("null" if m is type(None) else _type_name(m) for m in members)
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds, also through `X | None`."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None
