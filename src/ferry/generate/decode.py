"""The forward pass over new tokens with a key/value cache: the model's own embedding, layers,
norms and output head (the same modules and weights as training's forward pass), with each
attention layer's keys and values written into the cache and its queries attending all of it.
Run over a prompt it is the prefill; over one token, a decode step. Its logits equal the full
forward pass's at every position (tests/generate/test_decode.py holds it to that)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ferry.generate.cache import KVCache
from ferry.head.loss import whole_logits
from ferry.models.base import AbstractLanguageModel
from ferry.nn.block import AbstractDecoderBlock
from ferry.nn.kernels.xla import attend_rows
from ferry.nn.stack import LayerStack


def cached_block(
    block: AbstractDecoderBlock,
    x: Float[Array, "batch new dim"],
    start: Int[Array, ""],
    keys: Float[Array, "batch length kv_heads qk_dim"],
    values: Float[Array, "batch length kv_heads v_dim"],
) -> tuple[
    Float[Array, "batch new dim"],
    Float[Array, "batch length kv_heads qk_dim"],
    Float[Array, "batch length kv_heads v_dim"],
]:
    """One pre-norm decoder block (`AbstractDecoderBlock.__call__`) over tokens at positions
    start, start + 1, ...: their keys and values written into the layer's cache, their queries
    attending every cached token up to their own. Returns the block's output and the cache."""
    attention = block.attention
    batch, new, _ = x.shape
    positions = jnp.broadcast_to(start + jnp.arange(new), (batch, new))
    q, k, v = attention.rotated_heads(block.attention_norm(x), positions)
    keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, start, 0, 0))
    values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), (0, start, 0, 0))
    heads, kv_heads = q.shape[2], keys.shape[2]
    grouped = q.reshape(batch, new, kv_heads, heads // kv_heads, q.shape[-1])
    context = attend_rows(grouped, keys, values, attention.softmax_scale(), start)
    x = x + attention.out(context.reshape(batch, new, -1))
    out, _ = block.feed_forward(block.mlp_norm(x))
    return x + out, keys, values


def cached_stack(
    stack: LayerStack,
    x: Float[Array, "batch new dim"],
    start: Int[Array, ""],
    keys: Float[Array, "layers batch length kv_heads qk_dim"],
    values: Float[Array, "layers batch length kv_heads v_dim"],
) -> tuple[
    Float[Array, "batch new dim"],
    Float[Array, "layers batch length kv_heads qk_dim"],
    Float[Array, "layers batch length kv_heads v_dim"],
]:
    """Every layer of the stack in a `lax.scan` (one layer compiled), each writing its slice of
    the stack's cache in place."""
    dynamic, static = eqx.partition(stack.layers, eqx.is_array)

    def layer(
        carry: tuple[jax.Array, jax.Array, jax.Array], inputs: tuple[object, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
        h, all_keys, all_values = carry
        weights, index = inputs
        block = eqx.combine(weights, static)
        assert isinstance(block, AbstractDecoderBlock), f"{stack.name}'s layers are decoder blocks"
        h, layer_keys, layer_values = cached_block(block, h, start, all_keys[index], all_values[index])
        all_keys = jax.lax.dynamic_update_index_in_dim(all_keys, layer_keys, index, 0)
        all_values = jax.lax.dynamic_update_index_in_dim(all_values, layer_values, index, 0)
        return (h, all_keys, all_values), None

    (x, keys, values), _ = jax.lax.scan(layer, (x, keys, values), (dynamic, jnp.arange(stack.num_layers)))
    return x, keys, values


def cached_hidden(
    model: AbstractLanguageModel, tokens: Int[Array, "batch new"], cache: KVCache, start: Int[Array, ""] | int
) -> tuple[Float[Array, "batch new dim"], KVCache]:
    """The final hidden state (after the final norm) of `tokens` at positions start, start + 1,
    ..., the cache holding every earlier token's keys and values; and the cache with theirs."""
    start = jnp.asarray(start, jnp.int32)
    x = model.embed(tokens)
    keys, values = [], []
    for stack, stack_keys, stack_values in zip(model.decoder_stacks(), cache.keys, cache.values, strict=True):
        x, stack_keys, stack_values = cached_stack(stack, x, start, stack_keys, stack_values)
        keys.append(stack_keys)
        values.append(stack_values)
    return model.final_norm(x), KVCache(tuple(keys), tuple(values))


def cached_logits(
    model: AbstractLanguageModel, tokens: Int[Array, "batch new"], cache: KVCache, start: Int[Array, ""] | int
) -> tuple[Float[Array, "batch new vocab"], KVCache]:
    """`cached_hidden` read out through the model's output head: the logits of every new token."""
    hidden, cache = cached_hidden(model, tokens, cache, start)
    return whole_logits(hidden, model.output_head()), cache
