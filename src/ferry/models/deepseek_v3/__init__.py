"""The DeepSeek-V3 family: `config` (its architecture and MoE settings), `model` (the Equinox
model, its MoE block and multi-token prediction); its Hugging Face mapping is
`ferry.hf.deepseek_v3`."""

from ferry.models.deepseek_v3.config import DeepSeekV3Config
from ferry.models.deepseek_v3.model import (
    DeepSeekV3,
    MoEDecoderBlock,
    MultiTokenPrediction,
    _update_bias,
    dense_layer,
    moe_layer,
)
from ferry.models.family import Family

FAMILY = Family(DeepSeekV3Config, DeepSeekV3, tiny_model="deepseek_v3_tiny")

__all__ = [
    "FAMILY",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "MoEDecoderBlock",
    "MultiTokenPrediction",
    "_update_bias",
    "dense_layer",
    "moe_layer",
]
