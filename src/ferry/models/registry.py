"""The model families ferry knows (the one place that lists them), and the numbers a launcher
needs before building a model. A family is a package under `ferry.models` defining `FAMILY`
(`ferry.models.family.Family`); adding one is that package and one line in `FAMILIES`."""

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ferry.config import ConfigError, from_dict
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
    """The family whose config `config` is."""
    for family in FAMILIES.values():
        if type(config) is family.config:
            return family
    raise ConfigError(f"no model family takes a {type(config).__name__}; known families: {sorted(FAMILIES)}")


def hf_family(model_type: Any) -> Family | None:
    """The family of a Hugging Face config.json's `model_type`, None when ferry has none."""
    return next((f for f in FAMILIES.values() if f.hf.MODEL_TYPE == model_type), None)


def model_config(node: Mapping[str, Any]) -> AbstractModelConfig:
    """A model config from a Hydra `model` node: `family` picks the class; `name` is a label."""
    fields = dict(node)
    fields.pop("name", None)
    family = fields.pop("family", None)
    if family not in FAMILIES:
        raise ConfigError(f"model.family is {family!r}; known families: {sorted(FAMILIES)}")
    return from_dict(FAMILIES[family].config, fields, "model")


def build_model(config: AbstractModelConfig, key: jax.Array) -> AbstractLanguageModel:
    return family_of(config).model(config, key=key)


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
