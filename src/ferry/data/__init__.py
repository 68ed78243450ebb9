"""Corpora, tokenizers and batching."""
