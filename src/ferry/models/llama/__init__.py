"""The Llama 3.1 family: `config` (its architecture); its model is the dense decoder
(`ferry.models.dense`), its Hugging Face mapping `ferry.hf.llama`."""

from ferry.models.dense import DenseDecoder
from ferry.models.family import Family
from ferry.models.llama.config import LlamaConfig

FAMILY = Family(LlamaConfig, DenseDecoder, tiny_model="llama_tiny")

__all__ = ["FAMILY", "LlamaConfig"]
