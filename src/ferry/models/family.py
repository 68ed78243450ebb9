"""What a model family is: its config, its model, its small CPU model and its Hugging Face
mapping. Each family's package defines one `Family`; `ferry.models.registry` lists them."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ferry.models.base import AbstractLanguageModel, AbstractModelConfig

if TYPE_CHECKING:
    from ferry.hf_format.layout import TensorMap


@runtime_checkable
class HFMapping(Protocol):
    """A family's `hf` module: its config and tensors <-> a Hugging Face checkpoint's (checked
    when its `Family` is built: a module missing a member is refused)."""

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

    def tensor_maps(self, config: Any, hf: Mapping[str, Any]) -> "dict[str, TensorMap]":
        """Every ferry parameter path -> its tensors."""
        ...

    def ignored(self, config: Any, hf: Mapping[str, Any]) -> Callable[[str], bool]:
        """Checkpoint tensors that are no parameters of the model being loaded."""
        ...

    def mtp_layers(self, names: set[str], hf: Mapping[str, Any]) -> int:
        """How many multi-token-prediction layers a checkpoint with these tensors holds."""
        ...


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, as the registry lists it."""

    name: str  # `family:` in configs/model/*.yaml
    config: type[AbstractModelConfig]
    model: type[AbstractLanguageModel]
    tiny_model: str  # configs/model/<tiny_model>.yaml: the family at a size a CPU trains in seconds
    hf: HFMapping
