"""The dense decoder every dense family shares (Llama, Qwen3): a config base and the model. A new
dense family is a `DenseConfig` subclass (its defaults and options) and its Hugging Face mapping."""

from ferry.models.dense.config import DenseConfig
from ferry.models.dense.model import DenseDecoder, dense_decoder_layer

__all__ = ["DenseConfig", "DenseDecoder", "dense_decoder_layer"]
