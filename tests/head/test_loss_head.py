"""The chunked loss head (`ferry.head.chunked`, `train.loss_head=chunked`): the loss and its
gradients equal today's cross-entropy of the whole logits (`next_token_loss`) in float32, with
z-loss, loss weights and a tied head; its chunks follow the stated rule; and a compiled step never
holds the logits (its temporaries, read from the compiled program)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.config.train import TrainConfig
from ferry.errors import ConfigError
from ferry.head.chunked import OutputHead, VocabChunks, chunks_under_mesh, vocab_chunks
from ferry.head.loss import MIB, LossHead, next_token_loss, whole_logits
from ferry.models.registry import build_model
from ferry.offload.engine import SAVE_ALL
from tests.conftest import compose_config, load_model_config, needs_cuda_plugin

# float32 throughout: the chunked head sums the same products in another order
RTOL, ATOL = 2e-5, 1e-6


def head_case(vocab_axis: int, vocab: int = 1000, dim: int = 16, batch: int = 2, seq: int = 7):
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (batch, seq, dim))
    shape = (dim, vocab) if vocab_axis == 1 else (vocab, dim)
    weight = 0.3 * jax.random.normal(keys[1], shape)
    targets = jax.random.randint(keys[2], (batch, seq), 0, vocab)
    weights = jax.random.bernoulli(keys[3], 0.6, (batch, seq))
    return hidden, weight, targets, weights


def axes_of(vocab_axis: int) -> tuple[str, str]:
    return ("embed", "vocab") if vocab_axis == 1 else ("vocab", "embed")


def loss_and_grads(head: LossHead, hidden, weight, targets, vocab_axis, z_loss, weights):
    def loss(h, w):
        total, cross_entropy = head(h, OutputHead(w, axes_of(vocab_axis), vocab_axis), targets, z_loss, weights)
        return total, cross_entropy

    (total, cross_entropy), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(hidden, weight)
    return total, cross_entropy, grads


def budget_mib(tokens: int, columns: int) -> float:
    """The budget whose chunks are `columns` wide for `tokens` tokens on one device."""
    return 4 * tokens * columns / MIB


@pytest.mark.parametrize("vocab_axis", [1, 0], ids=["head", "tied"])
@pytest.mark.parametrize(
    "z_loss, masked, weight_grad",
    [(0.0, False, "late"), (1e-2, True, "late"), (1e-2, True, "early")],
    ids=["plain", "z_loss+weights", "z_loss+weights+early"],
)
@pytest.mark.parametrize("columns", [1000, 300, 128, 7], ids=lambda c: f"chunk{c}")
def test_chunked_equals_whole_logits(vocab_axis, z_loss, masked, weight_grad, columns):
    """Loss, cross-entropy and both gradients equal today's, whatever the chunking: one chunk,
    uneven chunks (the last one clamped back over its predecessor's columns), lane-sized chunks
    and chunks below a lane; the weight's gradient in a walk of its own or the hidden state's."""
    hidden, weight, targets, weights = head_case(vocab_axis)
    weights = weights if masked else None
    chunked = LossHead("chunked", budget_mib(hidden.shape[0] * hidden.shape[1], columns), weight_grad)
    reference = loss_and_grads(LossHead("logits"), hidden, weight, targets, vocab_axis, z_loss, weights)
    result = loss_and_grads(chunked, hidden, weight, targets, vocab_axis, z_loss, weights)
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # the reference is today's loss: next_token_loss of the whole logits
    logits = whole_logits(hidden, OutputHead(weight, axes_of(vocab_axis), vocab_axis))
    np.testing.assert_allclose(reference[0], next_token_loss(logits, targets, z_loss, weights)[0], rtol=1e-6)


def test_the_chunked_loss_is_the_cross_entropy_and_its_gradient_is_nonzero():
    """Not vacuous: z-loss adds to the loss, and every weight column the batch reads moves."""
    hidden, weight, targets, _ = head_case(1, vocab=300)
    head = LossHead("chunked", budget_mib(14, 128))
    total, cross_entropy, (d_hidden, d_weight) = loss_and_grads(head, hidden, weight, targets, 1, 0.1, None)
    assert total > cross_entropy > 0
    assert np.all(np.abs(np.asarray(d_weight)).sum(axis=0) > 0) and np.abs(d_hidden).min() > 0


def test_bfloat16_head_matches_the_whole_logits_at_bfloat16_tolerance():
    """In the compute dtype runs train in, gradients come back in it, as autodiff of the whole
    logits gives them, and agree to bfloat16's precision; a float32 weight (as `compute_copy`
    keeps a head of its own) gives its gradient in float32, the same values."""
    hidden, weight, targets, weights = head_case(1, vocab=512, dim=64)
    hidden, weight16 = hidden.astype(jnp.bfloat16), weight.astype(jnp.bfloat16)
    reference = loss_and_grads(LossHead("logits"), hidden, weight16, targets, 1, 1e-3, weights)
    chunked = LossHead("chunked", budget_mib(14, 128))
    result = loss_and_grads(chunked, hidden, weight16, targets, 1, 1e-3, weights)
    assert result[2][0].dtype == result[2][1].dtype == jnp.bfloat16
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2, atol=2e-3)
    stored = loss_and_grads(chunked, hidden, weight16.astype(jnp.float32), targets, 1, 1e-3, weights)
    assert stored[2][1].dtype == jnp.float32
    for got, want in zip(jax.tree.leaves(stored), jax.tree.leaves(result), strict=True):
        np.testing.assert_array_equal(np.float32(got), np.float32(want))


def test_the_compute_copy_keeps_a_head_of_its_own_as_stored():
    """The chunked head reads its own weight in float32 (cast a chunk at a time); a tied head,
    and the whole-logits head, are cast with the rest of the model."""
    from ferry.train.step import compute_copy

    for name, tied in (("llama_tiny", False), ("qwen3_tiny", True)):
        model = build_model(load_model_config(name), jax.random.key(0))
        for head, stored in ((LossHead("chunked"), not tied), (LossHead("logits"), False)):
            copy = compute_copy(model, jnp.bfloat16, head)
            assert copy.output_head().weight.dtype == (jnp.float32 if stored else jnp.bfloat16)
            assert copy.embed.weight.dtype == jnp.bfloat16


def test_the_chunk_rule():
    """As few chunks as keep a chunk's float32 logits within the budget, lane-aligned."""
    # the v5e shape: 8 x 2048 tokens, 32,768 ids, 256 MiB: 8 chunks of 4,096 columns
    assert vocab_chunks(8 * 2048, 32768, 1, 256 * MIB) == VocabChunks(1, 32768, 4096, 8)
    # Llama 3.1 8B at 8,192 tokens: 8,192 columns fit, 16 chunks, evened out to 8,064 (63 lanes)
    assert vocab_chunks(8192, 128256, 1, 256 * MIB) == VocabChunks(1, 128256, 8064, 16)
    # the vocabulary split over 4 devices: each walks its quarter
    assert vocab_chunks(8192, 128256, 4, 256 * MIB) == VocabChunks(4, 32064, 8064, 4)
    # a budget larger than the logits: one chunk of everything
    assert vocab_chunks(16, 1000, 1, 256 * MIB) == VocabChunks(1, 1000, 1000, 1)
    # under a lane per chunk: as many columns as fit, at least one
    assert vocab_chunks(1 << 20, 1000, 1, 100 * 4 << 20) == VocabChunks(1, 1000, 100, 10)
    assert vocab_chunks(1 << 30, 1000, 1, 1).size == 1
    for chunks in (vocab_chunks(8192, 128256, 1, 256 * MIB), vocab_chunks(14, 1000, 1, 4 * 14 * 300)):
        assert chunks.size * chunks.count >= chunks.columns > chunks.size * (chunks.count - 1)
        assert chunks.size * 4 * 8192 <= 256 * MIB or chunks.columns == 1000


def test_chunks_under_a_mesh_count_the_tokens_and_columns_of_one_device():
    """The batch split over data and fsdp, the vocabulary over tensor: a device's chunk is
    budgeted on its own share."""
    mesh = jax.sharding.AbstractMesh(
        (2, 2, 2, 1), ("data", "fsdp", "tensor", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )
    chunks = chunks_under_mesh(8, 1024, 32768, 4 * 2 * 1024 * 2048, mesh)
    assert chunks == VocabChunks(2, 16384, 2048, 8)  # 2 rows x 1,024 tokens, half the vocabulary


# DeepSeek's gradients compile for minutes on a small CPU; its losses (main, MTP, balance) are
# compared quickly below, and every DeepSeek test trains through the chunked head (the default)
DEEPSEEK_GRADIENTS = pytest.param("deepseek_v3_tiny", marks=pytest.mark.slow)


@pytest.mark.parametrize("name", ["llama_tiny", "qwen3_tiny", DEEPSEEK_GRADIENTS])
def test_models_train_on_the_same_loss_and_gradients(name):
    """Each family's training loss (MTP depths and their balance losses included) and its
    gradients are the same through the chunked head as through the whole logits."""
    chunked = LossHead("chunked", budget_mib(2 * 16, 128))
    assert vocab_chunks(32, load_model_config(name).vocab_size, 1, chunked.budget_bytes).count > 1
    assert_trains_like_the_whole_logits(name, chunked)


def test_deepseek_main_and_mtp_losses_are_the_same():
    """DeepSeek-V3 reads its head from the main model and from every MTP depth: each loss agrees."""
    assert load_model_config("deepseek_v3_tiny").mtp_depth > 0
    assert_losses_like_the_whole_logits("deepseek_v3_tiny", LossHead("chunked", budget_mib(2 * 16, 128)))


def model_and_batch(name: str):
    """A tiny family's model and a batch of 2 x 17 tokens."""
    config = load_model_config(name)
    model = build_model(config, jax.random.key(0))
    return model, jax.random.randint(jax.random.key(1), (2, 17), 0, config.vocab_size)


def assert_trains_like_the_whole_logits(name: str, head: LossHead) -> None:
    """The family's training loss, its statistics and its gradients through `head` equal the
    whole logits' (float32)."""
    model, batch = model_and_batch(name)

    def run(h: LossHead):
        def loss(m):
            return m.training_loss(batch, SAVE_ALL, 1e-3, head=h)

        return eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(model)

    ((want, want_stats), want_grads), ((got, got_stats), got_grads) = run(LossHead("logits")), run(head)
    np.testing.assert_allclose(got, want, rtol=RTOL)
    for key in want_stats:
        np.testing.assert_allclose(got_stats[key], want_stats[key], rtol=RTOL, atol=ATOL)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def assert_losses_like_the_whole_logits(name: str, head: LossHead) -> None:
    """The family's losses (main, MTP, balance) through `head` equal the whole logits' (no
    gradients: DeepSeek's compile for minutes on a small CPU)."""
    model, batch = model_and_batch(name)
    run = eqx.filter_jit(lambda m, h: m.training_loss(batch, SAVE_ALL, 1e-3, head=h))
    (want, want_stats), (got, got_stats) = run(model, LossHead("logits")), run(model, head)
    np.testing.assert_allclose(got, want, rtol=RTOL)
    for key in ("loss", "mtp_loss", "balance_loss"):
        np.testing.assert_allclose(got_stats[key], want_stats[key], rtol=RTOL, atol=ATOL)


def test_bad_loss_head_settings_are_refused():
    with pytest.raises(ConfigError, match="train.loss_head is 'whole'; use one of auto, chunked, fused, logits"):
        TrainConfig(loss_head="whole")
    refusal = r"train.loss_chunk_mib=0.0 must be a positive number \(MiB of logits per chunk\)"
    with pytest.raises(ConfigError, match=refusal):
        TrainConfig(loss_chunk_mib=0.0)
    with pytest.raises(ConfigError, match="train.loss_weight_grad is 'never'; use one of late, early"):
        TrainConfig(loss_weight_grad="never")
    config = compose_config("train.loss_head=chunked", "train.loss_chunk_mib=64", "train.loss_weight_grad=early")
    assert config.train.head == LossHead("chunked", 64.0, "early")


def head_temporaries(kind: str, batch: int, seq: int, dim: int, vocab: int, weight_grad: str = "late") -> int:
    """Temporary bytes of the compiled loss head's value and gradients (CPU), 16 MiB chunks."""
    hidden = jax.ShapeDtypeStruct((batch, seq, dim), jnp.float32)
    weight = jax.ShapeDtypeStruct((dim, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    head = LossHead(kind, 16.0, weight_grad)

    def loss(h, w, t):
        return head(h, OutputHead(w, ("embed", "vocab")), t)[0]

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weight, targets).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_compiled_head_never_holds_the_logits():
    """At 4 x 1,024 tokens and 16,384 ids the float32 logits are 256 MiB: the whole-logits head's
    temporaries hold them; the chunked head's hold a 16 MiB chunk and its softmax, and the
    gradient of the hidden state (its own outputs aside), well under one logits."""
    logits_bytes = 4 * 1024 * 16384 * 4
    whole = head_temporaries("logits", 4, 1024, 64, 16384)
    assert whole >= logits_bytes
    for weight_grad in ("late", "early"):
        chunked = head_temporaries("chunked", 4, 1024, 64, 16384, weight_grad)
        assert chunked <= logits_bytes / 4, (weight_grad, chunked, whole)


@needs_cuda_plugin
@pytest.mark.slow  # one compile of 2 layers of Llama 3.1 8B for an H200, ~40 s
def test_h200_plan_of_llama_8b_drops_the_logits():
    """Issue 46's plan: 2 layers of Llama 3.1 8B at 1 x 8,192 tokens, full_remat, on an H200.
    With the whole logits its temporaries were 7.91 GiB (8,495,745,960 bytes, jax 0.12.0.1); the
    chunked head with its late weight-gradient walk needs 4.33 GiB (4,644,371,624): no logits,
    and neither the head's gradient nor a bf16 copy of its weight held through the layers'
    backward (early: 5.24 GiB, the gradient held). What remains peaks in a layer's backward
    attention, its float32 score buffers (the attention kernels' part of issue 46)."""
    from ferry.models.registry import abstract_model
    from ferry.plan.planner import plan_memory
    from ferry.xla.targets import TARGETS
    from tests.conftest import GPU_FLAGS

    overrides = ("model=llama3_1_8b", "model.num_layers=2", "train.seq_len=8192", "train.global_batch_size=1")
    config = compose_config(*overrides, "offload=full_remat")
    policy = config.offload.policy(abstract_model(config.model).tagged_names())
    plan = plan_memory(config, TARGETS["h200"], policy, "full_remat", xla_flags=GPU_FLAGS)
    assert plan.temp_bytes <= 4.4 * 2**30, plan.temp_bytes / 2**30


def test_the_tpu_benchmark_runs_on_cpu_at_a_tiny_shape(tmp_path):
    """benchmarks/loss_head_tpu.py's functions as the chip runs them, at a shape a CPU runs at
    once: every head times, the floor is timed, the JSON says so."""
    import json

    from benchmarks.loss_head_tpu import main

    out = tmp_path / "head.json"
    argv = ["--batch", "2", "--seq", "64", "--dim", "32", "--vocab", "1024", "--chunk-mib", "0.0625,1"]
    result = main([*argv, "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    heads = result["heads"]
    names = ["logits"] + [f"chunked {c} MiB {walk}" for c in ("0.0625", "1") for walk in ("late", "early")]
    fused = ["fused 0.0625 MiB", "fused 1 MiB", "pallas 0.0625 MiB", "pallas 1 MiB"]
    assert [h["head"] for h in heads] == names + fused
    assert [h["kernel"] for h in heads[-4:]] == ["xla", "xla", "pallas", "pallas"]
    # 128 tokens: 128 columns fit 64 KiB; 2 rows x 8 positions of 1,024 columns do too
    assert [h.get("chunks") for h in heads] == [None, 8, 8, 1, 1, 8, 1, 8, 1]
    assert heads[0]["vs_logits"] == 1.0 and all(h["ms"] > 0 and h["vs_floor"] > 0 for h in heads)


def test_start_up_names_the_head_its_chunks_and_its_walk():
    assert LossHead().describe(8, 2048, 32768, 2048) == (
        "loss head: chunked (train.loss_head=chunked): the logits are never whole; 8 chunks of 4,096 of each "
        "device's 32,768 vocabulary columns, within train.loss_chunk_mib=256 MiB of float32 logits per chunk; the "
        "head's weight gradient in a walk of its own, after the layers' backward (train.loss_weight_grad=late)"
    )
    assert "in the hidden state's walk" in LossHead("chunked", 256.0, "early").describe(1, 8192, 128256, 4096)
    assert "the whole 8 x 2048 x 32,768 logits" in LossHead("logits").describe(8, 2048, 32768, 2048)
