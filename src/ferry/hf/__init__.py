"""Hugging Face interop: `load_pretrained` reads a local checkpoint directory (config.json and
safetensors) into a ferry Llama or DeepSeek-V3, `save_pretrained` writes one `transformers`
loads."""

from ferry.hf.pretrained import check_checkpoint, load_pretrained, save_pretrained
from ferry.hf.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "check_checkpoint", "load_pretrained", "save_pretrained"]
