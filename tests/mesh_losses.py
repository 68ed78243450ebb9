"""Train several runs in one process, as `launch/run.py` would, and print their losses as JSON.

    python -m tests.mesh_losses --cpu-devices 8 --root DIR --common "model=llama_tiny ..." \
        --run "mesh.data=2 mesh.fsdp=2 mesh.tensor=2" --run "mesh.fsdp=2 mesh.expert=4"

Each run composes the Hydra config from the common and its own overrides and goes through
`prepare` and `train`; the virtual CPU devices are created once, before JAX starts. Runs on the
same mesh compile the same init and checkpoint fingerprints: the test session's persistent
compilation cache (`JAX_COMPILATION_CACHE_DIR`, inherited from tests/conftest.py) compiles each once.
"""

import argparse
import json
import shlex
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from ferry.config.overrides import hydra_compose
from ferry.config.root import load_config
from ferry.platform import PlatformConfig, apply_platform
from ferry.run.preflight import prepare
from ferry.run.training import train

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-devices", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--common", default="")
    parser.add_argument("--run", action="append", required=True)
    args = parser.parse_args()
    apply_platform(PlatformConfig("cpu", cpu_devices=args.cpu_devices))
    losses = []
    for index, run in enumerate(args.run):
        overrides = shlex.split(args.common) + shlex.split(run) + [f"run.dir={args.root / str(index)}"]
        cfg = hydra_compose(CONFIGS, "train", [*overrides, f"platform.cpu_devices={args.cpu_devices}"])
        config = load_config(OmegaConf.to_container(cfg, resolve=True))
        run_dir = train(prepare(config, Console(quiet=True)), OmegaConf.to_yaml(cfg), Console(quiet=True))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in records if "loss" in r])
    print(json.dumps(losses))


if __name__ == "__main__":
    main()
