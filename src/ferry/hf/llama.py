"""Llama 3.1 <-> Hugging Face `LlamaForCausalLM`.

Hugging Face's Llama checkpoints permute the rows of q_proj and k_proj so that rotate-half RoPE
(pairs (x[i], x[i + head_dim/2])) gives Meta's interleaved rotation; ferry's Llama uses the
same rotate-half convention (`ferry.nn.rope.apply_rope`), so the weights map one-to-one, only
transposed from [out, in] to [in, out]."""

from collections.abc import Callable, Mapping
from typing import Any

from ferry.hf.config_json import copied_from_hf, copied_to_hf, refuse_unless, required, rope_settings
from ferry.hf.layout import TensorMap, single, stacked
from ferry.hf.safetensors_io import CheckpointError
from ferry.models.llama.config import LlamaConfig
from ferry.nn.rope import Llama3RopeScaling

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
FAMILY = "Llama"

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
    "rope_scaling": "rope_scaling",
    "norm_eps": "rms_norm_eps",
}
COPIED = ("vocab_size", "dim", "num_layers", "num_heads", "mlp_dim")  # as config.json holds them, both ways


def config_from_hf(hf: Mapping[str, Any], mtp_layers: int = 0) -> LlamaConfig:
    """ferry's config for a config.json; features ferry's Llama lacks are refused."""
    for key, supported in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        refuse_unless(hf, key, supported, supported, FAMILY)
    heads = required(hf, "num_attention_heads")
    theta, rope = rope_settings(hf, default_theta=10000.0)
    scaling = None
    if rope is not None:
        if rope["rope_type"] != "llama3":
            raise CheckpointError(
                f"config.json has RoPE scaling {rope['rope_type']!r}; ferry's Llama implements llama3 scaling or none"
            )
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]),
        )
    return LlamaConfig(
        **copied_from_hf(hf, CONFIG_KEYS, COPIED),
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_to_hf(config: LlamaConfig) -> dict[str, Any]:
    """The architecture keys of config.json for `config` (legacy RoPE keys, read by v4 and v5)."""
    scaling = config.rope_scaling
    rope_scaling = (
        None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position,
        }
    )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **copied_to_hf(config, CONFIG_KEYS, COPIED),
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 8192 if scaling is None else int(scaling.original_max_position * scaling.factor),
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_embeddings,
    }


def tensor_maps(config: LlamaConfig, hf: Mapping[str, Any]) -> dict[str, TensorMap]:
    """Every ferry parameter path -> its tensors. A tied model (Llama 3.2's small models) has no
    head of its own; an untied one built from a tied checkpoint reads the embedding into its head."""

    def layer(suffix: str, transposed: bool = True) -> TensorMap:
        return stacked(lambda i: f"model.layers.{i}.{suffix}", config.num_layers, transposed=transposed)

    tied = hf.get("tie_word_embeddings", False)
    maps = {
        ".embed.weight": single("model.embed_tokens.weight"),
        ".layers.layers.attention_norm.weight": layer("input_layernorm.weight", transposed=False),
        ".layers.layers.attention.query.weight": layer("self_attn.q_proj.weight"),
        ".layers.layers.attention.key.weight": layer("self_attn.k_proj.weight"),
        ".layers.layers.attention.value.weight": layer("self_attn.v_proj.weight"),
        ".layers.layers.attention.out.weight": layer("self_attn.o_proj.weight"),
        ".layers.layers.mlp_norm.weight": layer("post_attention_layernorm.weight", transposed=False),
        ".layers.layers.mlp.wi_0.weight": layer("mlp.gate_proj.weight"),
        ".layers.layers.mlp.wi_1.weight": layer("mlp.up_proj.weight"),
        ".layers.layers.mlp.wo.weight": layer("mlp.down_proj.weight"),
        ".final_norm.weight": single("model.norm.weight"),
    }
    if not config.tie_embeddings:
        maps[".head.weight"] = single("model.embed_tokens.weight" if tied else "lm_head.weight", transposed=True)
    return maps


def ignored(config: LlamaConfig, hf: Mapping[str, Any]) -> Callable[[str], bool]:
    """Checkpoint tensors that are no parameters: old checkpoints saved RoPE's frequencies, and
    a tied checkpoint may still hold the head it does not use."""
    tied = hf.get("tie_word_embeddings", False)
    return lambda name: name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def mtp_layers(names: set[str], hf: Mapping[str, Any]) -> int:
    """Llama checkpoints hold no multi-token-prediction layers."""
    return 0
