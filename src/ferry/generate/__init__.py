"""Text from a trained model: a key/value cache, the cached forward pass (prefill and decode
steps through the model's own layers), sampling, and the compiled generation loop."""

from ferry.generate.cache import KVCache, empty_cache
from ferry.generate.decode import cached_hidden, cached_logits
from ferry.generate.loop import Generation, generate, new_tokens
from ferry.generate.sampling import GREEDY, Sampling, SamplingError, next_token

__all__ = [
    "GREEDY",
    "Generation",
    "KVCache",
    "Sampling",
    "SamplingError",
    "cached_hidden",
    "cached_logits",
    "empty_cache",
    "generate",
    "new_tokens",
    "next_token",
]
