"""Attention kernels side by side on one TPU chip: forward + backward of one layer's causal GQA
attention (batch 16, seq 2048, 16 query / 8 key-value heads of 128 by default), in one run:

- `xla`: ferry's query-chunked einsum softmax (`model.attention=xla`, the reference);
- `jax_dpa`: `jax.nn.dot_product_attention(..., implementation="xla")`;
- `splash_bN`: ferry's splash path (`model.attention=splash`) with every block N, GQA through the
  MQA kernel per key/value head; `splash_bN_fused` with the fused backward kernel; `splash_bN_mha`
  through the MHA kernel over all heads.

    python benchmarks/attention_tpu.py [--out attention.json] [--blocks 512 1024] [--repeats 5]
                                       [--qk-dim 192 --v-dim 128]  # DeepSeek-V3's MLA widths

Prints each candidate's median milliseconds per layer, its ratio to `xla` and to the issue's
baseline (51.5 ms, ferry's path on a v5e at this shape), and its largest gradient difference from
`xla` (a kernel that is fast but wrong shows here); writes the same as JSON to --out. With q/k
heads no multiple of 128 (MLA) it adds `splash_bN_hm64`: heads padded to a multiple of 64 only.
Off a TPU the splash kernels run in Pallas interpret mode (`--interpret` is implied): for a smoke
test with tiny shapes only, the timings mean nothing there.
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.* from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # run from a checkout without installing

from benchmarks.kernel_timing import largest_difference, machine, median_ms, write_report  # noqa: E402
from ferry.nn.kernels.splash import SplashAttention  # noqa: E402
from ferry.nn.kernels.xla import XlaAttention  # noqa: E402

ISSUE_BASELINE_MS = 51.5  # ferry's causal_attention at this shape on one v5e chip (issue 46)
GOAL_MS = 17.0  # issue 46's goal for fwd+bwd per layer at batch 16, seq 2048

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def candidates(
    blocks: list[int], interpret: bool, scale: float, qk_dim: int, fused: bool = True, mha: bool = True
) -> dict[str, Attention]:
    """Each candidate as `attend(q, k, v) -> (batch, seq, heads * v_dim)`."""

    def dpa(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="xla")
        return out.reshape(*out.shape[:2], -1)

    found: dict[str, Attention] = {
        "xla": lambda q, k, v: XlaAttention()(q, k, v, scale),
        "jax_dpa": dpa,
    }
    for block in blocks:
        variants = {f"splash_b{block}": SplashAttention(interpret=interpret, block=block)}
        if fused:
            variants[f"splash_b{block}_fused"] = SplashAttention(interpret=interpret, block=block, fused_backward=True)
        if mha:
            variants[f"splash_b{block}_mha"] = SplashAttention(interpret=interpret, block=block, gqa="mha")
        if qk_dim % 128:
            variants[f"splash_b{block}_hm64"] = SplashAttention(interpret=interpret, block=block, head_multiple=64)
        for name, kernel in variants.items():
            found[name] = lambda q, k, v, kernel=kernel: kernel(q, k, v, scale)
    return found


def inputs(
    batch: int, seq: int, heads: int, kv_heads: int, qk_dim: int, v_dim: int, dtype: str = "bfloat16"
) -> tuple[jax.Array, ...]:
    """q, k, v and the output's cotangent, random, in `dtype`."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (batch, seq, heads, qk_dim), dtype)
    k = jax.random.normal(kk, (batch, seq, kv_heads, qk_dim), dtype)
    v = jax.random.normal(kv, (batch, seq, kv_heads, v_dim), dtype)
    d_out = jax.random.normal(kd, (batch, seq, heads * v_dim), dtype)
    return q, k, v, d_out


def forward_backward(attend: Attention) -> Callable[..., tuple[jax.Array, ...]]:
    """The jitted gradients of <attend(q, k, v), d_out> with respect to q, k and v: one layer's
    attention forward and backward."""

    def objective(q: jax.Array, k: jax.Array, v: jax.Array, d_out: jax.Array) -> jax.Array:
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))

    return jax.jit(jax.grad(objective, argnums=(0, 1, 2)))


def run(
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    qk_dim: int,
    v_dim: int,
    blocks: list[int],
    repeats: int,
    interpret: bool,
    only: list[str] | None = None,
    dtype: str = "bfloat16",
) -> dict:
    """Measure every candidate (or those named in `only`) on the same inputs; the results."""
    args = inputs(batch, seq, heads, kv_heads, qk_dim, v_dim, dtype)
    scale = qk_dim**-0.5
    found = candidates(blocks, interpret, scale, qk_dim)
    names = [n for n in found if only is None or n in only or n == "xla"]
    reference = None
    results = {}
    for name in names:
        fn = forward_backward(found[name])
        started = time.perf_counter()
        grads = jax.block_until_ready(fn(*args))
        compile_s = time.perf_counter() - started
        reference = grads if name == "xla" else reference
        ms = median_ms(fn, args, repeats)
        results[name] = {
            "ms": ms,
            "first_call_s": compile_s,
            "gradient_difference": largest_difference(grads, reference),
        }
        del grads
        print(f"  {name}: {ms:.2f} ms", flush=True)
    xla_ms = results["xla"]["ms"]
    for entry in results.values():
        entry["vs_xla"] = entry["ms"] / xla_ms
        entry["vs_issue_baseline"] = entry["ms"] / ISSUE_BASELINE_MS
    best = min((n for n in results if n.startswith("splash")), key=lambda n: results[n]["ms"], default=None)
    return {
        "shape": {"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads, "qk_dim": qk_dim, "v_dim": v_dim},
        "dtype": dtype,
        **machine(interpret, repeats),
        "results": results,
        "best_splash": best,
        "goal_ms": GOAL_MS,
        "goal_met": best is not None and results[best]["ms"] <= GOAL_MS and not interpret,
    }


def table(report: dict) -> str:
    lines = [f"{'candidate':<22}{'ms/layer':>10}{'vs xla':>9}{'vs 51.5':>9}{'grad diff':>11}"]
    for name, r in report["results"].items():
        lines.append(
            f"{name:<22}{r['ms']:>10.2f}{r['vs_xla']:>9.3f}{r['vs_issue_baseline']:>9.3f}"
            f"{r['gradient_difference']:>11.2e}"
        )
    best = report["best_splash"]
    if best is not None:
        verdict = "met" if report["goal_met"] else "not met"
        lines.append(f"best splash: {best}, {report['results'][best]['ms']:.2f} ms (goal <= {GOAL_MS} ms: {verdict})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--qk-dim", type=int, default=128)
    parser.add_argument("--v-dim", type=int, default=None, help="default: --qk-dim")
    parser.add_argument("--blocks", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="+", default=None, help="candidate names to run (xla always runs)")
    parser.add_argument("--dtype", default="bfloat16", help="q, k, v and the cotangent's dtype")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (implied off a TPU)")
    args = parser.parse_args(argv)
    interpret = args.interpret or jax.default_backend() != "tpu"
    v_dim = args.v_dim or args.qk_dim
    print(
        f"attention fwd+bwd per layer: batch {args.batch}, seq {args.seq}, {args.heads}/{args.kv_heads} heads, "
        f"q/k {args.qk_dim}, v {v_dim}, {args.dtype}, on {jax.devices()[0].device_kind}"
        + (" (interpret mode)" if interpret else ""),
        flush=True,
    )
    report = run(
        args.batch, args.seq, args.heads, args.kv_heads, args.qk_dim, v_dim, args.blocks, args.repeats, interpret,
        args.only, args.dtype,
    )  # fmt: skip
    print(table(report), flush=True)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    raise SystemExit(main())
