"""Which Hugging Face mapping each model family has: the one place that pairs a family
(`ferry.models.registry.FAMILIES`) with its module here, so that the models never import
`ferry.hf` and adding a family's checkpoints is its module plus one line in `MAPPINGS`."""

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from ferry.hf import deepseek_v3, llama, qwen3
from ferry.hf.layout import TensorMap
from ferry.models.base import AbstractModelConfig
from ferry.models.family import Family
from ferry.models.registry import FAMILIES


@runtime_checkable
class HFMapping(Protocol):
    """A family's module in `ferry.hf`: its config and tensors <-> a Hugging Face checkpoint's
    (`MAPPINGS` is checked against the protocol when this module is imported: a module missing a
    member is refused)."""

    MODEL_TYPE: str  # config.json's model_type
    ARCHITECTURE: str  # the `transformers` class, e.g. "LlamaForCausalLM"
    FAMILY: str  # the family's name in messages, e.g. "Llama"

    @property
    def CONFIG_KEYS(self) -> Mapping[str, str]:  # a module constant, read-only here
        """ferry field -> the config.json key it comes from."""
        ...

    def config_from_hf(self, hf: Mapping[str, Any], mtp_layers: int = 0) -> AbstractModelConfig:
        """ferry's config for a config.json (and the MTP layers the checkpoint holds)."""
        ...

    def config_to_hf(self, config: Any) -> dict[str, Any]:
        """The architecture keys of config.json for `config`."""
        ...

    def tensor_maps(self, config: Any, hf: Mapping[str, Any]) -> dict[str, TensorMap]:
        """Every ferry parameter path -> its tensors."""
        ...

    def ignored(self, config: Any, hf: Mapping[str, Any]) -> Callable[[str], bool]:
        """Checkpoint tensors that are no parameters of the model being loaded."""
        ...

    def mtp_layers(self, names: set[str], hf: Mapping[str, Any]) -> int:
        """How many multi-token-prediction layers a checkpoint with these tensors holds."""
        ...


MAPPINGS: dict[str, HFMapping] = {"llama": llama, "deepseek_v3": deepseek_v3, "qwen3": qwen3}  # by family name
for _name, _module in MAPPINGS.items():
    if not isinstance(_module, HFMapping):
        raise TypeError(f"ferry.hf.MAPPINGS[{_name!r}] is not a Hugging Face mapping (see HFMapping)")


def mapping_of(family: Family) -> HFMapping:
    """The Hugging Face mapping of a family."""
    return MAPPINGS[family.name]


def family_of_model_type(model_type: Any) -> Family | None:
    """The family of a Hugging Face config.json's `model_type`, None when ferry has none."""
    return next((FAMILIES[name] for name, hf in MAPPINGS.items() if hf.MODEL_TYPE == model_type), None)
