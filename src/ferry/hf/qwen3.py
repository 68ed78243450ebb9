"""Qwen3 (dense) <-> Hugging Face `Qwen3ForCausalLM`.

Like Llama's, the checkpoints' q_proj and k_proj rows are in the rotate-half RoPE order ferry uses,
so the weights map one-to-one, Linear weights transposed from [out, in] to [in, out]; q_norm and
k_norm are one [head_dim] weight per layer. A tied checkpoint (tie_word_embeddings) has no
lm_head: ferry's head reads the embedding."""

from collections.abc import Callable, Mapping
from typing import Any

from ferry.hf.config_json import copied_from_hf, copied_to_hf, refuse_unless, required, rope_settings
from ferry.hf.layout import TensorMap, single, stacked
from ferry.hf.safetensors_io import CheckpointError
from ferry.models.qwen3.config import Qwen3Config

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
FAMILY = "Qwen3"

# ferry field -> the config.json key it comes from (what a mismatch names)
CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "mlp_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}
COPIED = ("vocab_size", "dim", "num_layers", "num_heads", "mlp_dim")  # as config.json holds them, both ways


def config_from_hf(hf: Mapping[str, Any], mtp_layers: int = 0) -> Qwen3Config:
    """ferry's config for a config.json; features ferry's Qwen3 lacks are refused."""
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False)):
        refuse_unless(hf, key, supported, supported, FAMILY)
    sliding = [kind for kind in hf.get("layer_types") or [] if kind != "full_attention"]
    if sliding:
        raise CheckpointError(
            f"config.json has layer_types {sorted(set(sliding))}; ferry's Qwen3 implements full attention only"
        )
    heads = required(hf, "num_attention_heads")
    theta, rope = rope_settings(hf, default_theta=1000000.0)
    if rope is not None:
        raise CheckpointError(
            f"config.json has RoPE scaling {rope['rope_type']!r}; ferry's Qwen3 implements plain RoPE only"
        )
    return Qwen3Config(
        **copied_from_hf(hf, CONFIG_KEYS, COPIED),
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_to_hf(config: Qwen3Config) -> dict[str, Any]:
    """The architecture keys of config.json for `config` (the v4 RoPE keys, which v5 also reads)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **copied_to_hf(config, CONFIG_KEYS, COPIED),
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": config.tie_embeddings,
    }


def tensor_maps(config: Qwen3Config, hf: Mapping[str, Any]) -> dict[str, TensorMap]:
    """Every ferry parameter path -> its tensors."""

    def layer(suffix: str, transposed: bool = True) -> TensorMap:
        return stacked(lambda i: f"model.layers.{i}.{suffix}", config.num_layers, transposed=transposed)

    maps = {
        ".embed.weight": single("model.embed_tokens.weight"),
        ".layers.layers.attention_norm.weight": layer("input_layernorm.weight", transposed=False),
        ".layers.layers.attention.query.weight": layer("self_attn.q_proj.weight"),
        ".layers.layers.attention.key.weight": layer("self_attn.k_proj.weight"),
        ".layers.layers.attention.value.weight": layer("self_attn.v_proj.weight"),
        ".layers.layers.attention.out.weight": layer("self_attn.o_proj.weight"),
        ".layers.layers.attention.query_norm.weight": layer("self_attn.q_norm.weight", transposed=False),
        ".layers.layers.attention.key_norm.weight": layer("self_attn.k_norm.weight", transposed=False),
        ".layers.layers.mlp_norm.weight": layer("post_attention_layernorm.weight", transposed=False),
        ".layers.layers.mlp.wi_0.weight": layer("mlp.gate_proj.weight"),
        ".layers.layers.mlp.wi_1.weight": layer("mlp.up_proj.weight"),
        ".layers.layers.mlp.wo.weight": layer("mlp.down_proj.weight"),
        ".final_norm.weight": single("model.norm.weight"),
    }
    if not config.tie_embeddings:
        maps[".head.weight"] = single("lm_head.weight", transposed=True)
    return maps


def ignored(config: Qwen3Config, hf: Mapping[str, Any]) -> Callable[[str], bool]:
    """RoPE frequencies some checkpoints save, and the head a tied checkpoint may still hold."""
    return lambda name: name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")


def mtp_layers(names: set[str], hf: Mapping[str, Any]) -> int:
    """Qwen3 checkpoints hold no multi-token-prediction layers."""
    return 0
