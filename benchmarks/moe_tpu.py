"""The routed experts' grouped matmuls at DeepSeek-V3's widths on one TPU chip, tile by tile, in
one run: forward + backward (`ferry.nn.moe.megablox_matmul`: megablox's `gmm`, `gmm` of the
transposed matrix, `tgmm`) of each expert product for every candidate tile, beside XLA's own
grouped lowering (`lax.ragged_dot`) and a dense matmul of the same FLOPs (the floor).

    python benchmarks/moe_tpu.py [--out moe.json] [--tokens 2048] [--experts 16] [--top-k 8]
                                 [--dim 7168] [--hidden 2048] [--tiles 512,1024,1024 ...]

The products of one MoE layer at dim 7168 and expert width 2048: `up` (gate and up projections,
each tokens x top-k rows of 7168 times [experts, 7168, 2048]) and `down` ([experts, 2048, 7168]).
Routing is random and balanced in expectation (each token's top-k distinct experts). Prints, per
product and tile, the median milliseconds of forward + backward, TFLOP/s, the ratio to the dense
floor and to `ragged_dot`, and the largest gradient difference from `ragged_dot`; the fastest tile
per product is what `ferry.nn.moe.megablox.TUNED` holds. Off a TPU the kernels run in Pallas
interpret mode: a smoke test with tiny shapes only, its timings mean nothing.
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.* from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # ferry without installing

from benchmarks.kernel_timing import largest_difference, machine, median_ms, write_report  # noqa: E402
from ferry.nn.moe.megablox import TILING, megablox_matmul  # noqa: E402

CANDIDATE_TILES = (
    (256, 512, 512),
    (256, 1024, 1024),
    (512, 512, 1024),
    (512, 1024, 512),
    (512, 1024, 1024),
    (512, 1024, 2048),
    (512, 2048, 1024),
    (1024, 512, 1024),
    (1024, 1024, 1024),
    (1024, 1024, 2048),
)
Product = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def routed_group_sizes(tokens: int, experts: int, top_k: int) -> jax.Array:
    """Rows per expert of `tokens` tokens each routed to `top_k` distinct random experts."""
    scores = jax.random.uniform(jax.random.key(1), (tokens, experts))
    chosen = jax.lax.top_k(scores, top_k)[1]
    return jnp.bincount(chosen.reshape(-1), length=experts).astype(jnp.int32)


def forward_backward(product: Product, group_sizes: jax.Array) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The jitted gradients of <product(x, w), d_out> with respect to x and w."""

    def objective(x: jax.Array, w: jax.Array, d_out: jax.Array) -> jax.Array:
        return jnp.sum(product(x, w, group_sizes).astype(jnp.float32) * d_out.astype(jnp.float32))

    return jax.jit(jax.grad(objective, argnums=(0, 1)))


def candidates(tiles: list[tuple[int, int, int]], interpret: bool) -> dict[str, Product]:
    found: dict[str, Product] = {"ragged_dot": lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)}
    for tile in tiles:
        name = "megablox_" + "x".join(str(t) for t in tile)
        found[name] = lambda x, w, gs, tile=tile: megablox_matmul(x, w, gs, interpret, tile)
    return found


def dense_floor_ms(rows: int, d_in: int, d_out: int, repeats: int) -> float:
    """Forward + backward of one dense [rows, d_in] x [d_in, d_out] matmul: the same FLOPs as
    the grouped product, no grouping."""
    x = jnp.ones((rows, d_in), jnp.bfloat16)
    w = jnp.ones((d_in, d_out), jnp.bfloat16)
    d_out_ = jnp.ones((rows, d_out), jnp.bfloat16)
    objective = lambda x, w, d: jnp.sum((x @ w).astype(jnp.float32) * d.astype(jnp.float32))
    return median_ms(jax.jit(jax.grad(objective, argnums=(0, 1))), (x, w, d_out_), repeats)


def measure_product(
    rows: int, d_in: int, d_out: int, group_sizes: jax.Array, found: dict[str, Product], repeats: int
) -> dict:
    """Every candidate on one product's inputs; their records, and the dense floor."""
    experts = group_sizes.shape[0]
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (rows, d_in), jnp.bfloat16)
    w = (jax.random.normal(kw, (experts, d_in, d_out), jnp.float32) * d_in**-0.5).astype(jnp.bfloat16)
    d_out_ = jax.random.normal(kd, (rows, d_out), jnp.bfloat16)
    flops = 3 * 2 * rows * d_in * d_out  # forward, input gradient, weight gradient
    floor = dense_floor_ms(rows, d_in, d_out, repeats)
    results, reference = {}, None
    for name, product in found.items():
        fn = forward_backward(product, group_sizes)
        try:
            grads = jax.block_until_ready(fn(x, w, d_out_))
        except Exception as error:  # a tile the kernel refuses at this shape: recorded, not fatal
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        reference = grads if name == "ragged_dot" else reference
        ms = median_ms(fn, (x, w, d_out_), repeats)
        results[name] = {
            "ms": ms,
            "tflops": flops / ms / 1e9,
            "vs_dense": ms / floor,
            "gradient_difference": largest_difference(grads, reference),
        }
        print(f"  {name}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
    for entry in results.values():
        if "ms" in entry:
            entry["vs_ragged_dot"] = entry["ms"] / results["ragged_dot"]["ms"]
    timed = [n for n in results if n.startswith("megablox") and "ms" in results[n]]
    best = min(timed, key=lambda n: results[n]["ms"], default=None)
    return {"rows": rows, "d_in": d_in, "d_out": d_out, "dense_ms": floor, "results": results, "best": best}


def run(tokens: int, experts: int, top_k: int, dim: int, hidden: int, tiles: list, repeats: int, interpret: bool):
    group_sizes = routed_group_sizes(tokens, experts, top_k)
    rows = tokens * top_k
    found = candidates(tiles, interpret)
    products = {}
    for label, (d_in, d_out) in {"up": (dim, hidden), "down": (hidden, dim)}.items():
        print(f"{label}: {rows} rows x {d_in} -> {d_out}, {experts} experts", flush=True)
        products[label] = measure_product(rows, d_in, d_out, group_sizes, found, repeats)
    return {
        "command": "python benchmarks/moe_tpu.py " + " ".join(sys.argv[1:]),
        "shape": {"tokens": tokens, "experts": experts, "top_k": top_k, "dim": dim, "hidden": hidden},
        "group_sizes": [int(g) for g in group_sizes],
        "default_tile": list(TILING),
        **machine(interpret, repeats),
        "products": products,
    }


def table(report: dict) -> str:
    lines = []
    for label, product in report["products"].items():
        lines.append(f"{label} ({product['d_in']} -> {product['d_out']}); dense floor {product['dense_ms']:.3f} ms")
        lines.append(f"  {'candidate':<26}{'ms':>9}{'TFLOP/s':>9}{'vs dense':>10}{'vs ragged':>11}{'grad diff':>11}")
        for name, r in product["results"].items():
            if "ms" not in r:
                lines.append(f"  {name:<26} refused: {r['error'][:80]}")
                continue
            lines.append(
                f"  {name:<26}{r['ms']:>9.3f}{r['tflops']:>9.1f}{r['vs_dense']:>10.3f}{r['vs_ragged_dot']:>11.3f}"
                f"{r['gradient_difference']:>11.2e}"
            )
        lines.append(f"  fastest tile: {product['best']}")
    return "\n".join(lines)


def parse_tile(text: str) -> tuple[int, int, int]:
    parts = tuple(int(p) for p in text.split(","))
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: a tile is rows,contracted,columns, e.g. 512,1024,1024")
    return parts  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step and device (batch x seq)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dim", type=int, default=7168)
    parser.add_argument("--hidden", type=int, default=2048, help="each expert's width")
    parser.add_argument("--tiles", type=parse_tile, nargs="+", default=list(CANDIDATE_TILES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (implied off a TPU)")
    args = parser.parse_args(argv)
    interpret = args.interpret or jax.default_backend() != "tpu"
    report = run(
        args.tokens, args.experts, args.top_k, args.dim, args.hidden, args.tiles, args.repeats, interpret
    )  # fmt: skip
    print(table(report), flush=True)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    raise SystemExit(main())
