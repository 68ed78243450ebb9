"""ferry's compiled HBM beside MaxText's on the same TPU step: DeepSeek-V3 at full width, 5 layers
(1 dense + 4 MoE, no MTP: 48.47 B parameters), 1 x 4096 tokens per device on a 32-chip v5p slice
(FSDP 32, or `--mesh expert`: the 32 chips as expert parallelism), float32 weights and AdamW
moments. Each preset is compiled by the planner in a process of its own, so a finished one is kept
if a later one fails. MaxText's figures are its own compile on the same mesh (recorded below with
their source).

    python benchmarks/tpu_vs_maxtext.py [--presets maxtext_best,full_remat,...] [--moe-matmul megablox]
                                        [--mesh fsdp|expert] [--out DIR]

Prints ferry's HBM total, temporaries and pinned host bytes per device next to MaxText's, and the
two goals of issue 16: ferry's best total <= 40.5 GiB (0.9 x MaxText's best) and the
MaxText-equivalent placement (`maxtext_best`) <= MaxText's 45.04 GiB.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
# MaxText 0.2.5 `train_compile` of this exact shape (DeepSeek-V3, 5 layers at full width, per
# device batch 1 x 4096, float32 weights, v5p-64 = 32 chips, megablox, dropless), GiB per device:
# (HBM total, temporaries, pinned host); None where the compile gave no breakdown. Arguments are
# 16.93 GiB (FSDP) and 17.01 GiB (expert) against ferry's 16.93 on either mesh.
MAXTEXT = {
    "fsdp": {  # ici_fsdp_parallelism=32
        "full_remat": (52.13, 35.20, 0.0),  # remat_policy=full (reproduced 2026-12-02, to the byte)
        "minimal": (49.98, 33.05, 0.0),  # remat_policy=minimal
        "minimal_offloaded": (51.29, 34.36, 5.09),  # remat_policy=minimal_offloaded
        # custom: decoder_layer_input, mlpwi_0/1 offloaded. Recorded by the issue as 45.04
        # (28.11 / 1.22); recompiled 2026-12-02 with maxtext 0.2.5, jax 0.12.0.1, libtpu 0.0.52 it
        # is 50.33 (33.40 / 0.84). The goals keep the recorded, lower figure.
        "maxtext_best": (45.04, 28.11, 1.22),
    },
    "expert": {  # ici_expert_parallelism=32, fsdp 1; compiled 2026-12-02 (same versions)
        # remat_policy=full: over v5p's 95.73 GiB (CompileTimeHbmOom); the figures with
        # --xla_tpu_no_crash_on_oom. Dropless expert parallelism sizes each chip's receive buffer
        # for 32x its balanced load (1,048,576 rows a MoE layer).
        "full_remat": (97.97, 80.96, 0.0),
        "maxtext_best": (101.09, None, None),  # OOM; the total from the compiler's message only
    },
}
GOAL_BEST, GOAL_EQUIVALENT = 40.5, 45.04
SHAPE = (
    "model=deepseek_v3",
    "model.num_layers=5",
    "model.num_dense_layers=1",
    "model.mtp_depth=0",
    "train.micro_batch_size=1",
    "train.seq_len=4096",
    "train.global_batch_size=32",
)
# The 32 chips as MaxText's FSDP over the slice, or as expert parallelism: the experts split 8 to
# a chip and every other weight sharded over the same 32 chips (PARAM_RULES' embed on fsdp and
# expert), so the arguments are the same 16.93 GiB and no chip gathers a MoE layer's experts.
MESHES = {"fsdp": ("mesh.fsdp=32",), "expert": ("mesh.expert=32",)}
# MaxText's best placement as ferry's run offload (its name makes it a plan preset)
MAXTEXT_BEST = (
    "offload=moe_offload",
    "offload.name=maxtext_best",
    "offload.tensors.decoder_layer_input=offload",
)
PRESETS = ("maxtext_best", "full_remat", "minimal_offloaded", "minimal", "moe_offload")


def plan_one(preset: str, moe_matmul: str, out: Path, mesh: str) -> dict | None:
    """Plan `preset` in a process of its own (`--one`); its MemoryPlan's JSON, or None if it
    failed. A process per preset: a failed compile loses nothing already planned."""
    path = out / f"{preset}-{moe_matmul}-{mesh}.json"
    command = [sys.executable, __file__, "--one", preset, "--moe-matmul", moe_matmul, "--out", str(out), "--mesh", mesh]
    print(f"planning {preset} (moe_matmul={moe_matmul})", flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode or not path.exists():
        print(result.stdout[-2000:] + result.stderr[-4000:], file=sys.stderr, flush=True)
        return None
    print(f"{preset}: planned in {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads(path.read_text())


def plan_here(preset: str, moe_matmul: str, out: Path, mesh: str) -> None:
    """Compile the train step of SHAPE under `preset` for v5p x 32 with the TPU platform's XLA
    flags (`ferry.plan.planner.plan_memory`, the planner's own compile and verifier) and write
    its plan. Only the plan: `mode=plan` would also compile `save_all` for its recompute check,
    which does not fit a v5p at this shape (130 GiB of temporaries, a compile-time OOM)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin would otherwise try to start a GPU
    from omegaconf import OmegaConf

    from ferry.config.overrides import hydra_compose, preset_node
    from ferry.config.root import load_config
    from ferry.config.train import OffloadConfig
    from ferry.config_schema import from_dict
    from ferry.models.registry import abstract_model
    from ferry.plan.planner import plan_memory
    from ferry.platform import PlatformConfig
    from ferry.xla.targets import TARGETS

    configs = ROOT / "configs"
    offload = MAXTEXT_BEST if preset == "maxtext_best" else (f"offload={preset}",)
    overrides = ["mode=plan", "target=v5p", *SHAPE, *MESHES[mesh], f"model.moe_matmul={moe_matmul}", *offload]
    config = load_config(OmegaConf.to_container(hydra_compose(configs, "train", overrides), resolve=True))
    preset_config = (
        config.offload
        if preset == "maxtext_best"
        else from_dict(OffloadConfig, preset_node(configs, "offload", preset))
    )
    policy = preset_config.policy(abstract_model(config.model).tagged_names())
    platform = from_dict(PlatformConfig, preset_node(configs, "platform", "tpu"))
    plan = plan_memory(config, TARGETS["v5p"], policy, preset, xla_flags=dict(platform.xla_flags))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{preset}-{moe_matmul}-{mesh}.json").write_text(json.dumps(plan.to_json(), default=str))


def row(preset: str, plan: dict, mesh: str) -> str:
    total, temp, host = plan["device_bytes"] / GIB, plan["temp_bytes"] / GIB, plan["host_bytes"] / GIB
    theirs = MAXTEXT[mesh].get(preset)
    if theirs is None:
        maxtext = "-"
    elif theirs[1] is None:
        maxtext = f"{theirs[0]:6.2f} (OOM, no breakdown)"
    else:
        maxtext = f"{theirs[0]:6.2f} ({theirs[1]:.2f} / {theirs[2]:.2f})"
    ratio = f"{total / theirs[0]:.3f}" if theirs else "-"
    flops = plan["flops"] / 1e12
    return f"| {preset} | {total:6.2f} ({temp:.2f} / {host:.2f}) | {maxtext} | {ratio} | {flops:,.0f} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--moe-matmul", default="megablox", choices=("megablox", "ragged_dot"))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "tpu_vs_maxtext")
    parser.add_argument("--mesh", default="fsdp", choices=tuple(MESHES))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # plan one preset in this process
    args = parser.parse_args()
    if args.one:
        plan_here(args.one, args.moe_matmul, args.out, args.mesh)
        return 0
    plans = {}
    for preset in args.presets.split(","):
        plan = plan_one(preset, args.moe_matmul, args.out, args.mesh)
        if plan is not None:
            plans[preset] = plan
    print(
        f"\nDeepSeek-V3, 5 layers, v5p x 32 (mesh.{args.mesh}=32, MaxText on the same mesh), "
        f"1 x 4096 tokens per device, moe_matmul={args.moe_matmul}"
    )
    print("| preset | ferry HBM total (temp / pinned host), GiB | MaxText | ferry / MaxText | TFLOP per device |")
    print("|---|---|---|---|---|")
    for preset, plan in plans.items():
        print(row(preset, plan, args.mesh))
    if plans:
        best = min(plans, key=lambda p: plans[p]["device_bytes"])
        best_total = plans[best]["device_bytes"] / GIB
        verdict = "met" if best_total <= GOAL_BEST else "not met"
        print(f"best: {best} {best_total:.2f} GiB (goal <= {GOAL_BEST}: {verdict})")
    if "maxtext_best" in plans:
        total = plans["maxtext_best"]["device_bytes"] / GIB
        verdict = "met" if total <= GOAL_EQUIVALENT else "not met"
        print(f"MaxText-equivalent placement: {total:.2f} GiB (goal <= {GOAL_EQUIVALENT}: {verdict})")
    return 0 if len(plans) == len(args.presets.split(",")) else 1


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main())
