"""Reading a Hugging Face config.json into ferry's terms, and checking a ferry config against it.

Both spellings `transformers` has written are read: `rope_theta` and `rope_scaling` (v4, and the
published Llama 3.1 and DeepSeek-V3 checkpoints) and `rope_parameters` (v5)."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ferry.hf.safetensors_io import CheckpointError


def refuse_unless(hf: Mapping[str, Any], key: str, supported: Any, default: Any, family: str) -> None:
    """An error if config.json sets `key` to anything but `supported` (`default` when absent)."""
    value = hf.get(key, default)
    if value != supported:
        raise CheckpointError(
            f"config.json has {key}={value!r}; ferry's {family} implements only {key}={supported!r}, "
            "so it cannot represent this checkpoint"
        )


def required(hf: Mapping[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise CheckpointError(f"config.json has no {key}; ferry needs it to build the model")
    return hf[key]


def copied_from_hf(hf: Mapping[str, Any], config_keys: Mapping[str, str], fields: tuple[str, ...]) -> dict[str, Any]:
    """The ferry fields whose value is config.json's as it is (`config_keys` names the key)."""
    return {field: required(hf, config_keys[field]) for field in fields}


def copied_to_hf(config: Any, config_keys: Mapping[str, str], fields: tuple[str, ...]) -> dict[str, Any]:
    """The config.json keys of `copied_from_hf`'s fields, from `config`."""
    return {config_keys[field]: getattr(config, field) for field in fields}


def rope_settings(hf: Mapping[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """RoPE's base and its scaling parameters (with `rope_type` set), or None for plain RoPE."""
    parameters = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(parameters.get("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(
            f"config.json has partial_rotary_factor={parameters['partial_rotary_factor']}; ferry rotates whole heads"
        )
    return theta, None if rope_type == "default" else parameters | {"rope_type": rope_type}


def _differences(prefix: str, wanted: Any, found: Any) -> list[tuple[str, Any, Any]]:
    """(field, wanted, found) for every field that differs, recursing into nested configs."""
    if dataclasses.is_dataclass(wanted) and type(wanted) is type(found):
        return [
            d
            for f in dataclasses.fields(wanted)
            for d in _differences(f"{prefix}.{f.name}", getattr(wanted, f.name), getattr(found, f.name))
        ]
    if isinstance(wanted, float) or isinstance(found, float):
        same = wanted is not None and found is not None and math.isclose(wanted, found, rel_tol=1e-9)
    else:
        same = wanted == found
    return [] if same else [(prefix, wanted, found)]


def check_matches(
    wanted: Any, found: Any, hf_keys: Mapping[str, str], where: str, at_most: frozenset[str] = frozenset()
) -> None:
    """`wanted` (the run's model config) must equal `found` (built from config.json) in every
    field config.json sets, `hf_keys` mapping each to the key it comes from; the fields in
    `at_most` may be lower than the checkpoint's (fewer MTP depths are loaded)."""
    mismatches = []
    for field, hf_key in hf_keys.items():
        for name, want, got in _differences(field, getattr(wanted, field), getattr(found, field)):
            if field in at_most and want < got:
                continue
            mismatches.append(f"model.{name} is {want!r} but {where} has {got!r} ({hf_key})")
    if mismatches:
        raise CheckpointError(
            "the model config does not match the checkpoint: "
            + "; ".join(mismatches)
            + ". Choose the model config that matches the checkpoint, or override those keys"
        )
