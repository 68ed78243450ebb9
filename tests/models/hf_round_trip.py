"""A ferry model's Hugging Face export checked both ways: ferry reads back every array bit for
bit, and `transformers` loads the export and computes the reference logits (the families' parity
tests share it)."""

import json
from pathlib import Path

import jax
import numpy as np
import torch

from ferry.hf import load_pretrained, save_pretrained


def check_export_round_trip(
    model, hf_class, directory: Path, tokens: np.ndarray, reference: np.ndarray, tied: bool, atol: float
) -> None:
    """`model` saved into `directory` (a tied config.json where `tied`); what ferry reads back is
    `model`; what `hf_class` reads back gives `reference` on `tokens`."""
    save_pretrained(model, directory, max_shard_bytes=100_000)
    assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is tied
    reimported = load_pretrained(directory)
    assert reimported.config == model.config
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(reimported), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    exported = hf_class.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        again = exported(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(again, reference, rtol=0, atol=atol)
