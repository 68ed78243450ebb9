"""The Qwen3 (dense) family: `config` (its architecture); its model is the dense decoder
(`ferry.models.dense`) with q/k-normed attention, its Hugging Face mapping `ferry.hf.qwen3`."""

from ferry.models.dense import DenseDecoder
from ferry.models.family import Family
from ferry.models.qwen3.config import Qwen3Config

FAMILY = Family(Qwen3Config, DenseDecoder, tiny_model="qwen3_tiny")

__all__ = ["FAMILY", "Qwen3Config"]
