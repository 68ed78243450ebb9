"""Model FLOPs of a training step by MaxText's convention, for TFLOPs/s/device and MFU.

Counted: every matmul with a weight, forward and backward (3 x the forward's 2 x m x n x k), and
attention's QK^T and PV products with the causal mask halving them. Not counted: recomputation
(rematerialisation is the run's choice, not the model's work), norms, softmax, RoPE and other
elementwise work. DeepSeek-V3 counts MLA's down and up projections, the router (gate), the shared
experts and only the top-k routed experts a token visits, and each multi-token-prediction depth
(its projection, one MoE layer and the shared output head) at its shorter sequence.
"""

import dataclasses

from ferry.models.deepseek_v3 import DeepSeekV3Config
from ferry.models.llama import LlamaConfig


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step (forward and backward) of the whole global batch."""

    weights: float  # matmuls with a learnable weight
    attention: float  # QK^T and PV, causal

    @property
    def total(self) -> float:
        return self.weights + self.attention

    def per_device(self, num_devices: int) -> float:
        return self.total / num_devices


def _swiglu(tokens: int, dim: int, mlp_dim: int) -> int:
    """Gate, up and down projections, forward."""
    return 2 * tokens * dim * mlp_dim * 3


def _causal_attention(batch: int, seq: int, heads: int, qk_dim: int, v_dim: int) -> float:
    """QK^T and PV forward, halved by the causal mask."""
    return 2 * batch * seq * seq * heads * (qk_dim + v_dim) / 2


def llama_forward(config: LlamaConfig, batch: int, seq: int) -> tuple[int, float]:
    """(weight, attention) FLOPs of one forward pass."""
    tokens = batch * seq
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = 2 * tokens * config.dim * (heads + 2 * kv_heads) * head_dim
    out = 2 * tokens * heads * head_dim * config.dim
    per_layer = qkv + out + _swiglu(tokens, config.dim, config.mlp_dim)
    head = 2 * tokens * config.dim * config.vocab_size
    attention = _causal_attention(batch, seq, heads, head_dim, head_dim)
    return per_layer * config.num_layers + head, attention * config.num_layers


def _mla(config: DeepSeekV3Config, batch: int, seq: int) -> tuple[int, float]:
    """Multi-head latent attention forward: (projections, attention)."""
    tokens, heads = batch * seq, config.num_heads
    qk_dim = config.qk_nope_dim + config.qk_rope_dim
    query = 2 * tokens * (config.dim * config.q_lora_rank + config.q_lora_rank * heads * qk_dim)
    key_value = (
        2
        * tokens
        * (
            config.dim * (config.kv_lora_rank + config.qk_rope_dim)
            + config.kv_lora_rank * heads * (config.qk_nope_dim + config.v_dim)
        )
    )
    out = 2 * tokens * heads * config.v_dim * config.dim
    return query + key_value + out, _causal_attention(batch, seq, heads, qk_dim, config.v_dim)


def _moe(config: DeepSeekV3Config, tokens: int) -> int:
    """Router, shared experts and the top-k routed experts, forward."""
    gate = 2 * tokens * config.dim * config.num_experts
    experts = config.num_shared_experts + config.experts_per_token
    return gate + experts * _swiglu(tokens, config.dim, config.moe_mlp_dim)


def deepseek_v3_forward(config: DeepSeekV3Config, batch: int, seq: int) -> tuple[int, float]:
    """(weight, attention) FLOPs of one forward pass, multi-token prediction included."""
    tokens = batch * seq
    mla_weights, mla_attention = _mla(config, batch, seq)
    num_moe = config.num_layers - config.num_dense_layers
    weights = mla_weights * config.num_layers
    weights += _swiglu(tokens, config.dim, config.dense_mlp_dim) * config.num_dense_layers
    weights += _moe(config, tokens) * num_moe
    weights += 2 * tokens * config.dim * config.vocab_size
    attention = mla_attention * config.num_layers
    for depth in range(1, config.mtp_depth + 1):
        mtp_seq = seq - depth
        mtp_tokens = batch * mtp_seq
        depth_weights, depth_attention = _mla(config, batch, mtp_seq)
        weights += 2 * mtp_tokens * 2 * config.dim * config.dim  # projection of [embedding; hidden]
        weights += depth_weights + _moe(config, mtp_tokens) + 2 * mtp_tokens * config.dim * config.vocab_size
        attention += depth_attention
    return weights, attention


def training_flops(model_config: object, batch: int, seq: int) -> StepFlops:
    """Model FLOPs of one training step over `batch` sequences of `seq` tokens: 3 x forward
    (the backward pass computes two products per forward matmul)."""
    if isinstance(model_config, LlamaConfig):
        weights, attention = llama_forward(model_config, batch, seq)
    elif isinstance(model_config, DeepSeekV3Config):
        weights, attention = deepseek_v3_forward(model_config, batch, seq)
    else:
        raise TypeError(f"no FLOPs formula for {type(model_config).__name__}")
    return StepFlops(float(3 * weights), float(3 * attention))
