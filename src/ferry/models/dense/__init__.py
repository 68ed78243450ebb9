"""The dense decoder every dense family shares (Llama, Qwen3): an abstract config and the model. A
new dense family is a final `AbstractDenseConfig` subclass (its name, defaults and options), its
`Family` with `DenseDecoder` as the model, and its Hugging Face mapping."""

from ferry.models.dense.config import AbstractDenseConfig
from ferry.models.dense.model import DenseDecoder, dense_decoder_layer

__all__ = ["AbstractDenseConfig", "DenseDecoder", "dense_decoder_layer"]
