"""Work a program's static shape overstates (a dropless MoE's tiles, sized as if every slot a
device sees routed to its own experts) is counted as it runs where the model marks it
(`ferry.expected_work`): in the compiled program, in the jaxpr auto prices, and in the plan."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ferry.expected_work import expected_fraction, expected_work
from ferry.plan.planner import compile_only_mesh
from ferry.plan.replay import total_dot_flops
from ferry.sharding import MeshConfig
from ferry.xla.hlo_flops import matmul_count, matmul_flops
from ferry.xla.targets import TARGETS
from tests.conftest import GPU_FLAGS, needs_cuda_plugin
from tests.test_scheduler_costs import planned

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
