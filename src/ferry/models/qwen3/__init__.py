"""The Qwen3 (dense) family: `config` (its architecture), `model` (the dense decoder with
q/k-normed attention); its Hugging Face mapping is
`ferry.hf.qwen3`."""

from ferry.models.family import Family
from ferry.models.qwen3.config import Qwen3Config
from ferry.models.qwen3.model import Qwen3, qwen3_decoder_layer

FAMILY = Family(Qwen3Config, Qwen3, tiny_model="qwen3_tiny")

__all__ = ["FAMILY", "Qwen3", "Qwen3Config", "qwen3_decoder_layer"]
