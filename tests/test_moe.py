"""DeepSeekMoE: routing against a direct loop, dropless dispatch against dense masking, the
capacity factor, and the auxiliary-loss-free bias update."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.models.deepseek_v3 import _update_bias
from ferry.nn.moe import DeepSeekMoE, Experts, dense_moe, dropless_moe, route, tile_layout


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
    "tile_rows", [None, 1, 8, 64], ids=lambda t: f"tiles{t}" if t else "ragged_dot"
)


@GROUPED_MATMULS
def test_dropless_dispatch_equals_dense_masking(tile_rows):
    x, indices, weights, experts = random_problem()
    np.testing.assert_allclose(
        dropless_moe(x, indices, weights, experts, tile_rows=tile_rows),
        dense_moe(x, indices, weights, experts),
        rtol=1e-5,
        atol=1e-6,
    )


@GROUPED_MATMULS
def test_dropless_gradients_equal_dense_masking(tile_rows):
    """In float64: expert gradients sum over every routed token and reach ~30, where float32's
    different summation orders (grouped vs dense) alone differ by ~1e-5."""
    with jax.enable_x64(True):
        x, indices, weights, experts = jax.tree.map(
            lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, random_problem()
        )
        cotangent = jax.random.normal(jax.random.key(9), x.shape, jnp.float64)
        grad_sparse = jax.grad(
            lambda e: jnp.sum(dropless_moe(x, indices, weights, e, tile_rows=tile_rows) * cotangent)
        )(experts)
        grad_dense = jax.grad(lambda e: jnp.sum(dense_moe(x, indices, weights, e) * cotangent))(experts)
        for a, b in zip(jax.tree.leaves(grad_sparse), jax.tree.leaves(grad_dense), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@GROUPED_MATMULS
def test_capacity_factor_drops_late_slots_per_expert(tile_rows):
    x, indices, weights, experts = random_problem()
    tokens, k = indices.shape
    num_experts = experts.gate.shape[0]
    generous = dropless_moe(x, indices, weights, experts, capacity_factor=float(num_experts), tile_rows=tile_rows)
    np.testing.assert_array_equal(generous, dropless_moe(x, indices, weights, experts, tile_rows=tile_rows))

    capacity_factor = 0.5
    capacity = -(-int(capacity_factor * tokens * k) // num_experts)
    kept_weights = np.array(weights)
    seen = np.zeros(num_experts, int)
    for t in range(tokens):  # queue order: token by token, slot by slot
        for s in range(k):
            e = int(indices[t, s])
            if seen[e] >= capacity:
                kept_weights[t, s] = 0.0
            seen[e] += 1
    assert (kept_weights == 0).any()
    np.testing.assert_allclose(
        dropless_moe(x, indices, weights, experts, capacity_factor=capacity_factor, tile_rows=tile_rows),
        dense_moe(x, indices, jnp.asarray(kept_weights), experts),
        rtol=1e-5,
        atol=1e-6,
    )


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
    np.testing.assert_array_equal(np.asarray(layout.destination), [0, 1, 2, 3, 4, *range(8, 17), 20])
    assert layout.tile_expert.shape[0] == -(-15 // 4) + 4
