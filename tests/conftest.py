"""Shared fixtures: the tiny model and the offload presets, loaded from configs/ as a user's run
would load them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ferry.config import from_dict
from ferry.models.registry import model_config
from ferry.train.config import OffloadConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PRESETS = sorted(p.stem for p in (CONFIGS / "offload").glob("*.yaml"))


def load_model_config(name: str, **overrides):
    node = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml"))
    return model_config({**node, **overrides})


def load_preset(name: str) -> OffloadConfig:
    return from_dict(OffloadConfig, OmegaConf.to_container(OmegaConf.load(CONFIGS / "offload" / f"{name}.yaml")))


def preset_policy(name: str, model):
    """The preset's policy for `model` (a preset's `default` covers the names the model tags)."""
    return load_preset(name).policy(model.tagged_names())


MOE_ONLY_PRESETS = {"moe_offload"}


def run_launcher(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python launch/run.py ...` as a user types it."""
    return subprocess.run(
        [sys.executable, str(ROOT / "launch" / "run.py"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "120"},
    )


@pytest.fixture(scope="session")
def tiny_config():
    return load_model_config("llama_tiny")
