"""The engine outside a layer scan, as XLA's GPU compiler builds it (a deviceless H200): the
replay barrier lets remat free memory, and host copies that no loop carries are kept."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from ferry.models.dense import dense_decoder_layer
from ferry.offload.engine import Policy, offloaded
from ferry.xla.hlo_host_copies import host_copies
from ferry.xla.targets import TARGETS
from tests.conftest import GPU_FLAGS, load_model_config, needs_cuda_plugin

pytestmark = needs_cuda_plugin
H200 = TARGETS["h200"]
MINIMAL = {"query_proj": "offload", "key_proj": "offload", "value_proj": "offload", "attention_out": "offload"}
MINIMAL |= {"out_proj": "offload", "mlpwi_0": "offload", "mlpwi_1": "offload", "mlpwo": "offload"}


@functools.cache  # the tests share compiles (save_all's most of all)
def compile_one_layer(policy: Policy, num_layers: int = 1):
    """Memory of the gradient of `num_layers` llama_tiny decoder layers run one after another (no
    scan) and an output head (so the layers' residuals wait while the head runs, as an MTP block's
    do), compiled for an H200 without one."""
    config = load_model_config("llama_tiny")
    layer = dense_decoder_layer(config, key=jax.random.key(0))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.Array) else a, layer)
    x = jax.ShapeDtypeStruct((8, 512, config.dim), jnp.float32)
    head = jax.ShapeDtypeStruct((config.dim, 2048), jnp.float32)
    mesh = Mesh(np.array(H200.devices(1)), ("data",))
    run = offloaded(lambda block, h: block(h).hidden, policy)

    def loss(block, h, w):
        for _ in range(num_layers):
            h = run(block, h)
        return jnp.sum(jax.nn.logsumexp(h @ w, axis=-1))

    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(params, x, head)
        return lowered.compile(GPU_FLAGS)


@pytest.mark.parametrize(
    # one layer alone is the same barrier in a smaller margin (slow: 40 s more)
    ("num_layers", "ratio"),
    [(3, 0.6), pytest.param(1, 0.95, marks=pytest.mark.slow)],
)
def test_remat_frees_memory_outside_a_scan(num_layers, ratio):
    """Without the barrier XLA merges the replay with the forward pass of an unscanned layer and
    full_remat needs as much as save_all; with it, the layer's activations are recomputed
    (measured 129.1 vs 279.2 MiB for 3 layers, 103.2 vs 115.1 MiB for one)."""
    save_all = compile_one_layer(Policy.save_all(), num_layers=num_layers).memory_analysis().temp_size_in_bytes
    full_remat = compile_one_layer(Policy({}), num_layers=num_layers).memory_analysis().temp_size_in_bytes
    assert full_remat < ratio * save_all


def test_remat_without_the_barrier_saves_nothing(monkeypatch):
    """The counterfactual that makes the barrier necessary (so the test above can fail)."""
    save_all = compile_one_layer(Policy.save_all(), num_layers=3).memory_analysis().temp_size_in_bytes
    monkeypatch.setattr(jax.lax, "optimization_barrier", lambda values: values)
    unbarred = compile_one_layer.__wrapped__(Policy({}), num_layers=3)  # a fresh compile, not the cached one
    assert unbarred.memory_analysis().temp_size_in_bytes >= save_all


def test_unscanned_layers_keep_their_host_copies():
    """XLA:GPU folds a copy to host that is read straight back when no loop carries it; the engine
    ties the copies to the layer's output so they stay: every offloaded tensor of every layer
    crosses the link both ways, but mlpwo, which only joins the residual stream: the backward pass
    never reads it, so XLA drops its copy (as inside a scan)."""
    offloaded_bytes = 8 * 512 * 4 * (64 + 32 + 32 + 64 + 64 + 192 + 192)  # q k v context out wi_0 wi_1, f32
    for num_layers in (1, 2):
        copies = host_copies(compile_one_layer(Policy(MINIMAL), num_layers).as_text())
        for direction in ("to host", "to device"):
            moved = [c for c in copies if c.direction == direction]
            assert len(moved) == 7 * num_layers
            assert sum(c.bytes * c.executions for c in moved) == num_layers * offloaded_bytes
