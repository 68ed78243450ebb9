"""DeepSeek-V3 on the CPU, measured in one run: the offload presets on deepseek_v3_tiny (compiled
FLOPs and tokens/s, as ratios to save_all), then the dropless grouped-matmul MoE against a dense
all-experts MoE at 8, 32 and 64 experts (FLOPs and forward+backward time).

    python benchmarks/deepseek_cpu.py [--steps 20] [--tokens 4096]   (or python -m benchmarks.deepseek_cpu)

The MoE comparison runs the dropless dispatch two ways: tiles of rows, each multiplied by its
expert's matrix (what ferry runs on CPU), and `lax.ragged_dot` (ferry's choice on GPU/TPU, where it
is one grouped GEMM; XLA's CPU backend expands it into every expert on every row, which the
table shows). "model FLOPs" are those of the expert matmuls: k of E experts per token.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.offload_cpu import compare_presets, preset_names  # noqa: E402
from ferry.nn.moe import Experts, dropless_moe, route  # noqa: E402
from tests.moe_reference import dense_moe  # noqa: E402

TILE_ROWS = 32


def moe_comparison(num_experts_list: list[int], tokens: int, dim: int, hidden: int, k: int, repeats: int) -> Table:
    """Forward+backward of the routed experts alone, three ways, ratios to dense."""
    table = Table(title=f"routed experts, {tokens} tokens x top-{k}, dim {dim}, expert hidden {hidden}, fwd+bwd")
    for column in ("experts", "dispatch", "model FLOPs vs dense", "compiled FLOPs vs dense", "ms", "time vs dense"):
        table.add_column(column, justify="right")
    implementations = {
        f"dropless, tiles of {TILE_ROWS}": lambda x, i, w, e: dropless_moe(x, i, w, e, tile_rows=TILE_ROWS),
        "dropless, ragged_dot": dropless_moe,
        "dense all-experts": dense_moe,
    }
    for num_experts in num_experts_list:
        keys = jax.random.split(jax.random.key(num_experts), 3)
        x = jax.random.normal(keys[0], (tokens, dim))
        scores = jax.nn.sigmoid(jax.random.normal(keys[1], (tokens, num_experts)))
        indices, weights = route(scores, jnp.zeros(num_experts), num_experts // 4, num_experts // 4, k, 2.5)
        experts = Experts(num_experts, dim, hidden, key=keys[2])
        results = {}
        for name, moe in implementations.items():
            loss = lambda e, x, moe=moe, i=indices, w=weights: jnp.sum(moe(x, i, w, e) ** 2)
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(experts, x).compile()
            jax.block_until_ready(compiled(experts, x))
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(compiled(experts, x))
                times.append(time.perf_counter() - start)
            results[name] = (compiled.cost_analysis()["flops"], statistics.median(times))
        dense_flops, dense_time = results["dense all-experts"]
        for name, (flops, seconds) in results.items():
            model_ratio = 1.0 if name.startswith("dense") else k / num_experts  # k of E experts per token
            table.add_row(
                str(num_experts),
                name,
                f"{model_ratio:.3f}",
                f"{flops / dense_flops:.3f}",
                f"{seconds * 1e3:.2f}",
                f"{seconds / dense_time:.3f}",
            )
        table.add_section()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    console = Console(width=130)
    model = "deepseek_v3_tiny"
    console.print(compare_presets(model, preset_names(model), args.steps, args.batch, args.seq_len, "bfloat16"))
    console.print(moe_comparison([8, 32, 64], args.tokens, 64, 64, 4, args.steps))


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    main()
