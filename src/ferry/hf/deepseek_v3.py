"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM`, in the layout DeepSeek published.

Layers 0 .. first_k_dense_replace - 1 are dense, the rest MoE (`mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_experts`);
MTP depth k is layer num_hidden_layers + k - 1 (`enorm`, `hnorm`, `eh_proj`, a MoE block,
`shared_head.norm`, and copies of the embedding and the head). MLA's rotary dimensions are
interleaved pairs in both (`rope_interleave`), so the weights map one-to-one, Linear weights
transposed from [out, in] to [in, out].
"""

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from ferry.hf.config_json import copied_from_hf, copied_to_hf, refuse_unless, required, rope_settings
from ferry.hf.layout import TensorMap, single, stacked
from ferry.hf.safetensors_io import CheckpointError
from ferry.models.deepseek_v3.config import DeepSeekV3Config
from ferry.nn.rope import YarnScaling, yarn_mscale

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
FAMILY = "DeepSeek-V3"

CONFIG_KEYS: Mapping[str, str] = {  # ferry field -> the config.json key it comes from
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_dense_layers": "first_k_dense_replace",
    "dense_mlp_dim": "intermediate_size",
    "moe_mlp_dim": "moe_intermediate_size",
    "num_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_dim": "qk_nope_head_dim",
    "qk_rope_dim": "qk_rope_head_dim",
    "v_dim": "v_head_dim",
    "num_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts",
    "experts_per_token": "num_experts_per_tok",
    "num_groups": "n_group",
    "groups_per_token": "topk_group",
    "routed_scaling": "routed_scaling_factor",
    "mtp_depth": "MTP layers in the checkpoint",
    "rope_theta": "rope_theta",
    "yarn": "rope_scaling",
    "norm_eps": "rms_norm_eps",
}
# fields config.json holds as they are, both ways
COPIED = (
    "vocab_size",
    "dim",
    "num_layers",
    "num_dense_layers",
    "dense_mlp_dim",
    "moe_mlp_dim",
    "num_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_dim",
    "qk_rope_dim",
    "v_dim",
    "num_experts",
    "num_shared_experts",
    "experts_per_token",
    "num_groups",
    "groups_per_token",
)


def yarn_from_hf(rope: Mapping[str, Any] | None, max_position_embeddings: int) -> YarnScaling:
    """ferry's YaRN for Hugging Face's RoPE settings, reproducing both of its factors: the one on
    cos and sin (`attention_factor`; when absent, mscale(f, mscale) / mscale(f, mscale_all_dim)
    if both are set, else mscale(f, 1)) and the one on the softmax (mscale(f, mscale_all_dim)^2).
    ferry applies mscale(f, mscale) / mscale(f, mscale_all_dim) and the same softmax factor, so
    `mscale` is chosen to give Hugging Face's cos/sin factor. Plain RoPE is YaRN with factor 1."""
    if rope is None:
        return YarnScaling(factor=1.0)
    if rope["rope_type"] != "yarn":
        raise CheckpointError(
            f"config.json has RoPE scaling {rope['rope_type']!r}; ferry's DeepSeek-V3 implements yarn or none"
        )
    if not rope.get("truncate", True):
        raise CheckpointError("config.json has yarn truncate=false; ferry rounds YaRN's correction range as DeepSeek")
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    factor = float(rope.get("factor") or max_position_embeddings / original)
    mscale, all_dim, attention_factor = rope.get("mscale"), rope.get("mscale_all_dim"), rope.get("attention_factor")
    all_dim = float(all_dim or 0.0)
    if attention_factor is None and mscale and all_dim:
        ferry_mscale = float(mscale)
    else:
        target = attention_factor if attention_factor is not None else yarn_mscale(factor, 1.0)
        if factor <= 1:
            if not math.isclose(target, 1.0):
                raise CheckpointError(f"config.json has yarn attention_factor {target} with factor {factor} <= 1")
            ferry_mscale = 1.0
        else:  # mscale(f, m) = 0.1 m ln f + 1 = target x mscale(f, mscale_all_dim)
            ferry_mscale = (target * yarn_mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor))
    return YarnScaling(
        factor=factor,
        original_max_position=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=ferry_mscale,
        mscale_all_dim=all_dim,
    )


def yarn_to_hf(yarn: YarnScaling) -> dict[str, Any]:
    """Hugging Face's yarn settings for ferry's, with `attention_factor` written only where
    Hugging Face would infer another cos/sin factor from mscale and mscale_all_dim."""
    ferry_factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    settings = {
        "rope_type": "yarn",
        "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "mscale": yarn.mscale,
        "mscale_all_dim": yarn.mscale_all_dim,
    }
    if not (yarn.mscale and yarn.mscale_all_dim) and not math.isclose(ferry_factor, yarn_mscale(yarn.factor, 1.0)):
        settings["attention_factor"] = ferry_factor
    return settings


def config_from_hf(hf: Mapping[str, Any], mtp_layers: int = 0) -> DeepSeekV3Config:
    """ferry's config for a config.json and the MTP layers the checkpoint holds; features ferry's
    DeepSeek-V3 lacks are refused."""
    for key, supported in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("rope_interleave", True),  # rotary dims as interleaved pairs, as DeepSeek's weights are
        ("norm_topk_prob", True),  # the top-k weights normalised to sum 1
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),  # group-limited top-k on bias-corrected scores
        ("moe_layer_freq", 1),  # every layer after the dense ones is MoE
    ):
        refuse_unless(hf, key, supported, supported, FAMILY)
    heads = required(hf, "num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise CheckpointError(
            f"config.json has num_key_value_heads {hf['num_key_value_heads']} != num_attention_heads {heads}; "
            "MLA gives every head its own key and value"
        )
    if hf.get("q_lora_rank") is None:
        raise CheckpointError("config.json has q_lora_rank null (a full-rank q_proj); ferry's MLA needs a query LoRA")
    theta, rope = rope_settings(hf, default_theta=10000.0)
    return DeepSeekV3Config(
        **copied_from_hf(hf, CONFIG_KEYS, COPIED),
        routed_scaling=float(required(hf, "routed_scaling_factor")),
        mtp_depth=mtp_layers,
        rope_theta=theta,
        yarn=yarn_from_hf(rope, required(hf, "max_position_embeddings")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def config_to_hf(config: DeepSeekV3Config) -> dict[str, Any]:
    """The architecture keys of config.json for `config`, in the published checkpoint's spelling."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **copied_to_hf(config, CONFIG_KEYS, COPIED),
        "moe_layer_freq": 1,
        "num_key_value_heads": config.num_heads,
        "routed_scaling_factor": config.routed_scaling,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": config.mtp_depth,
        "hidden_act": "silu",
        "max_position_embeddings": int(config.yarn.original_max_position * max(config.yarn.factor, 1.0)),
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": yarn_to_hf(config.yarn),
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


Maker = Callable[[str, bool], TensorMap]


def _block(path: str, layer: Maker) -> dict[str, TensorMap]:
    """MLA and the two norms of a decoder layer; `layer(suffix, transposed)` names its tensors."""
    return {
        f"{path}.attention_norm.weight": layer("input_layernorm.weight", False),
        f"{path}.attention.q_a.weight": layer("self_attn.q_a_proj.weight", True),
        f"{path}.attention.q_a_norm.weight": layer("self_attn.q_a_layernorm.weight", False),
        f"{path}.attention.q_b.weight": layer("self_attn.q_b_proj.weight", True),
        f"{path}.attention.kv_a.weight": layer("self_attn.kv_a_proj_with_mqa.weight", True),
        f"{path}.attention.kv_a_norm.weight": layer("self_attn.kv_a_layernorm.weight", False),
        f"{path}.attention.kv_b.weight": layer("self_attn.kv_b_proj.weight", True),
        f"{path}.attention.out.weight": layer("self_attn.o_proj.weight", True),
        f"{path}.mlp_norm.weight": layer("post_attention_layernorm.weight", False),
    }


def _swiglu(path: str, layer: Maker, prefix: str) -> dict[str, TensorMap]:
    return {
        f"{path}.wi_0.weight": layer(f"{prefix}.gate_proj.weight", True),
        f"{path}.wi_1.weight": layer(f"{prefix}.up_proj.weight", True),
        f"{path}.wo.weight": layer(f"{prefix}.down_proj.weight", True),
    }


def _moe(path: str, layer: Maker, expert: Callable[[str], TensorMap]) -> dict[str, TensorMap]:
    return {
        f"{path}.router": layer("mlp.gate.weight", True),
        f"{path}.correction_bias": layer("mlp.gate.e_score_correction_bias", False),
        f"{path}.experts.gate": expert("gate_proj.weight"),
        f"{path}.experts.up": expert("up_proj.weight"),
        f"{path}.experts.down": expert("down_proj.weight"),
        **_swiglu(f"{path}.shared", layer, "mlp.shared_experts"),
    }


def tensor_maps(config: DeepSeekV3Config, hf: Mapping[str, Any]) -> dict[str, TensorMap]:
    """Every ferry parameter path -> its tensors."""
    if hf.get("tie_word_embeddings", False):
        raise CheckpointError("config.json has tie_word_embeddings=true; DeepSeek-V3's head is its own")
    dense, experts = config.num_dense_layers, config.num_experts

    def layers(first: int, count: int) -> tuple[Maker, Callable[[str], TensorMap]]:
        def layer(suffix: str, transposed: bool) -> TensorMap:
            return stacked(lambda i: f"model.layers.{first + i}.{suffix}", count, transposed=transposed)

        def expert(suffix: str) -> TensorMap:
            name = lambda i, e: f"model.layers.{first + i}.mlp.experts.{e}.{suffix}"
            return stacked(name, count, experts, transposed=True)

        return layer, expert

    maps = {".embed.weight": single("model.embed_tokens.weight", aliases=_mtp_names(config, "embed_tokens.weight"))}
    if dense:
        layer, _ = layers(0, dense)
        maps |= _block(".dense_layers.layers", layer) | _swiglu(".dense_layers.layers.mlp", layer, "mlp")
    if config.num_layers > dense:
        layer, expert = layers(dense, config.num_layers - dense)
        maps |= _block(".moe_layers.layers", layer) | _moe(".moe_layers.layers.mlp", layer, expert)
    maps[".final_norm.weight"] = single("model.norm.weight")
    maps[".head.weight"] = single("lm_head.weight", True, aliases=_mtp_names(config, "shared_head.head.weight"))
    for depth in range(config.mtp_depth):
        index = config.num_layers + depth
        path = f".mtp[{depth}]"

        def layer(suffix: str, transposed: bool, index: int = index) -> TensorMap:
            return single(f"model.layers.{index}.{suffix}", transposed)

        def expert(suffix: str, index: int = index) -> TensorMap:
            return stacked(lambda e: f"model.layers.{index}.mlp.experts.{e}.{suffix}", experts, transposed=True)

        maps |= {
            f"{path}.embedding_norm.weight": layer("enorm.weight", False),
            f"{path}.hidden_norm.weight": layer("hnorm.weight", False),
            f"{path}.projection.weight": layer("eh_proj.weight", True),
            f"{path}.final_norm.weight": layer("shared_head.norm.weight", False),
            **_block(f"{path}.block", layer),
            **_moe(f"{path}.block.mlp", layer, expert),
        }
    return maps


def _mtp_names(config: DeepSeekV3Config, suffix: str) -> tuple[str, ...]:
    return tuple(f"model.layers.{config.num_layers + depth}.{suffix}" for depth in range(config.mtp_depth))


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def mtp_layers(names: set[str], hf: Mapping[str, Any]) -> int:
    """How many MTP layers a checkpoint holds: layers num_hidden_layers, num_hidden_layers + 1, ...
    (save_pretrained of `DeepseekV3ForCausalLM` writes none; DeepSeek's published weights hold one)."""
    num_layers = hf.get("num_hidden_layers", 0)
    present = {index for name in names if (index := layer_index(name)) is not None and index >= num_layers}
    count = 0
    while num_layers + count in present:
        count += 1
    return count


def ignored(config: DeepSeekV3Config, hf: Mapping[str, Any]) -> Callable[[str], bool]:
    """RoPE frequencies some checkpoints save, and the MTP layers past the depth being loaded."""

    def skip(name: str) -> bool:
        index = layer_index(name)
        return name.endswith("rotary_emb.inv_freq") or (
            index is not None and index >= config.num_layers + config.mtp_depth
        )

    return skip
