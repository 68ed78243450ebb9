"""Model FLOPs by MaxText's convention, against values computed by hand for the published
Llama 3.1 8B and DeepSeek-V3, and against 6 x tokens x the weights a token passes through (read
from the real model's parameter shapes); the MFU peak table."""

import dataclasses

import jax
import pytest

from ferry.models.registry import abstract_model
from ferry.train.step_flops import CONVENTION, training_flops
from ferry.xla.peak import device_peak, table_peak
from ferry.xla.targets import TARGETS
from tests.conftest import load_model_config


def activated_weights(config) -> float:
    """Weights a token's forward pass multiplies by: all matrices but the input embedding, the
    routed experts scaled by top-k / experts (norms and the router's bias do no matmul)."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_model(config)):
        name = jax.tree_util.keystr(path)
        if name.startswith(".embed.") or "norm" in name or "correction_bias" in name:
            continue
        size = float(leaf.size)
        if ".experts." in name:
            size *= config.experts_per_token / config.num_experts
        total += size
    return total


def test_llama_tiny_by_hand_with_causal_attention_halved():
    # llama_tiny (dim 64, 2 layers, 4 heads and 2 KV heads of 16, FFN 192, vocabulary 256), batch 2 x 32
    # tokens: N = 64. Per layer, forward: Q/K/V 2N x 64 x (4 + 2 x 2) x 16 = 1,048,576; out 2N x 64 x 64 =
    # 524,288; SwiGLU 2N x 3 x 64 x 192 = 4,718,592; head 2N x 64 x 256 = 2,097,152. Weights x3 (forward
    # and backward): 3 x (2 x 6,291,456 + 2,097,152) = 44,040,192. Attention: QK^T and PV over 2 x 32 x 32
    # positions, 4 heads of 16, 2 layers, x3, and halved, as causal attention is counted (MaxText since
    # its PR #1988): 3 x 2 x (2 x 2 x 32^2 x 4 x (16 + 16)) / 2 = 1,572,864; the whole T x T twice that.
    flops = training_flops(load_model_config("llama_tiny"), 2, 32)
    assert flops.weights == 44_040_192
    assert flops.attention == 1_572_864
    assert flops.total == 44_040_192 + 1_572_864
    assert flops.full_attention_total == 44_040_192 + 2 * 1_572_864
    assert CONVENTION == "causal_attention_halved"


def test_llama3_1_8b_by_hand():
    # batch 1 x 8192 tokens (T). Per layer, forward: Q/K/V 2T x 4096 x (32 + 2 x 8) x 128 = 2T x 25,165,824;
    # out 2T x 4096 x 4096; SwiGLU 2T x 3 x 4096 x 14336; head 2T x 4096 x 128256. Weights, x3 for
    # forward + backward: 3 x 8192 x 2 x (32 x 218,103,808 + 525,336,576) = 368,868,971,249,664.
    # Attention: 3 x 32 layers x (4 x 8192^2 x 32 heads x 128) / 2 (causal) = 52,776,558,133,248.
    flops = training_flops(load_model_config("llama3_1_8b"), 1, 8192)
    assert flops.weights == 368_868_971_249_664
    assert flops.attention == 52_776_558_133_248
    assert flops.total == pytest.approx(421.645529382912e12, rel=1e-15)
    assert flops.per_device(8) == flops.total / 8
    # 7,504,658,432 weights (8.03B less the 525M embedding and the norms): 6 x T x weights
    assert flops.weights == 6 * 8192 * activated_weights(load_model_config("llama3_1_8b"))
    assert training_flops(load_model_config("llama3_1_8b"), 4, 8192).total == 4 * flops.total


def test_deepseek_v3_by_hand():
    # batch 1 x 4096 tokens, without MTP. Per layer MLA, forward: query 2T(7168 x 1536 + 1536 x 128 x 192),
    # key/value 2T(7168 x (512 + 64) + 512 x 128 x (128 + 128)), out 2T x 128 x 128 x 7168; attention
    # 2 x 4096^2 x 128 x (192 + 128) / 2. 3 dense layers of SwiGLU 18432; 58 MoE layers of router
    # 2T x 7168 x 256 + (1 shared + 8 routed) x SwiGLU 2048; head 2T x 7168 x 129280. All x3.
    config = dataclasses.replace(load_model_config("deepseek_v3"), mtp_depth=0)
    flops = training_flops(config, 1, 4096)
    assert flops.weights == 900_086_095_675_392
    assert flops.attention == 125_756_642_426_880
    assert flops.weights == 6 * 4096 * activated_weights(config)  # 36.6B weights a token passes through
    # one MTP depth at 4095 tokens: projection 2 x 4095 x 14336 x 7168, one MLA + MoE layer, the head
    with_mtp = training_flops(load_model_config("deepseek_v3"), 1, 4096)
    assert with_mtp.weights == 939_760_294_428_672
    assert with_mtp.attention == 127_817_220_218_880


def test_peak_table_follows_the_planner_targets():
    assert table_peak("NVIDIA H100 80GB HBM3") == (TARGETS["h100"].bf16_peak_flops, "h100")
    assert table_peak("NVIDIA H200") == (989e12, "h200")
    assert table_peak("NVIDIA GB200")[1] == "gb200" and table_peak("NVIDIA B200")[1] == "b200"
    assert table_peak("TPU v5 lite")[1] == "v5e" and table_peak("TPU v6 lite")[1] == "v6e"
    assert table_peak("TPU v5p")[1] == "v5p"
    assert table_peak("cpu") is None
    peak, source = device_peak(jax.devices()[0], "float32")  # the CPU: measured
    assert peak > 1e8 and "measured" in source
