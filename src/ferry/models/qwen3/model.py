"""Qwen3 (dense): grouped-query attention whose query and key heads each pass an RMSNorm before
RoPE, SwiGLU, pre-norm blocks; the head untied or tied to the embedding: the dense decoder
(`ferry.models.dense`) with `Qwen3Config`. Its tensors carry Llama's names (query_proj ...
mlpwo), so every offload preset applies unchanged."""

from jaxtyping import PRNGKeyArray

from ferry.models.dense.model import DenseDecoder, dense_decoder_layer
from ferry.models.qwen3.config import Qwen3Config
from ferry.nn.block import DecoderBlock


def qwen3_decoder_layer(config: Qwen3Config, *, key: PRNGKeyArray) -> DecoderBlock:
    """One Qwen3 decoder layer (the dense decoder's, its attention q/k-normed)."""
    return dense_decoder_layer(config, key=key)


class Qwen3(DenseDecoder):
    """The dense decoder under Qwen3's name (its `Family`'s model class)."""
