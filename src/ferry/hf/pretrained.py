"""`load_pretrained` and `save_pretrained`: ferry models from and to Hugging Face checkpoint
directories (config.json + safetensors shards + their index)."""

import dataclasses
import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from ferry.errors import FerryError, read_json
from ferry.hf.config_json import check_matches
from ferry.hf.layout import TensorMap, check_tensors, host_tensors, load_array
from ferry.hf.mapping import MAPPINGS, family_of_model_type, mapping_of
from ferry.hf.safetensors_io import CheckpointError, CheckpointReader, ShardedWriter
from ferry.models import registry
from ferry.models.base import AbstractLanguageModel, AbstractModelConfig
from ferry.models.family import Family
from ferry.sharding import tree_shardings

JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint directory: its config.json, its family, the ferry config it describes
    and a reader of its tensors (nothing read yet but config.json and the safetensors headers)."""

    directory: Path
    hf_config: dict[str, Any]
    family: Family
    config: Any
    reader: CheckpointReader


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Read config.json and the safetensors headers: the family, and the ferry config they describe."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{directory} has no config.json; pass a local Hugging Face checkpoint directory "
            "(config.json, *.safetensors and, when sharded, model.safetensors.index.json)"
        )
    hf = read_json(config_file, "the checkpoint's config")
    if not isinstance(hf, dict):
        kind = JSON_KINDS.get(type(hf), "value")
        raise CheckpointError(
            f"{config_file} holds a JSON {kind}, not an object of settings (model_type, hidden_size, ...); pass a "
            "Hugging Face checkpoint directory"
        )
    family = family_of_model_type(hf.get("model_type"))
    if family is None:
        known = sorted(m.MODEL_TYPE for m in MAPPINGS.values())
        architectures = ", ".join(m.ARCHITECTURE for m in MAPPINGS.values())
        raise CheckpointError(
            f"{config_file} has model_type {hf.get('model_type')!r}; ferry imports {known} ({architectures})"
        )
    try:  # the file's values as the family reads them: a wrong kind of value is the file's fault
        reader = CheckpointReader(directory, _fp8_block(hf))
        config = mapping_of(family).config_from_hf(hf, mapping_of(family).mtp_layers(reader.names(), hf))
    except FerryError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as error:
        raise CheckpointError(
            f"{config_file} has a value ferry cannot read as a {mapping_of(family).FAMILY} config "
            f"({type(error).__name__}: {error}); compare it with the published config.json of the model"
        ) from error
    return Checkpoint(directory, hf, family, config, reader)


def _fp8_block(hf: dict[str, Any]) -> tuple[int, int] | None:
    """The block of rows x columns one FP8 scale covers, from `quantization_config`."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return None
    method, fmt, block = (
        quantization.get("quant_method"),
        quantization.get("fmt", "e4m3"),
        quantization.get("weight_block_size"),
    )
    if method != "fp8" or fmt != "e4m3" or not block or len(block) != 2:
        raise CheckpointError(
            f"config.json has quantization_config {quantization}; ferry dequantises fp8 e4m3 weights with 2-d "
            "block scales (weight_block_size) only"
        )
    return int(block[0]), int(block[1])


def matching_config(checkpoint: Checkpoint, config: Any) -> Any:
    """`config` if the checkpoint holds that architecture (an error naming every differing value
    otherwise); its training settings (scan, MoE dispatch, loss weights) are its own. MTP depths
    may be fewer than the checkpoint's."""
    family = checkpoint.family
    if not isinstance(config, AbstractModelConfig) or config.family != family.name:
        raise CheckpointError(
            f"{checkpoint.directory} is a {mapping_of(family).FAMILY} checkpoint but the model config is a "
            f"{type(config).__name__}"
        )
    where = str(checkpoint.directory / "config.json")
    check_matches(config, checkpoint.config, mapping_of(family).CONFIG_KEYS, where, at_most=frozenset({"mtp_depth"}))
    return config


@dataclasses.dataclass(frozen=True)
class CheckedCheckpoint:
    """A checkpoint known to hold every tensor of `abstract` (the model of `config`, shapes only);
    `maps` says where each parameter's tensors are."""

    checkpoint: Checkpoint
    config: Any
    abstract: eqx.Module
    maps: dict[str, TensorMap]


def check_checkpoint(directory: str | Path, config: Any | None = None) -> CheckedCheckpoint:
    """Open a checkpoint and check it holds every tensor of the model (`config`, or the one its
    config.json describes) with the right shape: headers only, before any tensor is read."""
    checkpoint = open_checkpoint(directory)
    config = checkpoint.config if config is None else matching_config(checkpoint, config)
    maps = mapping_of(checkpoint.family).tensor_maps(config, checkpoint.hf_config)
    abstract = registry.abstract_model(config)
    check_tensors(
        checkpoint.reader,
        maps,
        _leaves(abstract, maps),
        mapping_of(checkpoint.family).ignored(config, checkpoint.hf_config),
    )
    return CheckedCheckpoint(checkpoint, config, abstract, maps)


def load_pretrained(directory: str | Path, config: Any | None = None, mesh: Mesh | None = None) -> eqx.Module:
    """The ferry model of a Hugging Face checkpoint directory, float32. `config`: the model config
    to build, which must match config.json (default: the one config.json describes). `mesh`:
    each parameter is read straight into its sharding on the mesh, each process reading only the
    slices its devices hold (default: all on the first device)."""
    checked = check_checkpoint(directory, config)
    reader, abstract = checked.checkpoint.reader, checked.abstract
    if mesh is None:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
    else:
        shardings = tree_shardings(abstract, mesh)
    return jax.tree_util.tree_map_with_path(
        lambda path, like, sharding: load_array(reader, checked.maps[jax.tree_util.keystr(path)], like, sharding),
        abstract,
        shardings,
    )


def save_pretrained(
    model: AbstractLanguageModel,
    directory: str | Path,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 2**30,
    config_overrides: dict[str, Any] | None = None,
) -> list[Path]:
    """Write `model` as a Hugging Face checkpoint `transformers` loads with `from_pretrained`:
    config.json and safetensors shards of at most `max_shard_bytes` (and their index), tensors in
    `dtype` (float32 or bfloat16). `config_overrides` adds keys ferry does not know, e.g.
    `{"bos_token_id": 128000, "max_position_embeddings": 131072}`. Every process must call this
    (each tensor is gathered from the devices holding it, one at a time); process 0 writes.
    Returns the files written."""
    if not isinstance(model, AbstractLanguageModel):
        known = ", ".join(registry.FAMILIES)
        raise TypeError(f"save_pretrained exports models of ferry's families ({known}), not a {type(model).__name__}")
    family = registry.family_of(model.config)  # by the name its config declares
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype is {dtype!r}; export as one of {sorted(EXPORT_DTYPES)}")
    mapping = mapping_of(family)
    hf = mapping.config_to_hf(model.config)
    merged = hf | (config_overrides or {})
    if mapping.config_to_hf(mapping.config_from_hf(merged, model.config.mtp_depth)) != hf:
        overrides = config_overrides or {}
        changed = sorted(k for k in overrides if k in hf and overrides[k] != hf[k])
        raise ValueError(
            f"config_overrides changes the model ({changed}): it may only add keys, or set ones the model "
            "does not read (max_position_embeddings)"
        )
    hf = merged
    directory = Path(directory)
    # every process checks (no one writes before the first tensor is gathered from all of them)
    if (directory / "config.json").exists() or any(directory.glob("*.safetensors")):
        raise FileExistsError(f"{directory} already holds a checkpoint; save into a new directory")
    writing = jax.process_index() == 0
    if writing:
        directory.mkdir(parents=True, exist_ok=True)
    maps = mapping.tensor_maps(model.config, hf)
    writer = ShardedWriter(directory, max_shard_bytes)
    for path, array in _leaves(model, maps).items():
        for name, tensor in host_tensors(array, maps[path]):
            if writing:
                writer.add(name, tensor.astype(EXPORT_DTYPES[dtype]))
    if not writing:
        return []
    written = writer.close()
    hf |= dict(config_overrides or {}) | {"torch_dtype": dtype}
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return [*written, directory / "config.json"]


def _leaves(model: Any, maps: dict[str, TensorMap]) -> dict[str, Any]:
    """The model's arrays by path; the maps must cover exactly those paths."""
    leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(model)}
    if set(leaves) != set(maps):
        missing, extra = sorted(set(leaves) - set(maps)), sorted(set(maps) - set(leaves))
        raise AssertionError(
            f"ferry.hf's tensor maps are out of date with the model: unmapped {missing}, stale {extra}"
        )
    return leaves
