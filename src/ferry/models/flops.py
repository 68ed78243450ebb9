"""The FLOP counts the families' formulas share (`AbstractModelConfig.forward_flops`), by
MaxText's convention: 2 x m x n x k per matmul with a weight, attention's QK^T and PV halved by
the causal mask; no recomputation, norms or elementwise work (see `ferry.train.step_flops`)."""


def swiglu_flops(tokens: int, dim: int, mlp_dim: int) -> int:
    """Gate, up and down projections, forward."""
    return 2 * tokens * dim * mlp_dim * 3


def causal_attention_flops(batch: int, seq: int, heads: int, qk_dim: int, v_dim: int) -> float:
    """QK^T and PV forward, halved by the causal mask."""
    return 2 * batch * seq * seq * heads * (qk_dim + v_dim) / 2


def grouped_query_attention_flops(
    batch: int, seq: int, dim: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[int, float]:
    """(projections, attention) of one grouped-query attention layer, forward: Q, K, V and the
    output projection, then the causal QK^T and PV."""
    tokens = batch * seq
    qkv = 2 * tokens * dim * (num_heads + 2 * num_kv_heads) * head_dim
    out = 2 * tokens * num_heads * head_dim * dim
    return qkv + out, causal_attention_flops(batch, seq, num_heads, head_dim, head_dim)
