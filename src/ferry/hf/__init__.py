"""Hugging Face interop: `load_pretrained` reads a local checkpoint directory (config.json and
safetensors) into a model of any of ferry's families, `save_pretrained` writes one `transformers`
loads. It sits above the families: each family's mapping is its `ferry.hf.<family>`, listed by
family name in `ferry.hf.mapping` and built on the family-blind format here (safetensors, tensor
layout, config.json keys), so `ferry.hf` imports the families and they never import it."""

from ferry.hf.pretrained import check_checkpoint, load_pretrained, save_pretrained
from ferry.hf.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "check_checkpoint", "load_pretrained", "save_pretrained"]
