"""Model families by name, and the numbers a launcher needs before building a model."""

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ferry.config import ConfigError, from_dict
from ferry.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from ferry.models.llama import Llama, LlamaConfig

FAMILIES: dict[str, tuple[type, type[eqx.Module]]] = {
    "llama": (LlamaConfig, Llama),
    "deepseek_v3": (DeepSeekV3Config, DeepSeekV3),
}
TINY_MODELS = {LlamaConfig: "llama_tiny", DeepSeekV3Config: "deepseek_v3_tiny"}


def model_config(node: Mapping[str, Any]) -> Any:
    """A model config from a Hydra `model` node: `family` picks the class; `name` is a label."""
    fields = dict(node)
    fields.pop("name", None)
    family = fields.pop("family", None)
    if family not in FAMILIES:
        raise ConfigError(f"model.family is {family!r}; known families: {sorted(FAMILIES)}")
    config_cls, _ = FAMILIES[family]
    return from_dict(config_cls, fields, "model")


def build_model(config: Any, key: jax.Array) -> eqx.Module:
    for config_cls, model_cls in FAMILIES.values():
        if isinstance(config, config_cls):
            return model_cls(config, key=key)
    raise ConfigError(f"no model family takes a {type(config).__name__}")


def abstract_model(config: Any) -> eqx.Module:
    """The model with ShapeDtypeStructs for arrays: shapes and dtypes, nothing allocated."""
    return eqx.filter_eval_shape(build_model, config, jax.random.key(0))


def count_parameters(model: eqx.Module) -> int:
    """Parameters of a model, concrete or abstract (see `abstract_model`)."""
    shapes = [leaf.shape for leaf in jax.tree.leaves(model) if hasattr(leaf, "shape")]
    return int(sum(np.prod(shape, dtype=np.int64) for shape in shapes))


def parameter_count(config: Any) -> int:
    return count_parameters(abstract_model(config))


def size_summary(config: Any, num_parameters: int | None = None) -> str:
    """E.g. "682.64B parameters (671.03B without MTP)"; pass `num_parameters` if known."""
    num_parameters = parameter_count(config) if num_parameters is None else num_parameters
    total = f"{num_parameters / 1e9:.2f}B parameters"
    if getattr(config, "mtp_depth", 0):
        without = parameter_count(dataclasses.replace(config, mtp_depth=0))
        return f"{total} ({without / 1e9:.2f}B without MTP)"
    return total
