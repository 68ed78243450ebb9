"""The model families ferry knows (the one place that lists them), and the numbers a launcher
needs before building a model. A family is a package under `ferry.models` defining `FAMILY`
(`ferry.models.family.Family`); adding one is that package and one line in `FAMILIES`."""

import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ferry.config_schema import from_dict
from ferry.errors import ConfigError
from ferry.models import deepseek_v3, llama, qwen3
from ferry.models.base import AbstractLanguageModel, AbstractModelConfig
from ferry.models.family import Family

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        llama.FAMILY,
        deepseek_v3.FAMILY,
        qwen3.FAMILY,
    )
}


def family_of(config: AbstractModelConfig) -> Family:
    """The family of the name `config` declares (its class's `family`)."""
    if config.family not in FAMILIES:
        raise ConfigError(
            f"a {type(config).__name__} declares family {config.family!r}; known families: {sorted(FAMILIES)}"
        )
    return FAMILIES[config.family]


def model_config(node: Mapping[str, Any]) -> AbstractModelConfig:
    """A model config from a Hydra `model` node: `family` picks the class; `name` is a label."""
    fields = dict(node)
    fields.pop("name", None)
    family = fields.pop("family", None)
    if not isinstance(family, str) or family not in FAMILIES:  # a list or mapping is no name (nor hashable)
        raise ConfigError(f"model.family is {family!r}; known families: {sorted(FAMILIES)}")
    check_model_sizes(fields, FAMILIES[family].config)
    return from_dict(FAMILIES[family].config, fields, "model")


# model sizes that may be 0: DeepSeek-V3 without dense layers, shared experts or MTP
_MAY_BE_ZERO = {"num_dense_layers", "num_shared_experts", "mtp_depth"}


def check_model_sizes(model: Mapping[str, Any], config_class: type) -> None:
    """Every count (a field the family's config types as an integer) in a `model` node is at
    least 1 (0 layers or a 0-token vocabulary fail deep inside the model's construction
    otherwise), and every number is finite; checked before the family's config is built, whose
    own checks divide by some of them. A number given for a float field (`model.norm_eps=-1`,
    which Hydra reads as an integer) is left to the config's own checks of that field."""
    hints = typing.get_type_hints(config_class)
    for name, value in model.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"model.{name}={value} is not a finite number")
        if isinstance(value, int) and _counts(hints.get(name)) and value < (0 if name in _MAY_BE_ZERO else 1):
            bound = "0 or more" if name in _MAY_BE_ZERO else "at least 1"
            raise ConfigError(f"model.{name}={value} must be {bound}")


def _counts(hint: Any) -> bool:
    """Is a field of this type a count (int, or int | None)?"""
    return hint is int or (typing.get_origin(hint) in (typing.Union, types.UnionType) and int in typing.get_args(hint))


def build_model(config: AbstractModelConfig, key: jax.Array) -> AbstractLanguageModel:
    make: Callable[..., AbstractLanguageModel] = family_of(config).model  # a final class: it takes (config, key=)
    return make(config, key=key)


def abstract_model(config: AbstractModelConfig) -> AbstractLanguageModel:
    """The model with ShapeDtypeStructs for arrays: shapes and dtypes, nothing allocated."""
    return eqx.filter_eval_shape(build_model, config, jax.random.key(0))


def count_parameters(model: AbstractLanguageModel) -> int:
    """Parameters of a model, concrete or abstract (see `abstract_model`)."""
    shapes = [leaf.shape for leaf in jax.tree.leaves(model) if hasattr(leaf, "shape")]
    return int(sum(np.prod(shape, dtype=np.int64) for shape in shapes))


def parameter_count(config: AbstractModelConfig) -> int:
    return count_parameters(abstract_model(config))


def size_summary(config: AbstractModelConfig, num_parameters: int | None = None) -> str:
    """E.g. "682.64B parameters (671.03B without MTP)"; pass `num_parameters` if known."""
    num_parameters = parameter_count(config) if num_parameters is None else num_parameters
    total = f"{num_parameters / 1e9:.2f}B parameters"
    if config.mtp_depth:
        without = parameter_count(config.without_mtp())
        return f"{total} ({without / 1e9:.2f}B without MTP)"
    return total
