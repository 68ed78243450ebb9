"""The fused head's Pallas kernel (`ferry.head.kernel`, `train.loss_kernel`): in Pallas interpret
mode on CPU its loss and both gradients equal today's cross-entropy of the whole logits (a head
or a tied embedding, z-loss and weights, uneven chunks, a vocabulary that ends inside a tile,
tokens that do not fill a tile), `auto` picks it where it runs and a setting that cannot run is
refused; the v5e program (deviceless) runs it as a Mosaic kernel and holds no logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.errors import ConfigError
from ferry.head.chunked import OutputHead
from ferry.head.kernel import HeadTiles, choose_tiles, head_chunk, vmem_bytes, vmem_capacity
from ferry.head.kernel_choice import KernelChoice, choose_kernel
from ferry.head.loss import MIB, LossHead
from ferry.plan.replay import total_dot_flops
from ferry.sharding import attention_platform
from tests.conftest import compose_config, needs_libtpu
from tests.head.test_loss_head import ATOL, RTOL, axes_of, head_case, loss_and_grads


def pallas(rows: int, positions: int, columns: int) -> LossHead:
    """A fused head made by the kernel, its chunks `positions` long for `rows` rows of `columns` ids."""
    return LossHead("fused", 4 * rows * positions * columns / MIB, kernel="pallas")


@pytest.mark.parametrize(
    "vocab_axis, z_loss, masked, positions",
    [(1, 0.0, False, 7), (1, 1e-2, True, 3), (0, 1e-2, True, 7), (0, 0.0, False, 1)],
    ids=["head-one-chunk", "head-z_loss+weights-uneven", "tied-z_loss+weights", "tied-a-position-a-chunk"],
)
def test_the_kernel_equals_the_whole_logits(vocab_axis, z_loss, masked, positions):
    """Float32 throughout, so the tolerance is the XLA fused head's: the sums run in another order.
    A vocabulary of 1,000 ends inside the kernel's second tile of 512 columns."""
    hidden, weight, targets, weights = head_case(vocab_axis)
    weights = weights if masked else None
    reference = loss_and_grads(LossHead("logits"), hidden, weight, targets, vocab_axis, z_loss, weights)
    result = loss_and_grads(pallas(2, positions, 1000), hidden, weight, targets, vocab_axis, z_loss, weights)
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_in_bfloat16_the_kernel_rounds_as_the_whole_logits_do():
    """The logits rounded to the compute dtype before their softmax and the logits' gradient
    written in it, as autodiff of the whole logits has them: bfloat16 tolerance, and the
    gradients in the compute dtype."""
    hidden, weight, targets, weights = head_case(1, vocab=512, dim=64)
    hidden, weight = hidden.astype(jnp.bfloat16), weight.astype(jnp.bfloat16)
    reference = loss_and_grads(LossHead("logits"), hidden, weight, targets, 1, 1e-3, weights)
    result = loss_and_grads(pallas(2, 7, 512), hidden, weight, targets, 1, 1e-3, weights)
    assert result[2][0].dtype == result[2][1].dtype == jnp.bfloat16
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2, atol=2e-3)


def loss_of_logits(logits, targets, share, z):
    """The kernel's loss by its definition: `sum(share * (lse - target) + z * share * lse^2)`."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[:, None], axis=1)[:, 0]
    return jnp.sum(share * (lse - target) + z * share * lse * lse)


@pytest.mark.parametrize("tokens, vocab, columns", [(13, 300, 128), (32, 100, 512)], ids=["ragged", "one-tile"])
def test_one_chunk_of_the_kernel(tokens, vocab, columns):
    """`head_chunk` alone against its definition: 13 tokens (padded to 16 inside, dropped after)
    over 3 tiles the last of which ends past the vocabulary, and a vocabulary inside one tile."""
    keys = jax.random.split(jax.random.key(1), 4)
    rows = jax.random.normal(keys[0], (tokens, 64))
    weight = 0.3 * jax.random.normal(keys[1], (64, vocab))
    targets = jax.random.randint(keys[2], (tokens,), 0, vocab)
    share = jax.random.uniform(keys[3], (tokens,)) / tokens
    z = 1e-2

    def loss(rows, weight):
        logits = rows @ weight
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, targets[:, None], axis=1)[:, 0]
        return loss_of_logits(logits, targets, share, z), (lse, target, logits)

    (_, (lse, target, logits)), d_rows = jax.value_and_grad(loss, has_aux=True)(rows, weight)
    want_d_logits = jax.grad(lambda lg: loss_of_logits(lg, targets, share, z))(logits)
    got = head_chunk(rows, weight, targets, share, HeadTiles(16, columns), 1, z, interpret=True)
    for got_part, want in zip(got, (lse, target, want_d_logits, d_rows), strict=True):
        assert got_part.shape == want.shape
        np.testing.assert_allclose(got_part, want, rtol=RTOL, atol=ATOL)


def test_the_tile_rule():
    """The largest block of tokens whose VMEM fits the core's less 16 MiB and divides the tokens
    padded to whole sublane tiles (16 rows of 16 bits)."""
    assert choose_tiles(8 * 2048, 32768, 2048) == HeadTiles(1024, 512)  # the v5e shape: 1,024 timed fastest
    assert choose_tiles(8192, 128256, 4096) == HeadTiles(256, 512)  # Llama 3.1 8B: 8,192 tokens
    assert choose_tiles(8 * 2048, 32768, 2048, vmem=64 * MIB) == HeadTiles(256, 512, 64 * MIB)  # a v5p core
    assert choose_tiles(13, 1000, 16) == HeadTiles(16, 512)  # padded to 16
    assert choose_tiles(13, 1000, 16, itemsize=4) == HeadTiles(16, 512)  # float32: padded to 8, 16 divides 16
    assert vmem_bytes(HeadTiles(1024, 512), 32768, 2048) <= 112 * MIB < vmem_bytes(HeadTiles(2048, 512), 32768, 2048)
    with pytest.raises(ValueError, match="no block of rows fits"):
        choose_tiles(8192, 64 * 2**20, 4096)
    assert vmem_capacity("TPU v5 lite") == 128 * MIB and vmem_capacity("TPU v5") == 64 * MIB
    assert vmem_capacity("NVIDIA H200") is None and vmem_capacity(None) is None


def v5e_mesh(tensor: int = 1):
    """A compile-only mesh of v5e chips (its devices name their kind): one, or `tensor` split."""
    from ferry.plan.planner import compile_only_mesh
    from ferry.sharding import MeshConfig
    from ferry.xla.targets import TARGETS

    return compile_only_mesh(TARGETS["v5e"], MeshConfig(tensor=tensor))


V5E_SHAPE = (8 * 2048, 32768, 32768, 2048, 2)  # a chunk's tokens, its columns, the vocabulary, width, bf16


def test_off_a_tpu_auto_takes_xla_and_pallas_is_interpreted_or_refused():
    assert choose_kernel("auto", *V5E_SHAPE) == KernelChoice("xla", None, False, "cpu, not a TPU")
    interpreted = choose_kernel("pallas", *V5E_SHAPE)
    assert interpreted == KernelChoice("pallas", HeadTiles(1024, 512), True, "as set, in Pallas interpret mode (cpu)")
    assert choose_kernel("xla", *V5E_SHAPE) == KernelChoice("xla", None, False, "as set")
    with attention_platform("gpu"), pytest.raises(ConfigError, match="is a TPU kernel"):
        choose_kernel("pallas", *V5E_SHAPE)


@needs_libtpu
def test_on_v5e_auto_takes_the_kernel_where_it_beats_xla():
    """On a TPU whose devices hold the whole vocabulary and whose VMEM holds blocks of 512 tokens
    or more (v5e: 1,024 at the benchmark's shape); XLA elsewhere, saying why; `pallas` refused
    where it cannot run."""
    with attention_platform("tpu"):
        mesh = v5e_mesh()
        chosen = choose_kernel("auto", *V5E_SHAPE, mesh)
        assert chosen == KernelChoice(
            "pallas", HeadTiles(1024, 512), False, "a TPU v5 lite, the vocabulary whole on each device"
        )
        llama_8b = (8192, 128256, 128256, 4096, 2)  # 256-token blocks at this vocabulary: XLA
        assert choose_kernel("auto", *llama_8b, mesh).why == (
            "128 MiB of VMEM holds blocks of 256 tokens here, under the 512 that beat XLA"
        )
        assert choose_kernel("pallas", *llama_8b, mesh).tiles == HeadTiles(256, 512)
        assert choose_kernel("auto", 16384, 16384, 32768, 2048, 2, mesh).why == "the mesh splits the vocabulary"
        with pytest.raises(ConfigError, match="needs each device to hold the whole vocabulary"):
            choose_kernel("pallas", 16384, 16384, 32768, 2048, 2, mesh)
        with pytest.raises(ConfigError, match="no block of tokens fits 128 MiB of VMEM"):
            choose_kernel("pallas", 8192, 64 * 2**20, 64 * 2**20, 4096, 2, mesh)


def test_the_config_takes_the_kernel_and_refuses_what_cannot_be():
    assert compose_config("train.loss_head=fused", "train.loss_kernel=pallas").train.head.kernel == "pallas"
    assert compose_config().train.head.kernel == "auto"
    with pytest.raises(ConfigError, match="train.loss_kernel is 'mosaic'; use one of auto, xla, pallas"):
        LossHead("fused", kernel="mosaic")
    with pytest.raises(ConfigError, match="set train.loss_head=fused"):
        LossHead("chunked", kernel="pallas")
    line = pallas(8, 2048, 32768).describe(8, 2048, 32768, 2048)
    assert line.endswith(
        "each chunk by the Pallas kernel, its logits only in VMEM, in blocks of 1,024 tokens "
        "[train.loss_kernel=pallas: as set, in Pallas interpret mode (cpu)]"
    ), line


def test_the_planner_counts_the_kernels_two_matmuls_once_each():
    """The kernel's body holds both walks' matmuls, each run in half its grid's steps
    (`expected_work`): the jaxpr's count is the whole logits' three products."""
    batch, seq, dim, vocab = 2, 64, 32, 1024
    hidden, weight = jnp.ones((batch, seq, dim), jnp.bfloat16), jnp.ones((dim, vocab))
    targets = jnp.zeros((batch, seq), jnp.int32)
    head = LossHead("fused", kernel="pallas")

    def loss(h, w):
        return head(h, OutputHead(w, axes_of(1)), targets)[0]

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, weight)
    assert total_dot_flops(jaxpr.jaxpr) == 3 * 2 * batch * seq * dim * vocab


def test_on_a_mesh_the_kernel_trains_like_xla(tmp_path):
    """8 virtual CPU devices, the batch over data and fsdp (the kernel under shard_map on each
    device's rows, the vocabulary whole): the same losses as XLA's fused head."""
    from tests.run.test_mesh import losses_of, start_mesh_losses

    common = (
        "model=llama_tiny offload=minimal train.steps=3 train.warmup_steps=1 train.log_every=1 "
        "train.compute_dtype=float32 train.global_batch_size=8 train.seq_len=32 train.eval_batches=0 "
        "mesh.data=4 mesh.fsdp=2 checkpoint.final=false train.loss_head=fused train.loss_chunk_mib=0.01"
    )
    xla, kernel = losses_of(
        start_mesh_losses(8, common, ["train.loss_kernel=xla", "train.loss_kernel=pallas"], tmp_path)
    )
    assert len(xla) == 3
    np.testing.assert_allclose(kernel, xla, rtol=1e-5)


@needs_libtpu
def test_on_v5e_the_kernel_is_a_mosaic_call_and_no_logits_are_held():
    """The v5e program (deviceless) of the benchmark's head in one chunk, batch 8 x 2,048, dim
    2,048, vocabulary 32,768: `auto` takes the kernel (a Mosaic custom call), whose cost estimate
    counts its two logits-sized matmuls; XLA runs one more (the weight's gradient), and the
    temporaries hold the logits' gradient in bfloat16 (1 GiB), no float32 logits (2 GiB)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from ferry.xla.hlo_flops import matmul_flops

    mesh = v5e_mesh()
    batch, seq, dim, vocab = 8, 2048, 2048, 32768
    replicated = NamedSharding(mesh, PartitionSpec())
    shapes = ((batch, seq, dim), jnp.bfloat16), ((dim, vocab), jnp.float32), ((batch, seq), jnp.int32)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes]
    head = LossHead("fused", 2048.0)

    def loss(h, w, t):
        return head(h, OutputHead(w, ("embed", "vocab")), t)[0]

    with jax.set_mesh(mesh):
        program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    text = program.as_text()
    assert 'custom_call_target="tpu_custom_call"' in text
    # the kernel's two matmuls by its cost estimate, XLA's one (the weight's gradient) by its own
    assert matmul_flops(text) == 3 * 2 * batch * seq * dim * vocab
    temporaries = program.memory_analysis().temp_size_in_bytes
    assert batch * seq * vocab * 2 <= temporaries < batch * seq * vocab * 4, temporaries / 2**30
