"""The Llama 3.1 family: `config` (its architecture), `model` (the Equinox model), `hf` (its
Hugging Face `LlamaForCausalLM` mapping)."""

from ferry.models.family import Family
from ferry.models.llama import hf
from ferry.models.llama.config import LlamaConfig
from ferry.models.llama.model import Llama, llama_decoder_layer

FAMILY = Family("llama", LlamaConfig, Llama, tiny_model="llama_tiny", hf=hf)

__all__ = ["FAMILY", "Llama", "LlamaConfig", "llama_decoder_layer"]
