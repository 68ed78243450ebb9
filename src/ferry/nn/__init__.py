"""Layers shared by ferry's models. Each tags the activations an offload policy may place."""
