"""The small real models a single chip trains in full (issue 62): `llama3_2_1b`, `llama3_2_3b`,
`qwen3_0_6b`, `qwen3_1_7b` and `qwen3_4b`, exactly as published. Each preset's parameter count is
the published one; each published config.json describes the preset; and a tiny model with the
same architecture (Llama 3.2's tied head and RoPE scaling of factor 32, Qwen3's tied head and
q/k norms) computes the logits `transformers` computes, and exports what it loads back."""

import dataclasses

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity tests need torch: bash setup.sh hf")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers: bash setup.sh hf")

from ferry.hf import llama as hf_llama  # noqa: E402
from ferry.hf import load_pretrained  # noqa: E402
from ferry.hf import qwen3 as hf_qwen3  # noqa: E402
from ferry.hf.config_json import check_matches  # noqa: E402
from ferry.models.registry import parameter_count  # noqa: E402
from tests.conftest import load_model_config  # noqa: E402
from tests.models.hf_round_trip import check_export_round_trip  # noqa: E402
from tests.models.test_hf import randomise  # noqa: E402

ATOL = 1e-4  # logits

PUBLISHED_COUNTS = {  # the models' cards; Llama 3.2 and Qwen3's small models count their tied head once
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
    "qwen3_0_6b": 596_049_920,
    "qwen3_1_7b": 1_720_574_976,
    "qwen3_4b": 4_022_468_096,
}

LLAMA_3_2_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# The architecture keys of the published config.json files (transformers v4 spelling)
PUBLISHED = {
    "llama3_2_1b": (2048, 8192, 32, 16, 8, 64),
    "llama3_2_3b": (3072, 8192, 24, 28, 8, 128),
    "qwen3_0_6b": (1024, 3072, 16, 28, 8, 128),
    "qwen3_1_7b": (2048, 6144, 16, 28, 8, 128),
    "qwen3_4b": (2560, 9728, 32, 36, 8, 128),
}


def published_config(name: str) -> dict:
    hidden, intermediate, heads, layers, kv_heads, head_dim = PUBLISHED[name]
    llama = name.startswith("llama")
    return {
        "model_type": "llama" if llama else "qwen3",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5 if llama else 1e-6,
        "rope_theta": 500000.0 if llama else 1000000.0,
        "rope_scaling": LLAMA_3_2_ROPE if llama else None,
        "tie_word_embeddings": True,
        "vocab_size": 128256 if llama else 151936,
        "attention_bias": False,
    }


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_each_preset_has_its_published_parameter_count(name):
    config = load_model_config(name)
    assert config.tied_head()
    assert parameter_count(config) == PUBLISHED_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_published_config_json_is_the_preset(name):
    mapping = hf_llama if name.startswith("llama") else hf_qwen3
    wanted = load_model_config(name)
    check_matches(wanted, mapping.config_from_hf(published_config(name)), mapping.CONFIG_KEYS, "published config.json")
    assert mapping.config_from_hf(published_config(name)) == wanted.for_platform("cpu")
    assert mapping.config_to_hf(wanted)["tie_word_embeddings"] is True


def tiny_hf_model(name: str) -> torch.nn.Module:
    """A tiny random `transformers` model with the preset's architecture: its tied head, its RoPE
    (Llama 3.2's scaling of factor 32, over an original context of 16 so that a 24-token batch
    spans its scaled, interpolated and kept bands), its norms; weights ~ N(0, 0.1), norms ~ N(1, 0.1)."""
    tiny = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "attn_implementation": "eager",
        "dtype": "float32",
    }
    if name.startswith("llama"):
        rope = {**LLAMA_3_2_ROPE, "original_max_position_embeddings": 16, "rope_theta": 500000.0}
        config = transformers.LlamaConfig(**tiny, rms_norm_eps=1e-5, rope_parameters=rope)
        model = transformers.LlamaForCausalLM(config)
    else:
        rope = {"rope_type": "default", "rope_theta": 1000000.0}
        config = transformers.Qwen3Config(**tiny, rms_norm_eps=1e-6, rope_parameters=rope)
        model = transformers.Qwen3ForCausalLM(config)
    randomise(model, seed=5)
    return model.eval()


@pytest.mark.parametrize("family", ["llama3_2", "qwen3_small"])
def test_a_tiny_model_of_the_presets_architecture_matches_transformers(family, tmp_path):
    """Import: the same logits, a tied model (no head of its own); export: every array back bit for
    bit, a tied config.json, and `transformers` computes the same logits from it."""
    model = tiny_hf_model("llama3_2_1b" if family == "llama3_2" else "qwen3_0_6b")
    model.save_pretrained(tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int64)
    with torch.no_grad():
        reference = model(torch.tensor(tokens)).logits.numpy()
    ferry_model = load_pretrained(tmp_path / "hf")
    assert ferry_model.config.tied_head() and ferry_model.head is None
    if family == "llama3_2":
        assert ferry_model.config.rope_scaling.factor == 32.0
    logits = eqx.filter_jit(lambda m, t: m(t))(ferry_model, jnp.asarray(tokens, jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), reference, rtol=0, atol=ATOL)

    check_export_round_trip(ferry_model, type(model), tmp_path / "export", tokens, reference, True, ATOL)


def test_an_untied_llama_may_still_read_a_tied_checkpoint(tmp_path):
    """A Llama config with its own head (`tie_embeddings: false`) reads a tied checkpoint's
    embedding into that head, as before Llama learned to tie: the same logits."""
    model = tiny_hf_model("llama3_2_1b")
    model.save_pretrained(tmp_path / "hf")
    tied = load_pretrained(tmp_path / "hf")
    untied = load_pretrained(tmp_path / "hf", dataclasses.replace(tied.config, tie_embeddings=False))
    assert untied.head is not None
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 16)), jnp.int32)
    forward = eqx.filter_jit(lambda m, t: m(t))
    np.testing.assert_allclose(np.asarray(forward(untied, tokens)), np.asarray(forward(tied, tokens)), atol=1e-6)
