"""The key/value cache of a decode: every attention layer's rotated keys and values, preallocated
for the whole generation so the decode loop compiles once and writes in place.

MLA (DeepSeek-V3) keeps its keys and values decompressed (num_heads heads of qk_nope + qk_rope
and of v_dim), as its forward pass attends them, not its compressed latent: simple, and
num_heads x (qk + v) / (kv_lora_rank + qk_rope) times the memory of a latent cache."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ferry.models.base import AbstractLanguageModel
from ferry.nn.block import AbstractDecoderBlock
from ferry.nn.stack import LayerStack


class KVCache(eqx.Module):
    """Per stack of decoder layers (`decoder_stacks()`, in order), its layers' keys
    [layers, batch, length, kv_heads, qk_dim] and values [layers, batch, length, kv_heads, v_dim].
    A slot past the tokens written holds zeros, which the causal mask never lets a query read."""

    keys: tuple[Float[Array, "_layers batch length _kv_heads _qk_dim"], ...]  # stacks differ in depth
    values: tuple[Float[Array, "_layers batch length _kv_heads _v_dim"], ...]

    @property
    def length(self) -> int:
        """The tokens it has room for: prompt and new tokens."""
        return self.keys[0].shape[2]


def first_block(stack: LayerStack) -> AbstractDecoderBlock:
    """A stack's first layer (its layers are identical in shape)."""
    block = stack.layer(0)
    assert isinstance(block, AbstractDecoderBlock), f"{stack.name}'s layers are decoder blocks"
    return block


def empty_cache(model: AbstractLanguageModel, batch: int, length: int) -> KVCache:
    """A cache of `length` tokens for `batch` sequences, in the dtype the model's layers compute
    keys and values in (the embedding's: cast the model to decode in bfloat16)."""
    keys, values = [], []
    hidden = jax.ShapeDtypeStruct((batch, 1, model.config.dim), model.embed.weight.dtype)
    for stack in model.decoder_stacks():
        _, k, v = jax.eval_shape(lambda s, x: first_block(s).attention.rotated_heads(x), stack, hidden)
        keys.append(jnp.zeros((stack.num_layers, batch, length, *k.shape[2:]), k.dtype))
        values.append(jnp.zeros((stack.num_layers, batch, length, *v.shape[2:]), v.dtype))
    return KVCache(tuple(keys), tuple(values))
