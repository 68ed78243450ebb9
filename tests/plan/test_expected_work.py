"""Work a program's static shape overstates (a dropless MoE's tiles, sized as if every slot a
device sees routed to its own experts) is counted as it runs where the model marks it
(`ferry.xla.expected_work`): in the compiled program, in the jaxpr auto prices, and in the plan."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ferry.plan.planner import compile_only_mesh
from ferry.plan.replay import total_dot_flops
from ferry.sharding import MeshConfig
from ferry.xla.expected_work import expected_fraction, expected_work
from ferry.xla.hlo_flops import matmul_count, matmul_flops
from ferry.xla.targets import TARGETS
from tests.conftest import GPU_FLAGS, needs_cuda_plugin, needs_libtpu
from tests.xla.test_scheduler_costs import planned

H200 = TARGETS["h200"]
ROWS, DIM = 64, 128
PRODUCT = 2.0 * ROWS * DIM * DIM  # one tile's matmul FLOPs


def two_walks(x, w, active):
    """Two loops of 8 tiles with identical bodies, each tile's product skipped at run time past the
    `active` tiles, marked as running 3 and 0 of their tiles (a MoE's tagged rows and the rest):
    XLA gives the second loop a clone of the first one's body, op names and all, so only the
    loops themselves say which is which."""

    def walk(tiles: int, runs: int, h):
        def one_tile(carry, tile):
            product = lambda: carry @ w
            return jax.lax.cond(tile < active, product, lambda: carry), None

        with expected_work(runs, tiles):
            return jax.lax.scan(one_tile, h, jnp.arange(tiles))[0]

    return walk(8, 3, x) + walk(8, 0, 2 * x)


def test_a_scope_says_what_share_of_its_work_runs():
    assert expected_fraction("jit(step)/ferry_runs_3_of_8/while") == pytest.approx(3 / 8)
    assert expected_fraction("jit(step)/ferry_runs_1_of_2/ferry_runs_1_of_4/dot") == pytest.approx(1 / 8)
    assert expected_fraction("jit(step)/while/body/dot_general") == 1.0
    with pytest.raises(ValueError, match="runs <= of"):
        expected_work(9, 8)


def test_auto_counts_the_marked_loops_work_as_it_runs_in_the_jaxpr():
    x, w = jax.ShapeDtypeStruct((ROWS, DIM), jnp.float32), jax.ShapeDtypeStruct((DIM, DIM), jnp.float32)
    jaxpr = jax.make_jaxpr(two_walks)(x, w, jax.ShapeDtypeStruct((), jnp.int32)).jaxpr
    assert total_dot_flops(jaxpr) == pytest.approx(3 * PRODUCT)


@needs_cuda_plugin
def test_the_compiled_programs_marked_loops_count_the_tiles_that_run():
    """Compiled for an H200: the two loops' products carry one op name, the first loop's (XLA
    shares one fused product between the bodies); the loops' own op names tell them apart. The
    static count (every tile's product) stays the upper bound; the program holds 16 products."""
    mesh = compile_only_mesh(H200, MeshConfig())
    on_device = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct((ROWS, DIM), jnp.bfloat16, sharding=on_device)
    w = jax.ShapeDtypeStruct((DIM, DIM), jnp.bfloat16, sharding=on_device)
    active = jax.ShapeDtypeStruct((), jnp.int32, sharding=on_device)
    with jax.set_mesh(mesh):
        hlo = jax.jit(two_walks).lower(x, w, active).compile(GPU_FLAGS).as_text()
    loops = [line for line in hlo.splitlines() if " while(" in line]
    products = [line for line in hlo.splitlines() if " dot(" in line or "__cublas" in line]
    op_name = lambda line: re.search(r'op_name="([^"]*)"', line)[1]
    assert len({op_name(line) for line in loops}) == 2 and len({op_name(line) for line in products}) == 1
    assert matmul_flops(hlo) == pytest.approx(3 * PRODUCT)
    assert matmul_flops(hlo, bound=True) == pytest.approx(16 * PRODUCT)
    assert matmul_count(hlo) == 16


@needs_cuda_plugin
def test_expert_parallelism_moves_the_experts_work_and_adds_none():
    """deepseek_v3_tiny's step on 8 H200s: FSDP over all 8 runs each device's slots on all 16
    experts; an expert group of 8 runs a ring whose every step is sized for all of a device's
    slots routed to this device's experts. With the router balanced, both layouts run the same
    tiles per device: the plans' matmul FLOPs are equal to the FLOP, while the ring's static count
    (its worst case, an upper bound) is several times that. One dense and one MoE layer, no MTP."""
    common = ("train.seq_len=64", "train.global_batch_size=8", "model.num_layers=2", "model.mtp_depth=0")
    fsdp, group = (
        planned("deepseek_v3_tiny", "save_all", *common, *mesh) for mesh in (("mesh.fsdp=8",), ("mesh.expert=8",))
    )
    assert fsdp.flops == group.flops
    assert fsdp.flops < fsdp.flops_bound < group.flops_bound
    # the ring's worst case against what runs: 2.89x with one dense and one MoE layer (the dense
    # layer, attention and the head are counted once in both); 3.5x with two MoE layers and MTP
    assert group.flops_bound > 2.5 * group.flops


def splash_forward_jaxpr(kernel, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int):
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.bfloat16)
    return jax.make_jaxpr(lambda q, k, v: kernel.forward(q, k, v, 0.1, None))(q, kv, kv).jaxpr


@pytest.mark.parametrize(("block", "computed"), [(1024, 3 / 4), (512, 10 / 16)])
def test_a_kernels_work_is_its_grid_and_splash_counts_the_causal_blocks(block, computed):
    """A Pallas kernel's body is one block's work, run once per point of its grid (before, splash
    attention's forward counted as one block: 0.5 of its 34 GFLOP at this shape). Splash computes
    the block pairs the causal mask leaves a query (3 of 2 x 2 blocks of 1024 at seq 2048, 10 of
    4 x 4 of 512), each whole: that share of both products, q k^T and p v, over every pair."""
    from ferry.nn.kernels.splash import SplashAttention

    batch, seq, heads, kv_heads, head_dim = 2, 2048, 16, 8, 128
    jaxpr = splash_forward_jaxpr(SplashAttention(block=block), batch, seq, heads, kv_heads, head_dim)
    every_pair = 2 * (2.0 * batch * heads * seq * seq * head_dim)
    assert total_dot_flops(jaxpr) == pytest.approx(computed * every_pair)


@needs_libtpu
def test_auto_prices_rematerialising_splashs_output_by_the_forward_kernel_it_reruns():
    """On a TPU target the attention is splash's kernel: rematerialising `attention_out` runs its
    forward again in the backward pass, which auto now counts (it counted one block's work, about
    nothing, so at batch 16 of the v5e shape it kept choosing the attention output to recompute)."""
    from ferry.models.registry import abstract_model
    from ferry.nn.kernels.splash import SplashAttention
    from ferry.plan.auto import tensor_costs
    from ferry.plan.planner import for_target
    from tests.conftest import compose_config

    v5e = TARGETS["v5e"]
    config = compose_config(
        "model=llama_tiny", "train.seq_len=256", "train.global_batch_size=2", "mode=plan", "target=v5e"
    )
    costs, _ = tensor_costs(config, v5e, compile_only_mesh(v5e, config.mesh))
    model = for_target(config.model, v5e)
    kernel = splash_forward_jaxpr(SplashAttention(), 2, 256, model.num_heads, model.num_kv_heads, model.head_dim)
    assert abstract_model(model).config.attention in ("auto", "splash")
    assert costs["attention_out"].recompute_flops == pytest.approx(model.num_layers * total_dot_flops(kernel))
    assert costs["attention_out"].recompute_flops > 0
