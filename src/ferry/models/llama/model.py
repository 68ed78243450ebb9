"""Llama 3.1: RMSNorm, GQA with llama3-scaled RoPE, SwiGLU, untied embedding and head: the dense
decoder (`ferry.models.dense`) with `LlamaConfig`."""

from jaxtyping import PRNGKeyArray

from ferry.models.dense.model import DenseDecoder, dense_decoder_layer
from ferry.models.llama.config import LlamaConfig
from ferry.nn.block import DecoderBlock


def llama_decoder_layer(config: LlamaConfig, *, key: PRNGKeyArray) -> DecoderBlock:
    """One Llama decoder layer (the dense decoder's)."""
    return dense_decoder_layer(config, key=key)


class Llama(DenseDecoder):
    """The dense decoder under Llama's name (its `Family`'s model class)."""
