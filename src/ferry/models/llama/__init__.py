"""The Llama 3.1 family: `config` (its architecture), `model` (the Equinox model); its Hugging Face mapping is
`ferry.hf.llama`."""

from ferry.models.family import Family
from ferry.models.llama.config import LlamaConfig
from ferry.models.llama.model import Llama, llama_decoder_layer

FAMILY = Family(LlamaConfig, Llama, tiny_model="llama_tiny")

__all__ = ["FAMILY", "Llama", "LlamaConfig", "llama_decoder_layer"]
