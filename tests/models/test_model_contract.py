"""The model-family contract: every registered family implements the abstract config and model
and a Hugging Face mapping; parameters are sharded by the logical axes their layers declare where
they create them, and an array no layer declares is refused naming it."""

import dataclasses
import importlib
import pkgutil
from typing import ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec
from omegaconf import OmegaConf

import ferry.models
from ferry.errors import ConfigError
from ferry.hf.mapping import HFMapping, family_of_model_type, mapping_of
from ferry.models.base import AbstractLanguageModel, AbstractModelConfig
from ferry.models.dense import AbstractDenseConfig, DenseDecoder
from ferry.models.llama import LlamaConfig
from ferry.models.registry import FAMILIES, abstract_model, family_of
from ferry.nn.attention import GroupedQueryAttention
from ferry.nn.block import DecoderBlock
from ferry.nn.linear import Linear
from ferry.sharding import MESH_AXES, MeshError, tree_shardings
from ferry.train.step_flops import training_flops
from ferry.train.train_state import init_state
from tests.conftest import CONFIGS, load_model_config

MESH = AbstractMesh((1, 2, 2, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 4)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_keeps_the_contract(name):
    """Its config, model and hf mapping are the contract's; its tiny config builds its model, whose
    layers tag names, whose FLOPs are counted and whose every array has declared axes."""
    family = FAMILIES[name]
    assert issubclass(family.config, AbstractModelConfig) and issubclass(family.model, AbstractLanguageModel)
    hf = mapping_of(family)
    assert isinstance(hf, HFMapping) and family_of_model_type(hf.MODEL_TYPE) is family
    assert (CONFIGS / "model" / f"{family.tiny_model}.yaml").is_file()
    config = load_model_config(family.tiny_model)
    assert family_of(config) is family and config.for_platform("cpu").mtp_depth == config.mtp_depth
    model = abstract_model(config)
    assert isinstance(model, family.model) and model.tagged_names() >= {"decoder_layer_input", "out_proj"}
    assert training_flops(config, 2, 32).total > 0
    kinds = {kind.name: kind.num_layers for kind in model.layer_kinds() if not kind.name.startswith("mtp_")}
    assert config.stack_depths() == kinds  # the stacks the planner may compile shallower
    assert config.with_stack_depths(dict.fromkeys(kinds, 3)).stack_depths() == dict.fromkeys(kinds, 3)
    tree_shardings(model, MESH)  # refuses any array without axes


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_is_found_by_the_name_its_config_declares(name):
    """Its config class declares its name (configs/model's `family:`), and the registry and the
    Hugging Face mapping find the family by that name, not by a class (Llama and Qwen3 share one
    model class)."""
    family = FAMILIES[name]
    assert vars(family.config)["family"] == family.name == name  # declared by the class itself
    assert OmegaConf.load(CONFIGS / "model" / f"{family.tiny_model}.yaml").family == name
    config = load_model_config(family.tiny_model)
    assert config.family == name and family_of(config) is family
    assert family_of_model_type(mapping_of(family).MODEL_TYPE) is family
    assert "family" not in dataclasses.asdict(config)  # a class variable: checkpoint identities never held it


def test_a_config_declaring_no_registered_family_is_refused():
    @final
    class Unlisted(AbstractDenseConfig):
        family: ClassVar[str] = "unlisted"
        qk_norm: ClassVar[bool] = False

        def rope_scaling_of(self):
            return None

        def tied_head(self):
            return False

    config = Unlisted(vocab_size=8, dim=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, mlp_dim=8,
                      rope_theta=1e4, norm_eps=1e-6)  # fmt: skip
    with pytest.raises(ConfigError, match="declares family 'unlisted'; known families"):
        family_of(config)


def _model_classes() -> list[type]:
    """Every Equinox module class ferry.models defines, and the dense decoder's layers'."""
    names = [m.name for m in pkgutil.walk_packages(ferry.models.__path__, "ferry.models.")]
    modules = [importlib.import_module(name) for name in [*names, "ferry.nn.attention", "ferry.nn.block"]]
    found = {
        value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, eqx.Module) and value.__module__ == module.__name__
    }
    return sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


def _concrete_methods(cls: type) -> set[str]:
    """The methods and properties `cls` itself defines that are not abstract."""
    own = {name for name, value in vars(cls).items() if callable(value) or isinstance(value, property)}
    return own - set(getattr(cls, "__abstractmethods__", ())) - {"__init__", "__check_init__", "__init_subclass__"}


@pytest.mark.parametrize("cls", _model_classes(), ids=lambda cls: cls.__qualname__)
def test_every_model_class_is_abstract_or_final(cls):
    """Equinox's abstract/final pattern (`ferry.models.base`): an abstract class is named so and
    declares something to implement; a final one is marked `typing.final`, has no subclass and
    overrides no concrete method (`__check_init__` is no override: Equinox runs each class's)."""
    ferry_bases = [base for base in cls.__mro__[1:] if base.__module__.startswith("ferry.")]
    if cls.__name__.startswith("Abstract"):
        assert not cls.__dict__.get("__final__", False)
        assert cls.__abstractmethods__ or cls.__abstractvars__ or cls.__abstractclassvars__
        return
    assert cls.__dict__.get("__final__", False), f"{cls.__qualname__} is neither abstract nor final"
    assert not [sub for sub in cls.__subclasses__() if sub.__module__.startswith("ferry.")]
    assert all(base.__name__.startswith("Abstract") for base in ferry_bases)
    overridden = {name for base in ferry_bases for name in _concrete_methods(base) if name in vars(cls)}
    assert not overridden, f"{cls.__qualname__} overrides {sorted(overridden)}"


@pytest.mark.parametrize("final_class", [LlamaConfig, DenseDecoder, GroupedQueryAttention, DecoderBlock])
def test_subclassing_a_final_class_is_refused(final_class):
    with pytest.raises(TypeError, match=f"subclasses {final_class.__name__}, a final class"):
        type("Sub", (final_class,), {})


def test_a_family_missing_part_of_the_contract_cannot_be_built():
    class NoFlops(AbstractModelConfig):
        family: ClassVar[str] = "no_flops"
        vocab_size: int = 8
        dim: int = 4
        num_layers: int = 1
        mtp_depth: int = 0
        scan_layers: bool = True

        def mesh_dims(self):
            return []

        def for_platform(self, platform):
            return self

        def without_mtp(self):
            return self

    with pytest.raises(TypeError, match="forward_flops"):
        NoFlops()


def test_backend_choices_are_made_per_platform():
    config = load_model_config("deepseek_v3_tiny", moe_matmul="auto")
    assert config.for_platform("tpu").moe_matmul == "megablox"
    assert config.for_platform("gpu").moe_matmul == "tiled"
    assert load_model_config("deepseek_v3_tiny", moe_matmul="ragged_dot").for_platform("tpu").moe_matmul == "ragged_dot"
    llama = load_model_config("llama_tiny")
    assert llama.for_platform("tpu") is llama and llama.without_mtp() is llama


def test_the_train_state_is_sharded_by_the_axes_layers_declare():
    """Linear weights by the axes they were built with (a stack's layer axis unnamed), `embed`
    over fsdp and expert (the expert axis shards every parameter, as MaxText's rules do), norms
    whole; AdamW's moments exactly like their parameters."""
    embed = ("fsdp", "expert")
    model = abstract_model(load_model_config("llama_tiny"))
    state = eqx.filter_eval_shape(lambda m: init_state(m, optax.adamw(1e-3)), model)
    shardings = tree_shardings(state, MESH)
    specs = shardings.model
    assert specs.layers.layers.attention.query.weight.spec == PartitionSpec(None, embed, "tensor")
    assert specs.layers.layers.attention.out.weight.spec == PartitionSpec(None, "tensor", embed)
    assert specs.layers.layers.mlp.wo.weight.spec == PartitionSpec(None, "tensor", embed)
    assert specs.embed.weight.spec == PartitionSpec(None, embed)
    assert specs.head.weight.spec == PartitionSpec(embed, "tensor")
    assert specs.final_norm.weight.spec == PartitionSpec(None)
    adam = shardings.opt_state[0]
    assert jax.tree.leaves(adam.mu) == jax.tree.leaves(specs) == jax.tree.leaves(adam.nu)


def test_an_array_no_layer_declares_is_refused_naming_it():
    class Scaled(eqx.Module):  # not an AbstractSharded layer
        scale: jax.Array

    class Holder(eqx.Module):
        proj: Linear
        gain: Scaled

    model = Holder(Linear(4, 8, axes=("embed", "mlp"), key=jax.random.key(0)), Scaled(jnp.ones((8,))))
    with pytest.raises(MeshError, match=r"parameter .gain.scale of shape \(8,\) has no logical axes"):
        tree_shardings(model, MESH)
    with pytest.raises(ValueError, match="2 dimensions"):
        Linear(4, 8, axes=("embed",), key=jax.random.key(0))
    assert tree_shardings(model.proj, MESH).weight.spec == PartitionSpec(("fsdp", "expert"), "tensor")
