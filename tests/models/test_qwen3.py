"""Qwen3 (dense), the third family: logits equal Hugging Face's `Qwen3ForCausalLM` (eager,
float32) with the head tied and untied; export and re-import round-trip bit for bit and load in
`transformers`; every offload preset's gradients equal save_all's; the published Qwen3-8B config is
configs/model/qwen3_8b.yaml; the launcher trains qwen3_tiny."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity tests need torch: bash setup.sh hf")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers: bash setup.sh hf")

from transformers import Qwen3Config as HFQwen3Config  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

from ferry.hf import CheckpointError, load_pretrained  # noqa: E402
from ferry.hf import qwen3 as qwen3_hf  # noqa: E402
from ferry.hf.config_json import check_matches  # noqa: E402
from ferry.models.dense import DenseDecoder  # noqa: E402
from ferry.models.registry import abstract_model, parameter_count  # noqa: E402
from ferry.offload.engine import PolicyError  # noqa: E402
from ferry.train.step import LossSettings, batch_loss  # noqa: E402
from ferry.train.step_flops import training_flops  # noqa: E402
from tests.conftest import MOE_ONLY_PRESETS, PRESETS, load_model_config, preset_policy, run_launcher  # noqa: E402
from tests.models.hf_round_trip import check_export_round_trip  # noqa: E402
from tests.models.test_hf import randomise  # noqa: E402

ATOL = 1e-4  # logits

# qwen3_tiny's architecture; heads of 32 (not dim / num_heads = 16) as Qwen3 sets head_dim apart
QWEN3 = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}


@pytest.fixture(scope="module")
def batch():
    return np.random.default_rng(0).integers(0, 256, (2, 25)).astype(np.int64)


def hf_qwen3(directory, batch, tied: bool):
    """Save a tiny random Qwen3ForCausalLM (norms ~ N(1, 0.1), every other weight ~ N(0, 0.1), so
    a misplaced q_norm or k_norm shows); returns its logits on batch[:, :-1]."""
    config = HFQwen3Config(**QWEN3, tie_word_embeddings=tied, attn_implementation="eager", dtype="float32")
    model = Qwen3ForCausalLM(config).eval()
    randomise(model, seed=4)
    model.save_pretrained(directory)
    with torch.no_grad():
        return model(torch.tensor(batch[:, :-1])).logits.numpy()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers_and_export_round_trips(tied, tmp_path, batch):
    """Import: the same logits; export: every array back bit for bit, and `transformers` loads the
    export (tied or not, as the config says) and computes the same logits."""
    reference = hf_qwen3(tmp_path / "hf", batch, tied)
    model = load_pretrained(tmp_path / "hf")
    assert model.config.tie_embeddings is tied and (model.head is None) is tied
    assert model.config.head_dim == 32 and model.config.rope_theta == 1e6
    logits = eqx.filter_jit(lambda m, t: m(t))(model, jnp.asarray(batch[:, :-1], jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), reference, rtol=0, atol=ATOL)

    check_export_round_trip(model, Qwen3ForCausalLM, tmp_path / "export", batch[:, :-1], reference, tied, ATOL)


def test_checkpoints_ferrys_qwen3_cannot_represent_are_refused(tmp_path, batch):
    hf_qwen3(tmp_path / "hf", batch, tied=False)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key, value, message in [
        ("use_sliding_window", True, "use_sliding_window=True; ferry's Qwen3 implements only"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "RoPE scaling 'yarn'"),
    ]:
        (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config | {key: value}))
        with pytest.raises(CheckpointError, match=message):
            load_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    tied = load_model_config("qwen3_tiny")  # qwen3_tiny ties its head; this checkpoint does not
    with pytest.raises(CheckpointError, match=r"model.tie_embeddings is True but .* has False \(tie_word_embeddings\)"):
        load_pretrained(tmp_path / "hf", config=tied)


# The architecture keys of Qwen/Qwen3-8B's published config.json.
PUBLISHED_QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_published_qwen3_8b_is_configs_qwen3_8b():
    """config.json -> ferry equals configs/model/qwen3_8b.yaml, ferry -> config.json writes the
    published values back; 8,190,735,360 parameters (36 x 192,946,432 per layer, the embedding and
    the untied head of 151936 x 4096 each, the final norm)."""
    wanted = load_model_config("qwen3_8b")
    check_matches(wanted, qwen3_hf.config_from_hf(PUBLISHED_QWEN3_8B), qwen3_hf.CONFIG_KEYS, "published config.json")
    exported = qwen3_hf.config_to_hf(wanted)
    for key, value in PUBLISHED_QWEN3_8B.items():
        if key in exported:
            assert exported[key] == value, key
    assert parameter_count(wanted) == 8_190_735_360
    # 6 x tokens x the weights a token passes through (every matrix but the embedding) + attention
    flops = training_flops(wanted, 1, 4096)
    matrices = 8_190_735_360 - 151936 * 4096 - 36 * (2 * 4096 + 2 * 128) - 4096
    assert flops.weights == 6 * 4096 * matrices


@pytest.fixture(scope="module")
def tiny():
    config = load_model_config("qwen3_tiny", num_layers=3)
    model = DenseDecoder(config, key=jax.random.key(0))
    return model, jax.random.randint(jax.random.key(1), (2, 33), 0, config.vocab_size)


def loss_grad(model, batch, preset: str):
    settings = LossSettings(preset_policy(preset, model), "float32")
    return eqx.filter_grad(lambda m: batch_loss(m, batch, settings)[0])(model)


jitted_loss_grad = eqx.filter_jit(loss_grad)


def test_qwen3_tags_llamas_tensor_names(tiny):
    """The same names as Llama, so every Llama preset applies; MoE's are refused."""
    model, batch = tiny
    llama = abstract_model(load_model_config("llama_tiny"))
    assert isinstance(llama, DenseDecoder) and model.tagged_names() == llama.tagged_names()
    with pytest.raises(PolicyError, match=r"moe_mlpwi_0.*never tags"):
        loss_grad(model, batch, "moe_offload")


# This test's programs died inside XLA's CPU compile (aborts, and segmentation faults in the
# compilation cache's write) in five whole-suite runs on 2026-12-08, under two presets, always in an
# xdist worker that had run other tests (the Hugging Face parity tests with the CPU build of torch
# among them); alone, in its module and in tests/models it compiles and passes. Out of the default
# run until that is found: tests/engine/test_presets.py covers the dense decoder's gradients under
# every preset, in a loop and unscanned.
@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in MOE_ONLY_PRESETS])
def test_gradients_of_every_preset_equal_save_all(tiny, preset):
    model, batch = tiny
    expected = jitted_loss_grad(model, batch, "save_all")
    got = jitted_loss_grad(model, batch, preset)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_launcher_trains_qwen3_tiny_on_an_fsdp_mesh(tmp_path):
    """`launch/run.py model=qwen3_tiny` on 2 devices (FSDP), the tied embedding sharded by its
    declared axes: the loss falls over a few steps."""
    result = run_launcher(
        "model=qwen3_tiny",
        "platform.cpu_devices=2",
        "mesh.fsdp=2",
        "offload=minimal_offloaded",
        "train.steps=6",
        "train.warmup_steps=1",
        "train.log_every=1",
        "train.eval_batches=0",
        "train.global_batch_size=4",
        "train.seq_len=32",
        f"run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr + result.stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
