"""Document-aware packing (data.document_mask): segment ids and positions from the end-of-document
ids, and attention over packed documents (grouped-query, chunked, MLA) equal to attention run on
each document alone, values and gradients."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ferry.data.segments import DocumentMask, document_segments
from ferry.models.registry import build_model
from ferry.nn.attention import causal_attention, grouped_query_attention
from ferry.nn.mla import MultiHeadLatentAttention
from ferry.nn.rope import Llama3RopeScaling, YarnScaling
from ferry.offload.engine import SAVE_ALL
from tests.conftest import load_model_config, preset_policy

EOD = 0
# one row of 13 tokens: the end of a document begun before the window (3 tokens and its end id),
# a whole document of 5, and the start of one more (4 tokens, unfinished)
ROW = np.array([7, 8, 9, EOD, 4, 5, 6, 7, EOD, 1, 2, 3, 4])
DOCUMENTS = [slice(0, 4), slice(4, 9), slice(9, 13)]


def test_segment_ids_and_positions_restart_after_each_end_of_document():
    tokens = jnp.asarray(np.stack([ROW, np.arange(1, 14)]))  # the second row: no end id, one segment
    segment_ids, positions = document_segments(tokens, EOD)
    np.testing.assert_array_equal(segment_ids[0], [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(positions[0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3])
    np.testing.assert_array_equal(segment_ids[1], np.zeros(13))
    np.testing.assert_array_equal(positions[1], np.arange(13))


def slice_all(inputs, document):
    return jax.tree.map(lambda a: a[:, document], inputs)


def packed_and_alone(run, inputs, cotangent, cut=slice_all):
    """`run(inputs, segments)` on the packed row, and on each document alone (no segments;
    `cut(inputs, document)` its inputs) concatenated; with the gradients of <output, cotangent>
    for both."""
    segments = document_segments(jnp.asarray(ROW[None]), EOD)

    def packed(x):
        return run(x, segments)

    def alone(x):
        return jnp.concatenate([run(cut(x, d), None) for d in DOCUMENTS], axis=1)

    results = []
    for fn in (packed, alone):
        out, vjp = jax.vjp(fn, inputs)
        results.append((out, vjp(cotangent)[0]))
    return results


@pytest.mark.parametrize("query_chunk", [512, 4, 5])  # whole; chunked; chunked with padded queries
def test_attention_over_packed_documents_equals_each_document_alone(query_chunk):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, 13, 4, 8))
    k = jax.random.normal(keys[1], (1, 13, 2, 8))
    v = jax.random.normal(keys[2], (1, 13, 2, 8))
    cotangent = jax.random.normal(keys[3], (1, 13, 4, 8))

    def run(qkv, segments):
        ids = None if segments is None else segments[0]
        return causal_attention(*qkv, scale=0.3, query_chunk=query_chunk, segment_ids=ids)

    (packed, packed_grads), (alone, alone_grads) = packed_and_alone(run, (q, k, v), cotangent)
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-6)
    for a, b in zip(packed_grads, alone_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    unmasked = causal_attention(q, k, v, scale=0.3, query_chunk=query_chunk)
    assert not np.allclose(unmasked[:, 4:], alone[:, 4:], atol=1e-3)  # the mask does something


@pytest.mark.parametrize("kind", ["grouped_query", "latent"])
def test_attention_modules_restart_rotary_positions_in_each_document(kind):
    key = jax.random.key(1)
    if kind == "grouped_query":
        module = grouped_query_attention(32, 4, 2, 8, 500000.0, Llama3RopeScaling(original_max_position=16), key=key)
    else:
        module = MultiHeadLatentAttention(32, 4, 16, 8, 8, 4, 8, 10000.0, YarnScaling(), 1e-6, key=key)
    x = jax.random.normal(jax.random.key(2), (1, 13, 32))
    cotangent = jax.random.normal(jax.random.key(3), (1, 13, 32))

    def run(inputs, segments):
        model, h = inputs
        return model(h, segments)

    params, static = eqx.partition(module, eqx.is_inexact_array)
    run_split = lambda inputs, segments: run((eqx.combine(inputs[0], static), inputs[1]), segments)
    cut = lambda inputs, document: (inputs[0], inputs[1][:, document])
    (packed, packed_grads), (alone, alone_grads) = packed_and_alone(run_split, (params, x), cotangent, cut)
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(packed_grads), jax.tree.leaves(alone_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["llama_tiny", "deepseek_v3_tiny"])
def test_models_keep_each_packed_document_to_itself(name):
    """Logits of packed windows equal those of each document run alone; the training loss under
    an offload policy has the gradients of save_all's (llama_tiny); loss_across_documents=false
    drops the predictions made from an end-of-document id."""
    model = build_model(load_model_config(name, num_layers=2), jax.random.key(0))  # DeepSeek: a dense, a MoE layer
    vocab = model.config.vocab_size
    documents = jax.random.randint(jax.random.key(1), (2, 3, 4), 1, vocab).at[:, :, -1].set(EOD)
    batch = jnp.concatenate([documents.reshape(2, 12), jnp.full((2, 1), 5)], axis=1)  # 13 = 12 inputs + 1
    inputs = batch[:, :-1]

    packed = eqx.filter_jit(lambda m, t: m(t, SAVE_ALL, document_segments(t, EOD)))(model, inputs)
    alone = eqx.filter_jit(lambda m, t: m(t))(model, documents.reshape(6, 4)).reshape(2, 12, vocab)
    np.testing.assert_allclose(packed, alone, rtol=1e-4, atol=1e-4)

    mask = DocumentMask(EOD, loss_across_documents=False)
    policy = preset_policy("minimal_offloaded", model)
    if name == "llama_tiny":  # the segments pass each offloaded layer as the same extra input in every model

        @eqx.filter_jit
        def loss_and_grads(m, p):
            return eqx.filter_value_and_grad(lambda m: m.training_loss(batch, p, documents=mask), has_aux=True)(m)

        (_, stats), grads = loss_and_grads(model, policy)
        (_, reference_stats), reference = loss_and_grads(model, SAVE_ALL)
        assert float(stats["loss"]) == pytest.approx(float(reference_stats["loss"]), rel=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    else:  # DeepSeek-V3's MTP block attends within documents too; its loss only is checked here
        _, stats = eqx.filter_jit(lambda m, p: m.training_loss(batch, p, documents=mask))(model, policy)
        assert np.isfinite(float(stats["mtp_loss"]))
    per_token = optax.softmax_cross_entropy_with_integer_labels(packed.astype(jnp.float32), batch[:, 1:])
    counted = np.asarray(inputs != EOD)
    assert float(stats["loss"]) == pytest.approx(float(per_token[counted].mean()), rel=1e-5)
    assert counted.sum() == 18  # 24 predictions, 6 of them from an end-of-document id
