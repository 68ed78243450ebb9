"""Hugging Face interop against `transformers` itself: tiny random `LlamaForCausalLM` and
`DeepseekV3ForCausalLM` (eager attention, float32) saved, imported into ferry and compared
(logits, the experts the router picks, the MTP layer's loss); ferry's export loaded back by ferry
and by `transformers`; FP8 block-quantised weights; training from imported weights."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity tests need torch: bash setup.sh hf")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers: bash setup.sh hf")

import ml_dtypes  # noqa: E402
from rich.console import Console  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_layers import MtpModel  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention  # noqa: E402

from ferry.data.corpus import load_corpus  # noqa: E402
from ferry.data.pipeline import PackedWindows, window_batches  # noqa: E402
from ferry.data.tokenizer import load_tokenizer  # noqa: E402
from ferry.hf import CheckpointError, check_checkpoint, load_pretrained, save_pretrained  # noqa: E402
from ferry.hf import deepseek_v3 as hf_deepseek_v3  # noqa: E402
from ferry.hf import llama as hf_llama_family  # noqa: E402
from ferry.hf.config_json import check_matches  # noqa: E402
from ferry.hf.layout import read_block  # noqa: E402
from ferry.nn.moe import route  # noqa: E402
from ferry.nn.rope import yarn_frequencies, yarn_mscale  # noqa: E402
from ferry.offload.engine import SAVE_ALL  # noqa: E402
from ferry.run.preflight import prepare  # noqa: E402
from tests.conftest import compose_config, load_model_config, run_launcher  # noqa: E402

ATOL = 1e-4  # logits
LOSS_ATOL = 1e-5

# llama_tiny's architecture, except RoPE's original context: 64 puts Llama 3's scaled,
# interpolated and kept frequency bands all within a 24-token test sequence
LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
# deepseek_v3_tiny's architecture with DeepSeek-V3's YaRN, but mscale_all_dim 0.8 so that both of
# YaRN's factors (on cos/sin and on the softmax) differ from 1
DEEPSEEK = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
}
MTP_LAYER = DEEPSEEK["num_hidden_layers"]


class TinyDeepseekV3(DeepseekV3ForCausalLM):
    """`DeepseekV3ForCausalLM`, told that the tiny model's MTP layer is layer 3 (it names
    DeepSeek-V3's layer 61), so that `MtpModel.from_pretrained` finds it."""

    _keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{MTP_LAYER}\..*"]


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every weight ~ N(0, 0.1), norms ~ N(1, 0.1) and DeepSeek's router biases ~ N(0, 0.05)
    (Hugging Face initialises norms to 1 and biases to 0, which would hide a misplaced one)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=generator))


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    mean = 1.0 if "norm" in name else 0.0
    scale = 0.05 if "correction_bias" in name else 0.1
    return (mean + scale * rng.standard_normal(shape)).astype(np.float32)


def add_mtp_layer(directory, seed: int) -> None:
    """Give a saved DeepseekV3ForCausalLM the MTP layer in DeepSeek's published layout: layer
    `num_hidden_layers` holds `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, copies of the
    embedding (`embed_tokens`) and the head (`shared_head.head`), and a MoE decoder layer named as
    the checkpoint names MoE layer 1; in a second file, with the index naming both."""
    main = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    rng = np.random.default_rng(seed)
    prefix = f"model.layers.{MTP_LAYER}."
    dim = DEEPSEEK["hidden_size"]
    mtp = {
        prefix + "embed_tokens.weight": main["model.embed_tokens.weight"],
        prefix + "shared_head.head.weight": main["lm_head.weight"],
        prefix + "enorm.weight": random_tensor(rng, "norm", (dim,)),
        prefix + "hnorm.weight": random_tensor(rng, "norm", (dim,)),
        prefix + "shared_head.norm.weight": random_tensor(rng, "norm", (dim,)),
        prefix + "eh_proj.weight": random_tensor(rng, "proj", (dim, 2 * dim)),
    }
    for name, tensor in main.items():
        if name.startswith("model.layers.1."):
            mtp_name = prefix + name.removeprefix("model.layers.1.")
            mtp[mtp_name] = random_tensor(rng, mtp_name, tensor.shape)
    save_file(mtp, str(directory / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {name: "model-00001-of-00002.safetensors" for name in main}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in mtp}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def hf_mtp_loss(main: DeepseekV3ForCausalLM, batch: np.ndarray) -> float:
    """Hugging Face's MTP depth 1 (`MtpModel`, loaded from the main model's checkpoint): predict
    token t + 2 from the main model's last hidden state at t and the embedding of token t + 1."""
    mtp = MtpModel.from_pretrained(main).eval()
    seq = batch.shape[1] - 1
    with torch.no_grad():
        last = main(torch.tensor(batch[:, :seq]), output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(seq - 1)[None]
        h = mtp.forward_layer(0, last[:, : seq - 1], positions, None, input_ids=torch.tensor(batch[:, 1:seq]))
        logits = mtp._project_to_logits(h)
        targets = torch.tensor(batch[:, 2:]).reshape(-1)
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets))


def hf_loss(logits: np.ndarray, targets: np.ndarray) -> float:
    log_probs = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)
    return float(-log_probs.gather(-1, torch.tensor(targets, dtype=torch.long)[..., None]).mean())


@pytest.fixture(scope="module")
def batch():
    """[2, 25] tokens: a model reads the first 24; MTP predicts up to the 25th."""
    return np.random.default_rng(0).integers(0, 256, (2, 25)).astype(np.int64)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory, batch):
    """A saved tiny random Llama: (directory, its logits on batch[:, :-1])."""
    config = LlamaConfig(**LLAMA, attn_implementation="eager", dtype="float32")
    model = LlamaForCausalLM(config).eval()
    randomise(model, seed=1)
    directory = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(directory)
    with torch.no_grad():
        logits = model(torch.tensor(batch[:, :-1])).logits.numpy()
    return directory, logits


@pytest.fixture(scope="module")
def hf_deepseek(tmp_path_factory, batch):
    """A saved tiny random DeepSeek-V3 with an MTP layer: (directory, logits on batch[:, :-1],
    each MoE layer's router input and chosen experts, the MTP layer's loss on batch)."""
    config = DeepseekV3Config(**DEEPSEEK, attn_implementation="eager", dtype="float32")
    model = DeepseekV3ForCausalLM(config)
    randomise(model, seed=2)
    directory = tmp_path_factory.mktemp("hf_deepseek")
    model.save_pretrained(directory)
    add_mtp_layer(directory, seed=3)
    model = TinyDeepseekV3.from_pretrained(directory, attn_implementation="eager").eval()  # MtpModel reads its path

    routed = []
    gates = [layer.mlp.gate for layer in model.model.layers[DEEPSEEK["first_k_dense_replace"] :]]
    hooks = [g.register_forward_hook(lambda m, args, out: routed.append((args[0], out[2]))) for g in gates]
    with torch.no_grad():
        logits = model(torch.tensor(batch[:, :-1])).logits.numpy()
    for hook in hooks:
        hook.remove()
    router = [(x.reshape(-1, x.shape[-1]).numpy(), experts.numpy()) for x, experts in routed]
    return directory, logits, router, hf_mtp_loss(model, batch)


@pytest.fixture(scope="module")
def ferry_llama(hf_llama):
    return load_pretrained(hf_llama[0])


@pytest.fixture(scope="module")
def ferry_deepseek(hf_deepseek):
    return load_pretrained(hf_deepseek[0])


forward = eqx.filter_jit(lambda model, tokens: model(tokens))
# the logits of batch[:, :-1] and the training statistics on batch, compiled together (XLA shares the forward pass)
logits_and_metrics = eqx.filter_jit(
    lambda model, batch: (model(batch[:, :-1]), model.training_loss(batch, SAVE_ALL)[1])
)


def test_llama_logits_match_transformers(hf_llama, ferry_llama, batch):
    _, reference = hf_llama
    assert ferry_llama.config.rope_scaling.original_max_position == 64
    logits = forward(ferry_llama, jnp.asarray(batch[:, :-1], jnp.int32))
    assert logits.shape == (2, 24, 256)
    np.testing.assert_allclose(np.asarray(logits), reference, rtol=0, atol=ATOL)


def test_deepseek_v3_logits_routing_and_mtp_match_transformers(hf_deepseek, ferry_deepseek, batch):
    """Logits; the experts ferry's router picks for Hugging Face's router inputs, and the load
    per expert of ferry's own forward pass; the main and MTP cross-entropies."""
    _, reference, router, mtp_loss = hf_deepseek
    model = ferry_deepseek
    assert model.config.mtp_depth == 1 and model.config.yarn.mscale_all_dim == 0.8
    logits, metrics = logits_and_metrics(model, jnp.asarray(batch, jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), reference, rtol=0, atol=ATOL)

    config = model.config
    select = jax.jit(
        lambda x, router_weight, bias: route(
            jax.nn.sigmoid(x @ router_weight),
            bias,
            config.num_groups,
            config.groups_per_token,
            config.experts_per_token,
            config.routed_scaling,
        )[0]
    )
    for layer, (x, hf_experts) in enumerate(router):
        moe = model.moe_layers.layer(layer).mlp
        experts = np.asarray(select(jnp.asarray(x), moe.router, moe.correction_bias))
        np.testing.assert_array_equal(np.sort(experts, axis=-1), np.sort(hf_experts, axis=-1))
        hf_load = np.bincount(hf_experts.reshape(-1), minlength=config.num_experts)
        np.testing.assert_array_equal(np.asarray(metrics["moe_expert_load"][layer]), hf_load)

    assert float(metrics["loss"]) == pytest.approx(hf_loss(reference, batch[:, 1:]), abs=LOSS_ATOL)
    assert float(metrics["mtp_loss"]) == pytest.approx(mtp_loss, abs=LOSS_ATOL)


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_export_reimports_identically_and_transformers_loads_it(family, request, tmp_path, batch):
    """save_pretrained then load_pretrained gives back every array bit for bit and the same
    config; `transformers` loads the export (the MTP layer too) and computes the same logits."""
    hf_directory, reference = request.getfixturevalue(f"hf_{family}")[:2]
    model = request.getfixturevalue(f"ferry_{family}")
    written = save_pretrained(model, tmp_path / "export", max_shard_bytes=200_000)
    assert len([p for p in written if p.suffix == ".safetensors"]) > 1  # sharded, with an index
    reimported = load_pretrained(tmp_path / "export")
    assert reimported.config == model.config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(reimported), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    hf_class = LlamaForCausalLM if family == "llama" else TinyDeepseekV3
    exported = hf_class.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    assert exported.dtype == torch.float32
    with torch.no_grad():
        logits = exported(torch.tensor(batch[:, :-1])).logits.numpy()
    np.testing.assert_allclose(logits, reference, rtol=0, atol=ATOL)
    if family == "deepseek":
        assert hf_mtp_loss(exported, batch) == pytest.approx(request.getfixturevalue("hf_deepseek")[3], abs=1e-6)


def test_export_config_overrides_add_keys_but_never_change_the_model(ferry_llama, tmp_path):
    """Keys the model does not read (max_position_embeddings, token ids) may be set; a key that
    would change the model is refused before anything is written, and so is a second export
    into the same directory."""
    overrides = {"max_position_embeddings": 131072, "bos_token_id": 128000}
    save_pretrained(ferry_llama, tmp_path / "export", config_overrides=overrides)
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert {k: written[k] for k in overrides} == overrides
    with pytest.raises(ValueError, match=r"config_overrides changes the model \(\['hidden_size'\]\)"):
        save_pretrained(ferry_llama, tmp_path / "other", config_overrides={"hidden_size": 128})
    assert not (tmp_path / "other").exists()
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        save_pretrained(ferry_llama, tmp_path / "export")


def quantise_fp8(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's FP8 format: e4m3 values and one float32 scale per block x block tile
    (weight = value x scale; partial tiles at the edges)."""
    rows, cols = -(-weight.shape[0] // block), -(-weight.shape[1] // block)
    padded = np.zeros((rows * block, cols * block), np.float32)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    tiles = np.abs(padded.reshape(rows, block, cols, block)).max(axis=(1, 3))
    scale = np.maximum(tiles, 1e-12) / 448.0
    expanded = np.kron(scale, np.ones((block, block), np.float32))[: weight.shape[0], : weight.shape[1]]
    return (weight / expanded).astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


def test_fp8_weights_are_dequantised_by_their_block_scales(hf_deepseek, tmp_path):
    """Every projection stored as FP8 e4m3 with 16 x 16 block scales (edges partial) and the
    embedding as bfloat16 import as the dequantised float32 values, whole or sliced."""
    block = 16
    source = hf_deepseek[0]
    tensors = {}
    for file in source.glob("*.safetensors"):
        tensors |= load_file(file)
    quantised, expected = {}, {}
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            values, scale = quantise_fp8(tensor, block)
            quantised[name], quantised[name + "_scale_inv"] = values, scale
            expanded = np.kron(scale, np.ones((block, block), np.float32))[: tensor.shape[0], : tensor.shape[1]]
            expected[name] = values.astype(np.float32) * expanded
        elif name.endswith("embed_tokens.weight"):
            quantised[name] = tensor.astype(ml_dtypes.bfloat16)
            expected[name] = quantised[name].astype(np.float32)
        else:
            quantised[name] = expected[name] = tensor
    assert any(v.dtype == ml_dtypes.float8_e4m3fn for v in quantised.values())
    hf_config = json.loads((source / "config.json").read_text())
    for directory, content, extra in (
        (
            tmp_path / "fp8",
            quantised,
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "activation_scheme": "dynamic",
                    "weight_block_size": [block, block],
                }
            },
        ),
        (tmp_path / "expected", expected, {}),
    ):
        directory.mkdir()
        save_file(content, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(hf_config | extra))

    fp8, reference = load_pretrained(tmp_path / "fp8"), load_pretrained(tmp_path / "expected")
    for a, b in zip(jax.tree.leaves(fp8), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # a device's shard: a slice of layers, experts, rows and columns not aligned to the blocks
    checked = check_checkpoint(tmp_path / "fp8")
    gate = checked.maps[".moe_layers.layers.mlp.experts.gate"]
    shape = checked.abstract.moe_layers.layers.mlp.experts.gate.shape
    whole = read_block(checked.checkpoint.reader, gate, shape, ())
    index = (slice(1, 2), slice(3, 9), slice(5, 40), slice(7, 25))
    np.testing.assert_array_equal(read_block(checked.checkpoint.reader, gate, shape, index), whole[index])
    np.testing.assert_array_equal(whole, np.asarray(reference.moe_layers.layers.mlp.experts.gate))


def edited_checkpoint(source, destination, **changes):
    """A copy of a checkpoint directory with config.json keys changed."""
    destination.mkdir()
    for file in source.glob("*.safetensors*"):
        (destination / file.name).symlink_to(file)
    hf_config = json.loads((source / "config.json").read_text())
    (destination / "config.json").write_text(json.dumps(hf_config | changes))
    return destination


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"norm_topk_prob": False}, "config.json has norm_topk_prob=False; ferry's DeepSeek-V3 implements only"),
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"hidden_size": 128}, "model.embed_tokens.weight has shape [256, 64], the config needs [256, 128]"),
        ({"model_type": "mistral"}, "model_type 'mistral'; ferry imports ['deepseek_v3', 'llama', 'qwen3']"),
    ],
)
def test_checkpoints_ferry_cannot_represent_are_refused(hf_deepseek, tmp_path, changes, message):
    directory = edited_checkpoint(hf_deepseek[0], tmp_path / "edited", **changes)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_pretrained(directory)


def test_launcher_refuses_a_model_config_the_checkpoint_does_not_match(hf_llama, tmp_path):
    """The run's model config (llama_tiny) against config.json: both values named, before the
    mesh or anything else is set up."""
    config = compose_config(f"init.from_hf={hf_llama[0]}", f"run.dir={tmp_path / 'run'}", "model.num_layers=3")
    with pytest.raises(CheckpointError) as refused:
        prepare(config, Console(quiet=True))
    assert "model.num_layers is 3 but" in str(refused.value) and "has 2 (num_hidden_layers)" in str(refused.value)
    assert "model.rope_scaling.original_max_position is 8192 but" in str(refused.value)
    assert not (tmp_path / "run").exists()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_pretrained(tmp_path)


def test_a_model_may_load_fewer_mtp_depths_than_the_checkpoint_holds(hf_deepseek, ferry_deepseek):
    without = load_pretrained(hf_deepseek[0], config=dataclasses.replace(ferry_deepseek.config, mtp_depth=0))
    assert without.mtp == () and without.config.mtp_depth == 0
    np.testing.assert_array_equal(np.asarray(without.head.weight), np.asarray(ferry_deepseek.head.weight))
    with pytest.raises(CheckpointError, match=r"model.mtp_depth is 2 but .* has 1 \(MTP layers in the checkpoint\)"):
        load_pretrained(hf_deepseek[0], config=dataclasses.replace(ferry_deepseek.config, mtp_depth=2))


def test_training_continues_from_imported_weights(hf_llama, tmp_path):
    """`launch/run.py model=llama_tiny init.from_hf=DIR` on a 2-device FSDP mesh (each device
    reading its half of every weight): the first step's loss is the Hugging Face model's loss on
    the same batch, and training goes on."""
    directory, _ = hf_llama
    seq_len = 64
    run_dir = tmp_path / "run"
    overrides = (
        "model=llama_tiny",
        f"init.from_hf={directory}",
        "model.rope_scaling.original_max_position=64",
        "platform.cpu_devices=2",
        "mesh.fsdp=2",
        "train.compute_dtype=float32",
        f"train.seq_len={seq_len}",
        "train.steps=2",
        "train.warmup_steps=0",
        "train.eval_batches=0",
        f"run.dir={run_dir}",
    )
    result = run_launcher(*overrides)
    assert result.returncode == 0, result.stderr + result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]

    config = compose_config(*overrides)  # the run's first batch, as its data pipeline builds it
    corpus = load_corpus(config.data, load_tokenizer(config.data.tokenizer, config.data.eos_token), 256)
    windows = PackedWindows(corpus.train, seq_len)
    first = windows.rows(window_batches(windows, config.train.global_batch_size, config.data.seed)[0]).astype(np.int64)
    model = LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor(first[:, :-1])).logits.numpy()
    assert records[0]["loss"] == pytest.approx(hf_loss(logits, first[:, 1:]), abs=LOSS_ATOL)
    assert np.isfinite(records[1]["loss"]) and records[1]["loss"] != records[0]["loss"]


# The architecture keys of the published config.json files (meta-llama/Llama-3.1-8B,
# deepseek-ai/DeepSeek-V3), in their transformers v4 spelling.
PUBLISHED_LLAMA_3_1_8B = {
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
PUBLISHED_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


@pytest.mark.parametrize(
    "family, published, model_name, mtp_layers",
    [
        (hf_llama_family, PUBLISHED_LLAMA_3_1_8B, "llama3_1_8b", 0),
        (hf_deepseek_v3, PUBLISHED_DEEPSEEK_V3, "deepseek_v3", 1),
    ],
)
def test_published_configs_are_ferrys_full_size_models(family, published, model_name, mtp_layers):
    """The published checkpoints' config.json describe exactly configs/model/<name>.yaml (its
    layer-61 MTP layer counted for DeepSeek-V3), and ferry's export writes the same values back."""
    wanted = load_model_config(model_name)
    check_matches(wanted, family.config_from_hf(published, mtp_layers), family.CONFIG_KEYS, "published config.json")
    exported = family.config_to_hf(wanted)
    for key, value in published.items():
        if key in exported and key not in ("rope_scaling", "max_position_embeddings", "quantization_config"):
            assert exported[key] == value, key
    check_matches(wanted, family.config_from_hf(exported, mtp_layers), family.CONFIG_KEYS, "exported config.json")


@pytest.mark.parametrize(
    "rope",
    [
        {"mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3
        {"mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2
        {},  # neither: transformers applies mscale(factor, 1) to cos and sin
        {"mscale": 1.0},
        {"mscale_all_dim": 0.8},  # only the softmax factor given
        {"mscale": 1.0, "mscale_all_dim": 0.8, "attention_factor": 1.1},
    ],
)
def test_yarn_factors_match_transformers(rope):
    """ferry's YaRN for every way transformers reads mscale, mscale_all_dim and attention_factor:
    the same frequencies, the same factor on cos and sin and the same softmax scale; and the
    export of ferry's YaRN reads back into the same factors."""
    parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096}
    parameters |= rope
    config = DeepseekV3Config(**DEEPSEEK | {"rope_parameters": parameters})
    hf_frequencies, hf_cos_sin = ROPE_INIT_FUNCTIONS["yarn"](config)
    hf_softmax = DeepseekV3Attention(config, 0).scaling
    head = DEEPSEEK["qk_nope_head_dim"] + DEEPSEEK["qk_rope_head_dim"]

    yarn = hf_deepseek_v3.yarn_from_hf(parameters, DEEPSEEK["max_position_embeddings"])
    for candidate in (yarn, hf_deepseek_v3.yarn_from_hf(hf_deepseek_v3.yarn_to_hf(yarn), 0)):
        frequencies, cos_sin = yarn_frequencies(DEEPSEEK["qk_rope_head_dim"], 10000.0, candidate)
        np.testing.assert_allclose(frequencies, hf_frequencies.numpy(), rtol=1e-6)
        assert cos_sin == pytest.approx(hf_cos_sin, rel=1e-12)
        softmax = head**-0.5 * yarn_mscale(candidate.factor, candidate.mscale_all_dim) ** 2
        assert softmax == pytest.approx(hf_softmax, rel=1e-12)
