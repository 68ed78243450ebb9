"""DeepSeekMoE: routing against a direct loop, dropless dispatch against dense masking (on one
device and expert-parallel on a mesh), the capacity factor, the per-device size of the expert
buffers, and the auxiliary-loss-free bias update."""

import functools
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from ferry.models.deepseek_v3 import _update_bias
from ferry.nn.moe import DeepSeekMoE, Experts, dropless_moe, route, tile_layout
from ferry.nn.moe.megablox import megablox_matmul
from ferry.offload.engine import record_tags
from ferry.sharding import MESH_AXES, MeshError
from tests.conftest import needs_libtpu, run_python
from tests.moe_reference import dense_moe


def route_by_loop(scores, bias, num_groups, groups_per_token, k, scaling):
    """DeepSeek-V3's rule written out token by token; ties go to the lower index."""
    tokens, experts = scores.shape
    size = experts // num_groups
    all_indices, all_weights = [], []
    for t in range(tokens):
        biased = [float(scores[t, e] + bias[e]) for e in range(experts)]
        group_score = [sum(sorted(biased[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(num_groups)]
        kept = sorted(range(num_groups), key=lambda g: (-group_score[g], g))[:groups_per_token]
        candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda e: (-biased[e], e))[:k]
        total = sum(float(scores[t, e]) for e in chosen)
        all_indices.append(chosen)
        all_weights.append([float(scores[t, e]) / total * scaling for e in chosen])
    return np.array(all_indices), np.array(all_weights)


def assert_same_routing(scores, bias, *args):
    indices, weights = route(jnp.asarray(scores), jnp.asarray(bias), *args)
    want_indices, want_weights = route_by_loop(np.asarray(scores), np.asarray(bias), *args)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-5)


def test_routing_matches_the_loop_on_random_scores():
    rng = np.random.default_rng(0)
    for _ in range(5):
        scores = 1 / (1 + np.exp(-rng.normal(size=(32, 16)))).astype(np.float32)
        bias = (0.1 * rng.normal(size=16)).astype(np.float32)
        assert_same_routing(scores, bias, 4, 2, 4, 2.5)
    scores = 1 / (1 + np.exp(-rng.normal(size=(16, 64)))).astype(np.float32)
    assert_same_routing(scores, np.zeros(64, np.float32), 8, 4, 8, 2.5)


def test_routing_ties_between_groups_go_to_the_lower_group():
    """Groups 1 and 3 score the same and only one can be kept besides the best group 0."""
    scores = np.full((2, 16), 0.1, np.float32)
    scores[:, 0:2] = 0.9  # group 0 best
    scores[:, 4:6] = 0.6  # group 1
    scores[:, 12:14] = 0.6  # group 3, tied with group 1
    indices, _ = route(jnp.asarray(scores), jnp.zeros(16), 4, 2, 4, 2.5)
    assert set(np.asarray(indices[0]).tolist()) == {0, 1, 4, 5}
    assert_same_routing(scores, np.zeros(16, np.float32), 4, 2, 4, 2.5)


def test_bias_selects_but_does_not_weight():
    scores = np.array([[0.9, 0.8, 0.2, 0.1]], np.float32)
    bias = np.array([0.0, 0.0, 1.0, 0.0], np.float32)
    indices, weights = route(jnp.asarray(scores), jnp.asarray(bias), 2, 2, 2, 1.0)
    assert sorted(np.asarray(indices[0]).tolist()) == [0, 2]
    np.testing.assert_allclose(sorted(np.asarray(weights[0])), sorted([0.9 / 1.1, 0.2 / 1.1]), rtol=1e-6)


def random_problem(tokens=48, experts=8, k=2, dim=16, hidden=24, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (tokens, dim))
    scores = jax.nn.sigmoid(jax.random.normal(keys[1], (tokens, experts)))
    indices, weights = route(scores, jnp.zeros(experts), 2, 2, k, 2.5)
    return x, indices, weights, Experts(experts, dim, hidden, key=keys[2], std=0.3)


GROUPED_MATMULS = pytest.mark.parametrize(
    "matmul",
    [{"kernel": "ragged_dot"}, {"kernel": "megablox"}, {"tile_rows": 1}, {"tile_rows": 8}, {"tile_rows": 64}],
    ids=lambda m: f"tiles{m['tile_rows']}" if "tile_rows" in m else m["kernel"],
)  # megablox: its CPU path (the reference), through its custom VJP; the kernels themselves below


@GROUPED_MATMULS
def test_dropless_dispatch_equals_dense_masking(matmul):
    x, indices, weights, experts = random_problem()
    np.testing.assert_allclose(
        dropless_moe(x, indices, weights, experts, **matmul),
        dense_moe(x, indices, weights, experts),
        rtol=1e-5,
        atol=1e-6,
    )


@GROUPED_MATMULS
def test_dropless_gradients_equal_dense_masking(matmul):
    """In float64: expert gradients sum over every routed token and reach ~30, where float32's
    different summation orders (grouped vs dense) alone differ by ~1e-5."""
    with jax.enable_x64(True):
        x, indices, weights, experts = jax.tree.map(
            lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, random_problem()
        )
        cotangent = jax.random.normal(jax.random.key(9), x.shape, jnp.float64)
        grad_sparse = jax.grad(lambda e: jnp.sum(dropless_moe(x, indices, weights, e, **matmul) * cotangent))(experts)
        grad_dense = jax.grad(lambda e: jnp.sum(dense_moe(x, indices, weights, e) * cotangent))(experts)
        for a, b in zip(jax.tree.leaves(grad_sparse), jax.tree.leaves(grad_dense), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def kept_by_queue(indices, weights, num_experts, capacity):
    """The routing weights with every slot past `capacity` in its expert's queue (token by token,
    slot by slot) set to zero."""
    kept = np.array(weights)
    seen = np.zeros(num_experts, int)
    for t in range(indices.shape[0]):
        for s in range(indices.shape[1]):
            e = int(indices[t, s])
            if seen[e] >= capacity:
                kept[t, s] = 0.0
            seen[e] += 1
    return kept


@GROUPED_MATMULS
def test_capacity_factor_drops_late_slots_per_expert(matmul):
    x, indices, weights, experts = random_problem()
    tokens, k = indices.shape
    num_experts = experts.gate.shape[0]
    generous = dropless_moe(x, indices, weights, experts, capacity_factor=float(num_experts), **matmul)
    np.testing.assert_array_equal(generous, dropless_moe(x, indices, weights, experts, **matmul))

    capacity_factor = 0.5
    kept_weights = kept_by_queue(indices, weights, num_experts, -(-int(capacity_factor * tokens * k) // num_experts))
    assert (kept_weights == 0).any()
    np.testing.assert_allclose(
        dropless_moe(x, indices, weights, experts, capacity_factor=capacity_factor, **matmul),
        dense_moe(x, indices, jnp.asarray(kept_weights), experts),
        rtol=1e-5,
        atol=1e-6,
    )


def float64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def gradients(moe, x, indices, weights, experts, cotangent):
    """Gradients of <moe(...), cotangent> with respect to the tokens, routing weights and experts."""
    return jax.grad(lambda x, w, e: jnp.sum(moe(x, indices, w, e) * cotangent), (0, 1, 2))(x, weights, experts)


# (tile_rows, tag_capacity_factor, kernel) of the ring checks: the tiled ring with and without tag
# capacity and ragged_dot's in CI; megablox's and one-row tiles' local products, which the
# one-device tests above check against dense masking, in the ring only in the slow run
RING_CASES = ((None, 1.0, "ragged_dot"), (8, 1.0, None), (8, None, None))
SLOW_RING_CASES = ((None, 1.0, "megablox"), (1, 1.0, None))


def check_expert_parallel_equals_dense(cases=RING_CASES):
    """Run in a process of 8 CPU devices (`test_expert_parallel_ring_equals_dense_masking`): on
    a mesh of fsdp 2 x expert 4, the ring's values, capacity drops and float64 gradients (of the
    tokens, the routing weights and the experts) equal dense masking's on one device, with the
    untagged rows of each step (past a balanced load) computed apart or not."""
    mesh = jax.make_mesh((1, 2, 1, 4), MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    x, indices, weights, experts = random_problem()
    num_experts, group_tokens = experts.gate.shape[0], x.shape[0] // 2  # an expert group's tokens
    capacity_factor = 0.5
    capacity = -(-int(capacity_factor * group_tokens * indices.shape[1]) // num_experts)
    kept = np.concatenate(
        [
            kept_by_queue(indices[g : g + group_tokens], weights[g : g + group_tokens], num_experts, capacity)
            for g in range(0, x.shape[0], group_tokens)
        ]
    )
    assert (kept == 0).any()
    want, want_dropping = dense_moe(x, indices, weights, experts), dense_moe(x, indices, jnp.asarray(kept), experts)
    with jax.enable_x64(True):
        problem64 = (
            *float64((x, indices, weights, experts)),
            jax.random.normal(jax.random.key(9), x.shape, jnp.float64),
        )
        want_grads = gradients(dense_moe, *problem64)
    for tile_rows, tag_capacity_factor, kernel in cases:
        moe = functools.partial(
            dropless_moe, tile_rows=tile_rows, tag_capacity_factor=tag_capacity_factor, kernel=kernel or "ragged_dot"
        )
        dropping = functools.partial(moe, capacity_factor=capacity_factor)
        with jax.set_mesh(mesh):
            got, got_dropping = (
                jax.jit(moe)(x, indices, weights, experts),
                jax.jit(dropping)(x, indices, weights, experts),
            )
            with jax.enable_x64(True):
                got_grads = jax.jit(functools.partial(gradients, moe))(*problem64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_dropping, want_dropping, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cases", ["RING_CASES", pytest.param("SLOW_RING_CASES", marks=pytest.mark.slow)])
def test_expert_parallel_ring_equals_dense_masking(cases):
    code = (
        "from ferry.platform import PlatformConfig, apply_platform; "
        "apply_platform(PlatformConfig('cpu', cpu_devices=8)); "
        f"from tests.models.test_moe import {cases}, check_expert_parallel_equals_dense; "
        f"check_expert_parallel_equals_dense({cases})"
    )
    result = run_python(code, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def recorded_tags(moe, *args):
    """The (name, shape) of every tag `moe(*args)` passes, found abstractly."""
    tags = []

    def record(*args):
        out, values = record_tags(moe, *args)
        tags.extend((name, value.shape) for name, value in values)
        return out

    jax.eval_shape(record, *args)
    return tags


@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("tag_capacity_factor", [None, 1.0])
def test_expert_buffers_per_device_hold_one_devices_slots_whatever_the_group(group, tag_capacity_factor):
    """Each ring step's expert products hold, per device, at most the slots of one device's
    tokens (all routed here): the group size multiplies the steps, not a buffer (gathering the
    group's tokens would make every buffer group x larger). Of each step, the rows a balanced
    router would send (times `tag_capacity_factor`) are tagged, so what an offload policy saves
    of a layer is about one device's slots, not group x as many."""
    devices, tokens_per_device, k, dim, hidden = 8, 16, 2, 16, 24
    mesh = AbstractMesh((1, devices // group, 1, group), MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    _, indices, weights, experts = random_problem(tokens=devices * tokens_per_device, k=k, dim=dim, hidden=hidden)
    x = jax.ShapeDtypeStruct((devices * tokens_per_device, dim), jnp.float32)
    moe = functools.partial(dropless_moe, tile_rows=8, tag_capacity_factor=tag_capacity_factor)
    with jax.sharding.use_abstract_mesh(mesh):
        tags = recorded_tags(moe, x, indices, weights, experts)
    rows = tokens_per_device * k if tag_capacity_factor is None else tokens_per_device * k // group
    shapes = [(devices * rows, hidden), (devices * rows, hidden), (devices * rows, dim)]  # rows per device
    assert tags == list(zip(["moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"] * group, shapes * group, strict=True))


@pytest.mark.parametrize(
    "tile_rows",
    [None, 8, pytest.param(1, marks=pytest.mark.slow), pytest.param(64, marks=pytest.mark.slow)],
    ids=lambda t: f"tiles{t}" if t else "ragged_dot",
)  # windows do not depend on the tile size: tiles of 1 and 64 rows are covered by the tests above
def test_rows_past_the_tag_capacity_are_computed_untagged(tile_rows):
    """With a tag capacity below the slots, the tagged products cover the first rows only and
    the rest is computed apart: values and float64 gradients still equal dense masking's."""
    x, indices, weights, experts = random_problem()
    moe = functools.partial(dropless_moe, tile_rows=tile_rows, tag_capacity_factor=0.3)
    tagged = int(0.3 * indices.size)  # one device: int(factor x tokens x k) rows
    assert [shape[0] for _, shape in recorded_tags(moe, x, indices, weights, experts)] == [tagged] * 3
    np.testing.assert_allclose(
        moe(x, indices, weights, experts), dense_moe(x, indices, weights, experts), rtol=1e-5, atol=1e-6
    )
    with jax.enable_x64(True):
        problem64 = (
            *float64((x, indices, weights, experts)),
            jax.random.normal(jax.random.key(9), x.shape, jnp.float64),
        )
        for a, b in zip(
            jax.tree.leaves(gradients(moe, *problem64)), jax.tree.leaves(gradients(dense_moe, *problem64)), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_bias_update_balances_a_skewed_router():
    moe = DeepSeekMoE(16, 8, 8, 1, 2, 2, 2, 2.5, None, key=jax.random.key(0))
    skew = jnp.zeros((16, 8)).at[:, :2].set(0.5)  # experts 0 and 1 win for most tokens
    moe = eqx.tree_at(lambda m: m.router, moe, moe.router + skew)
    x = jax.random.normal(jax.random.key(1), (4, 32, 16)) + 1.0

    @eqx.filter_jit
    def update(moe):
        _, stats = moe(x)
        return _update_bias(moe, stats.expert_load, 0.01), stats.expert_load

    def cv(load):
        return float(jnp.std(load) / jnp.mean(load))

    moe, first_load = update(moe)
    for _ in range(100):
        moe, load = update(moe)
    assert cv(first_load) > 0.5
    assert cv(load) < 0.5 * cv(first_load)
    overloaded = np.argmax(np.asarray(first_load))
    assert float(moe.correction_bias[overloaded]) < 0


def test_tile_layout_gives_each_tile_one_expert():
    group_sizes = jnp.array([5, 0, 9, 1], jnp.int32)
    layout = tile_layout(group_sizes, 15, 4)
    # Experts padded to 8, 0, 12, 4 rows: tiles 0-1 expert 0, 2-4 expert 2, 5 expert 3.
    np.testing.assert_array_equal(np.asarray(layout.tile_expert)[:6], [0, 0, 2, 2, 2, 3])
    assert layout.tile_expert.shape[0] == -(-15 // 4) + 4
    pad = 15  # padded positions hold no row
    expected_rows = [*range(5), *[pad] * 3, *range(5, 14), *[pad] * 3, 14, *[pad] * 3]
    np.testing.assert_array_equal(np.asarray(layout.row)[:24], expected_rows)
    assert (np.asarray(layout.row)[24:] == pad).all()


def test_megablox_kernels_equal_the_reference_with_rows_past_the_groups():
    """The Pallas kernels themselves (interpret mode on the CPU): the forward product, the input
    gradient (`gmm` on the transposed weights) and the weight gradient (`tgmm`) equal
    `ragged_dot`'s, an empty group included; rows past the groups give zeros both ways."""
    keys = jax.random.split(jax.random.key(0), 3)
    rows, dim, hidden = 40, 16, 24
    x, g = jax.random.normal(keys[0], (rows, dim)), jax.random.normal(keys[1], (rows, hidden))
    w = jax.random.normal(keys[2], (4, dim, hidden))
    group_sizes = jnp.array([10, 0, 17, 9], jnp.int32)  # 36 of the 40 rows
    y, pullback = jax.vjp(lambda x, w: megablox_matmul(x, w, group_sizes, True), x, w)
    want, want_pullback = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, group_sizes), x, w)
    for got, expected in zip((y, *pullback(g)), (want, *want_pullback(g)), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert not np.asarray(y[36:]).any() and not np.asarray(pullback(g)[0][36:]).any()


@pytest.mark.slow  # minutes of compiling at full width; the kernels' and tiles' counts are covered by test_hlo_stats
@pytest.mark.parametrize(("target", "matmul"), [("v5p", {"kernel": "megablox"}), ("h200", {"tile_rows": 8})])
def test_a_deepseek_v3_width_moe_layer_costs_its_routed_rows(target, matmul):
    """One MoE layer at DeepSeek-V3's width (256 experts of 7168 x 2048, top-8, the shared
    expert), 2048 tokens on one device, compiled with its backward pass for v5p (megablox) and
    for H200 (tiles of 8 rows: XLA:GPU expands `ragged_dot` and its transposes into all 256
    experts on every row): the matmul FLOPs of the compiled program are within 1.15x of 6 x
    routed rows x 3 x 7168 x 2048 plus the shared expert's and the router's. Parameters are
    shapes only; nothing is allocated."""
    from jax.sharding import SingleDeviceSharding

    from ferry.xla.hlo_flops import matmul_flops
    from ferry.xla.targets import TARGETS

    experts, dim, hidden, k, tokens = 256, 7168, 2048, 8, 2048
    device = TARGETS[target]
    sharding = SingleDeviceSharding(device.devices(4 if device.platform == "tpu" else 1)[0])
    tile_rows, kernel = matmul.get("tile_rows"), matmul.get("kernel", "ragged_dot")
    moe = eqx.filter_eval_shape(
        lambda: DeepSeekMoE(dim, hidden, experts, 1, 8, 4, k, 2.5, None, tile_rows, None, kernel, key=jax.random.key(0))
    )
    params, static = eqx.partition(moe, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), params)
    x = jax.ShapeDtypeStruct((1, tokens, dim), jnp.bfloat16, sharding=sharding)

    def loss(params, x):
        compute = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim > 1 else a, params)
        out, stats = eqx.combine(compute, static)(x)
        return jnp.sum(jnp.square(out.astype(jnp.float32))) + stats.balance_loss

    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(params, x).compile(device.compile_options({})).as_text()
    routed = 6 * tokens * k * 3 * dim * hidden
    shared_and_router = 6 * tokens * 3 * dim * hidden + 6 * tokens * dim * experts
    assert routed + shared_and_router <= matmul_flops(hlo) <= 1.15 * (routed + shared_and_router)


def test_megablox_refuses_a_mesh_whose_tensor_axis_would_replicate_the_experts_operands():
    """Megablox's `shard_map` runs unchecked, sound only where every axis splits its operands."""
    mesh = AbstractMesh((1, 4, 2, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 4)
    _, indices, weights, experts = random_problem(tokens=64)
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32)
    moe = functools.partial(dropless_moe, kernel="megablox")
    with jax.sharding.use_abstract_mesh(mesh), pytest.raises(MeshError, match="tensor=2.*moe_matmul=ragged_dot"):
        jax.eval_shape(moe, x, indices, weights, experts)


def test_moe_benchmark_runs_on_tiny_shapes_in_interpret_mode(tmp_path, capsys):
    """benchmarks/moe_tpu.py's own entry point, off a TPU (interpret mode, tiny widths: its
    timings mean nothing here; every tile's gradients must still equal ragged_dot's)."""
    from benchmarks.moe_tpu import main

    out = tmp_path / "moe.json"
    argv = ["--tokens", "64", "--experts", "4", "--top-k", "2", "--dim", "256", "--hidden", "128"]
    argv += ["--tiles", "64,128,128", "128,128,128", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["interpret"] and sum(report["group_sizes"]) == 64 * 2
    for label in ("up", "down"):
        product = report["products"][label]
        assert set(product["results"]) == {"ragged_dot", "megablox_64x128x128", "megablox_128x128x128"}
        assert product["best"] in ("megablox_64x128x128", "megablox_128x128x128")
        for result in product["results"].values():
            # bfloat16 operands and outputs: within half a bfloat16 ulp (2^-8) of the largest gradient
            assert result["ms"] > 0 and result["gradient_difference"] <= 2**-8
    assert "fastest tile" in capsys.readouterr().out


def _tpu_kernels(hlo: str) -> list[str]:
    """The Mosaic kernels a compiled TPU program calls, as their serialized bodies (which hold
    each kernel's block shapes)."""
    lines = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    return [re.search(r'"body":"([^"]*)"', line).group(1) for line in lines]


@needs_libtpu
def test_a_v5e_program_at_deepseek_widths_runs_the_tile_measured_for_them():
    """Deviceless, for a v5e: the gradient kernels of an expert product 2048 -> 7168 (DeepSeek-V3's
    `down`) are compiled with TUNED's tile, not MaxText's default."""
    from ferry.nn.moe.megablox import TILING, TUNED
    from tests.xla.test_hlo_stats import compiled_text

    shapes = (((512, 2048), "bfloat16"), ((2, 2048, 7168), "bfloat16"), ((2,), "int32"))

    def kernels(tile):
        loss = lambda x, w, sizes: jnp.sum(megablox_matmul(x, w, sizes, False, tile).astype(jnp.float32))
        return _tpu_kernels(compiled_text("v5e", jax.grad(loss, (0, 1)), *shapes))

    chosen = kernels(None)
    assert len(chosen) == 2  # the input and the weight gradient (the forward's output is unused)
    assert TUNED[2048, 7168] != TILING
    assert chosen == kernels(TUNED[2048, 7168]) and chosen != kernels(TILING)
