"""`train.adam_moments_dtype`: AdamW's moments stored in bfloat16 between steps, each update
computed in float32 from the stored values, and every byte count that reads the state (the
fits check, the stream's pieces, the verifier's writes) counting two bytes a moment."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ferry.config.train import StatePlacement, TrainConfig
from ferry.errors import ConfigError
from ferry.models.registry import build_model
from ferry.train.memory import StateBytes
from ferry.train.optimizer import make_optimizer
from ferry.train.state_memory import float_params, state_writes
from tests.conftest import load_model_config


def moments(state) -> list[jax.Array]:
    return jax.tree.leaves([optax.tree_utils.tree_get(state, name) for name in ("mu", "nu")])


def widened(state):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)


def test_bfloat16_moments_are_the_float32_update_from_the_stored_values_rounded():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32), "scale": jnp.ones(16)}
    stored = make_optimizer(TrainConfig(steps=10, warmup_steps=1, adam_moments_dtype="bfloat16"))
    full = make_optimizer(TrainConfig(steps=10, warmup_steps=1))
    state = stored.init(params)
    assert {m.dtype for m in moments(state)} == {jnp.dtype(jnp.bfloat16)}
    for _ in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        updates, new_state = stored.update(grads, state, params)
        want_updates, want_state = full.update(grads, widened(state), params)  # float32, from the stored bits
        for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(want_updates), strict=True):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(moments(new_state), moments(want_state), strict=True):
            assert got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))
        params, state = optax.apply_updates(params, updates), new_state


def test_an_unknown_moments_dtype_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"train.adam_moments_dtype='float16': use one of float32, bfloat16"):
        TrainConfig(adam_moments_dtype="float16")


def test_bfloat16_moments_count_two_bytes_each():
    assert StateBytes.of(StatePlacement("host", "device", moments_dtype="bfloat16")) == StateBytes(device=10, host=4)
    assert StateBytes.of(StatePlacement("device", "device", moments_dtype="bfloat16")) == StateBytes(device=14, host=0)
    assert StateBytes.of(StatePlacement("host", "host")) == StateBytes(device=6, host=12)


def test_the_verifier_counts_master_weights_and_bfloat16_moments_as_writes_of_their_own_sizes():
    """Master weights (4 bytes) and bfloat16 moments (2) are no longer one write of one size: each
    leaf's writes are two entries, the moments' half the master weights' bytes."""
    model = eqx.filter_eval_shape(build_model, load_model_config("llama_tiny"), jax.random.key(0))
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), float_params(model))
    together = state_writes(model, StatePlacement("host", "host"), sharding)
    apart = state_writes(model, StatePlacement("host", "host", moments_dtype="bfloat16"), sharding)
    for name, write in together.items():
        where = name.split(":", 1)[1]
        master, moments_write = apart[f"master weights:{where}"], apart[f"AdamW moments:{where}"]
        assert (master.bytes, master.arrays) == (write.bytes, 1)
        assert (moments_write.bytes, moments_write.arrays) == (write.bytes // 2, 2)
