"""The fused loss head (`ferry.head.fused`, `train.loss_head=fused`): its loss and both gradients,
made in the forward pass, equal today's cross-entropy of the whole logits in float32 (z-loss, loss
weights, a tied head, uneven chunks); its chunks follow the stated rule; and the compiled head
holds no logits and runs the whole logits' three matmuls, not the chunked head's five."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.head.chunked import OutputHead
from ferry.head.fused import SequenceChunks, chunks_under_mesh, sequence_chunks
from ferry.head.loss import MIB, LossHead
from ferry.models.registry import build_model
from ferry.xla.hlo_flops import matmul_flops
from tests.conftest import compose_config, load_model_config, needs_libtpu
from tests.head.test_loss_head import (
    ATOL,
    RTOL,
    assert_losses_like_the_whole_logits,
    assert_trains_like_the_whole_logits,
    axes_of,
    head_case,
    loss_and_grads,
)


def fused(rows: int, positions: int, columns: int) -> LossHead:
    """A fused head whose chunks are `positions` long for `rows` batch rows of `columns` ids."""
    return LossHead("fused", 4 * rows * positions * columns / MIB)


@pytest.mark.parametrize("vocab_axis", [1, 0], ids=["head", "tied"])
@pytest.mark.parametrize("z_loss, masked", [(0.0, False), (1e-2, True)], ids=["plain", "z_loss+weights"])
@pytest.mark.parametrize("positions", [7, 3, 1], ids=lambda p: f"chunk{p}")
def test_fused_equals_whole_logits(vocab_axis, z_loss, masked, positions):
    """Loss, cross-entropy and both gradients equal the whole logits', whatever the chunking: one
    chunk, uneven chunks (the last one started early over its predecessor's positions) and one
    position at a time."""
    hidden, weight, targets, weights = head_case(vocab_axis)
    weights = weights if masked else None
    head = fused(hidden.shape[0], positions, weight.shape[vocab_axis])
    reference = loss_and_grads(LossHead("logits"), hidden, weight, targets, vocab_axis, z_loss, weights)
    result = loss_and_grads(head, hidden, weight, targets, vocab_axis, z_loss, weights)
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_the_loss_is_differentiated_and_the_cross_entropy_beside_it_is_not():
    """Not vacuous: z-loss adds to the loss and every weight column the batch reads moves; the
    cross-entropy reported beside it carries no gradient (its gradient is stopped)."""
    hidden, weight, targets, _ = head_case(1, vocab=300)
    head = fused(2, 2, 300)
    total, cross_entropy, (d_hidden, d_weight) = loss_and_grads(head, hidden, weight, targets, 1, 0.1, None)
    assert total > cross_entropy > 0
    assert np.all(np.abs(np.asarray(d_weight)).sum(axis=0) > 0) and np.abs(d_hidden).min() > 0

    def cross_entropy_of(h, w):
        return head(h, OutputHead(w, axes_of(1)), targets, 0.1)[1]

    grads = jax.grad(cross_entropy_of, argnums=(0, 1))(hidden, weight)
    assert all(not np.any(np.asarray(g)) for g in grads)


def test_bfloat16_head_matches_the_whole_logits_at_bfloat16_tolerance():
    """In the compute dtype, gradients come back in it, as autodiff of the whole logits gives
    them; a float32 weight (as `compute_copy` keeps a head of its own) gives its gradient in
    float32."""
    hidden, weight, targets, weights = head_case(1, vocab=512, dim=64)
    hidden, weight16 = hidden.astype(jnp.bfloat16), weight.astype(jnp.bfloat16)
    reference = loss_and_grads(LossHead("logits"), hidden, weight16, targets, 1, 1e-3, weights)
    head = fused(2, 3, 512)
    result = loss_and_grads(head, hidden, weight16, targets, 1, 1e-3, weights)
    assert result[2][0].dtype == result[2][1].dtype == jnp.bfloat16
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2, atol=2e-3)
    stored = loss_and_grads(head, hidden, weight16.astype(jnp.float32), targets, 1, 1e-3, weights)
    assert stored[2][1].dtype == jnp.float32
    np.testing.assert_allclose(np.float32(stored[2][1]), np.float32(result[2][1]), rtol=2e-2, atol=2e-3)


def test_the_compute_copy_keeps_the_fused_heads_weight_as_stored():
    """The fused head sums its weight's gradient over chunks in float32: it reads the stored weight."""
    from ferry.train.step import compute_copy

    model = build_model(load_model_config("llama_tiny"), jax.random.key(0))
    copy = compute_copy(model, jnp.bfloat16, LossHead("fused"))
    assert copy.output_head().weight.dtype == jnp.float32 and copy.embed.weight.dtype == jnp.bfloat16


def test_the_chunk_rule():
    """As few chunks of the sequence as keep a chunk's float32 logits within the budget, in whole
    sublanes of 8 positions where 8 fit."""
    # the v5e shape: 8 rows x 2,048 positions, 32,768 ids, 256 MiB: 8 chunks of 256 positions
    assert sequence_chunks(8, 2048, 32768, 256 * MIB) == SequenceChunks(2048, 256, 8)
    # Llama 3.1 8B at 1 x 8,192: 523 positions fit, 16 chunks, evened out to 512
    assert sequence_chunks(1, 8192, 128256, 256 * MIB) == SequenceChunks(8192, 512, 16)
    # a budget larger than the logits: one chunk
    assert sequence_chunks(2, 7, 1000, 256 * MIB) == SequenceChunks(7, 7, 1)
    # under 8 positions a chunk: as many as fit, at least one; uneven: the last starts early
    assert sequence_chunks(2, 7, 1000, 4 * 2 * 3 * 1000) == SequenceChunks(7, 3, 3)
    assert sequence_chunks(1 << 20, 7, 1000, 1).size == 1
    chunks = sequence_chunks(2, 7, 1000, 4 * 2 * 3 * 1000)
    starts = [int(chunks.start(jnp.int32(i))) for i in range(chunks.count)]
    owned = [np.flatnonzero(chunks.owned(jnp.int32(i), jnp.int32(s))) + s for i, s in enumerate(starts)]
    assert starts == [0, 3, 4] and np.concatenate(owned).tolist() == list(range(7))


def test_chunks_under_a_mesh_count_the_rows_and_columns_of_one_device():
    """The batch split over data and fsdp, the vocabulary over tensor: a device's chunk is
    budgeted on its own rows and columns."""
    mesh = jax.sharding.AbstractMesh(
        (2, 2, 2, 1), ("data", "fsdp", "tensor", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 4
    )
    # 2 rows and 16,384 columns a device: 128 positions in 256 MiB x 1/16
    assert chunks_under_mesh(8, 1024, 32768, 16 * MIB, mesh) == SequenceChunks(1024, 128, 8)


def head_program(kind: str, batch: int, seq: int, dim: int, vocab: int, weight_grad: str = "late"):
    """The compiled loss head's value and gradients (CPU), 16 MiB chunks."""
    hidden = jax.ShapeDtypeStruct((batch, seq, dim), jnp.float32)
    weight = jax.ShapeDtypeStruct((dim, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    head = LossHead(kind, 16.0, weight_grad)

    def loss(h, w, t):
        return head(h, OutputHead(w, ("embed", "vocab")), t)[0]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weight, targets).compile()


def test_the_compiled_head_holds_no_logits_and_runs_the_whole_logits_three_matmuls():
    """At 4 x 1,024 tokens and 16,384 ids the float32 logits are 256 MiB: the fused head holds a
    16 MiB chunk and its gradient, not the logits; its matmuls are the whole logits' three (each
    2 x tokens x dim x vocab FLOPs), where the chunked head's late walk runs five."""
    batch, seq, dim, vocab = 4, 1024, 64, 16384
    logits_bytes, product = 4 * batch * seq * vocab, 2 * batch * seq * dim * vocab
    programs = {
        name: head_program(kind, batch, seq, dim, vocab)
        for name, kind in (("fused", "fused"), ("logits", "logits"), ("chunked", "chunked"))
    }
    temporaries = {name: p.memory_analysis().temp_size_in_bytes for name, p in programs.items()}
    assert temporaries["logits"] >= logits_bytes > 4 * temporaries["fused"], temporaries
    flops = {name: matmul_flops(p.as_text()) for name, p in programs.items()}
    assert flops["fused"] == flops["logits"] == 3 * product, flops
    assert flops["chunked"] == 5 * product, flops


# DeepSeek-V3's losses compile for 20 s on a small CPU; its MTP depths call the same head on
# their own hidden states, which llama_tiny's case checks with gradients
@pytest.mark.parametrize("name", ["llama_tiny", pytest.param("deepseek_v3_tiny", marks=pytest.mark.slow)])
def test_models_train_on_the_same_loss_and_gradients(name):
    """A family's training loss (DeepSeek-V3's MTP depths read the head too) and its gradients
    are the same through the fused head as through the whole logits; DeepSeek's losses only
    (its gradients compile for minutes on a small CPU)."""
    config = load_model_config(name)
    head = fused(2, 5, config.vocab_size)  # 4 chunks of the 16 positions, the last started early
    if name == "deepseek_v3_tiny":
        assert config.mtp_depth > 0
        assert_losses_like_the_whole_logits(name, head)
    else:
        assert_trains_like_the_whole_logits(name, head)


def test_the_config_takes_the_fused_head_and_start_up_names_its_chunks():
    config = compose_config("train.loss_head=fused", "train.loss_chunk_mib=64")
    assert config.train.head == LossHead("fused", 64.0)
    assert LossHead("fused").describe(8, 2048, 32768, 2048) == (
        "loss head: fused (train.loss_head=fused): the loss and both gradients in one walk of the forward pass, "
        "8 chunks of 256 of the 2,048 positions, within train.loss_chunk_mib=256 MiB of float32 logits per chunk; "
        "each chunk by XLA [train.loss_kernel=auto: cpu, not a TPU]"
    )


def test_on_a_mesh_the_fused_head_trains_like_the_chunked_head(tmp_path):
    """8 virtual CPU devices, the batch over data and fsdp and the vocabulary over tensor: the
    fused head's losses equal the chunked head's on the same mesh, whose losses equal one
    device's (tests/run/test_mesh.py)."""
    from tests.run.test_mesh import losses_of, start_mesh_losses

    common = (
        "model=llama_tiny offload=minimal train.steps=4 train.warmup_steps=1 train.log_every=1 "
        "train.compute_dtype=float32 train.global_batch_size=8 train.seq_len=32 train.eval_batches=0 "
        "mesh.data=2 mesh.fsdp=2 mesh.tensor=2 checkpoint.final=false train.loss_chunk_mib=0.01"
    )
    runs = ["train.loss_head=chunked", "train.loss_head=fused"]
    chunked, fused_losses = losses_of(start_mesh_losses(8, common, runs, tmp_path))
    assert len(chunked) == 4
    np.testing.assert_allclose(fused_losses, chunked, rtol=1e-5)


@needs_libtpu
def test_on_v5e_the_fused_head_runs_three_matmuls_in_a_fraction_of_the_logits():
    """The v5e program (deviceless) of the benchmark's head, batch 8 x 2,048, dim 2,048,
    vocabulary 32,768: the fused head's products are the whole logits' three (the chunked head's
    late walk five), and its temporaries hold no logits (the whole logits' hold 3 GiB)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from ferry.plan.planner import compile_only_mesh
    from ferry.sharding import MeshConfig
    from ferry.xla.targets import TARGETS

    mesh = compile_only_mesh(TARGETS["v5e"], MeshConfig())
    batch, seq, dim, vocab = 8, 2048, 2048, 32768
    replicated = NamedSharding(mesh, PartitionSpec())
    shapes = ((batch, seq, dim), jnp.bfloat16), ((dim, vocab), jnp.float32), ((batch, seq), jnp.int32)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes]
    programs = {}
    for kind in ("fused", "logits", "chunked"):
        head = LossHead(kind, kernel="xla")  # the XLA fused head (`auto` takes the kernel on a TPU)

        def loss(h, w, t, head=head):
            w = w.astype(h.dtype) if head.kind == "logits" else w  # as `compute_copy` casts the whole head
            return head(h, OutputHead(w, ("embed", "vocab")), t)[0]

        with jax.set_mesh(mesh):
            programs[kind] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    product = 2 * batch * seq * dim * vocab
    flops = {kind: matmul_flops(p.as_text()) for kind, p in programs.items()}
    assert flops == {"fused": 3 * product, "logits": 3 * product, "chunked": 5 * product}
    temporaries = {kind: p.memory_analysis().temp_size_in_bytes for kind, p in programs.items()}
    assert temporaries["fused"] < temporaries["logits"] / 4, temporaries
