"""What a model family is: its config, its model and its small CPU model. Each family's package
defines one `Family`; `ferry.models.registry` lists them. Its Hugging Face mapping is
`ferry.hf.<family>`, listed in `ferry.hf.mapping` (the models never import `ferry.hf`)."""

import dataclasses

from ferry.models.base import AbstractLanguageModel, AbstractModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, as the registry lists it; named by its config class (`family`)."""

    config: type[AbstractModelConfig]
    model: type[AbstractLanguageModel]  # families may share one: Llama's and Qwen3's is the dense decoder
    tiny_model: str  # configs/model/<tiny_model>.yaml: the family at a size a CPU trains in seconds

    @property
    def name(self) -> str:
        """`family:` in configs/model/*.yaml: the name the config class declares."""
        return self.config.family
