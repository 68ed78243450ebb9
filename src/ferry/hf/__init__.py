"""Hugging Face interop: `load_pretrained` reads a local checkpoint directory (config.json and
safetensors) into a model of any of ferry's families, `save_pretrained` writes one `transformers`
loads. The generic parts live here (safetensors, tensor layout, config.json reading); each
family's mapping is its `ferry.models.<family>.hf`."""

from ferry.hf.pretrained import check_checkpoint, load_pretrained, save_pretrained
from ferry.hf.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "check_checkpoint", "load_pretrained", "save_pretrained"]
