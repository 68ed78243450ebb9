"""The loss head's forward and backward on one chip: today's whole logits (`train.loss_head=logits`)
beside the chunked head (`train.loss_head=chunked`, at each `--chunk-mib`, its weight gradient in
a walk of its own or the hidden state's: `train.loss_weight_grad=late|early`), the fused head
(`train.loss_head=fused`, the loss and both gradients in one forward walk, at each `--chunk-mib`),
the same with each chunk made by the Pallas kernel (`train.loss_kernel=pallas`, `ferry.head.kernel`;
at each `--kernel-rows` block of tokens, default: the kernel's own choice), and a plain-JAX
floor (the head's three matmuls alone, no softmax), in one run. The v5e shape of issue 46 by default:
batch 8 x seq 2048 tokens, dim 2048, vocabulary 32,768, bfloat16.

    python benchmarks/loss_head_tpu.py [--chunk-mib 128,256,512] [--kernel-rows 256,512] [--repeats 10] [--out FILE]

Prints per head: its chunks, median milliseconds of loss + gradients (hidden and weight), the ratio
to today's head and to the matmul floor, and the compiled program's temporaries; writes the same as
JSON to --out. Takes well under a minute on a v5e chip (a few seconds of compiles per head).
"""

import argparse
import contextlib
import datetime
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ferry.head import kernel as head_kernel
from ferry.head.chunked import OutputHead, vocab_chunks
from ferry.head.fused import sequence_chunks
from ferry.head.loss import MIB, LossHead

V5E_SHAPE = {"batch": 8, "seq": 2048, "dim": 2048, "vocab": 32768}
CHUNK_MIB = (128.0, 256.0, 512.0)  # 256: the default (train.loss_chunk_mib)


def head_inputs(batch: int, seq: int, dim: int, vocab: int, dtype=jnp.bfloat16) -> tuple[jax.Array, ...]:
    """Hidden states in the compute dtype, the head's float32 master weight [dim, vocab] and
    targets, as a train step has them."""
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (batch, seq, dim), dtype)
    weight = 0.02 * jax.random.normal(keys[1], (dim, vocab), jnp.float32)
    targets = jax.random.randint(keys[2], (batch, seq), 0, vocab)
    return hidden, weight, targets


def head_step(head: LossHead) -> Callable:
    """The head's loss and its gradients (hidden, master weight), compiled as one program. The
    weight is cast to the compute dtype as a train step casts it (`ferry.train.step.compute_copy`):
    whole for the whole-logits head, a chunk at a time by the chunked head, once inside the fused."""

    def loss(hidden, weight, targets):
        weight = weight.astype(hidden.dtype) if head.kind == "logits" else weight
        return head(hidden, OutputHead(weight, ("embed", "vocab")), targets)[0]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def matmul_floor() -> Callable:
    """The head's three matmuls (logits, and the gradients of hidden and weight from them), with
    no softmax and no float32 logits: what no head can beat."""

    def step(hidden, weight, targets):
        del targets
        weight = weight.astype(hidden.dtype)
        logits = jnp.einsum("bsd,dv->bsv", hidden, weight)
        d_hidden = jnp.einsum("bsv,dv->bsd", logits, weight)
        d_weight = jnp.einsum("bsd,bsv->dv", hidden, logits)
        return d_hidden, d_weight

    return jax.jit(step)


@contextlib.contextmanager
def kernel_block_rows(block: int | None) -> Iterator[None]:
    """Trace the Pallas head with blocks of `block` tokens (None: as `head_kernel.choose_tiles`
    chooses), to time the choice against its neighbours."""
    if block is None:
        yield
        return
    chosen = head_kernel.BLOCK_ROWS
    head_kernel.BLOCK_ROWS = (block,)
    try:
        yield
    finally:
        head_kernel.BLOCK_ROWS = chosen


def median_ms(step: Callable, args: Sequence[jax.Array], repeats: int) -> float:
    """Median wall milliseconds of `step(*args)` to completion, after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(step(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def temp_bytes(compiled: Any) -> int | None:
    """The compiled program's temporaries (None where the backend reports none)."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def measure(shape: dict[str, int], chunk_mibs: Sequence[float], repeats: int, kernel_rows: Sequence[int] = ()) -> dict:
    """Every head at `shape`, today's first, then the floor; ratios against today's and the floor."""
    args = head_inputs(**shape)
    tokens = shape["batch"] * shape["seq"]
    rows = []
    heads = [("logits", LossHead("logits"), None)] + [
        (f"chunked {c:g} MiB {walk}", LossHead("chunked", c, walk), None)
        for c in chunk_mibs
        for walk in ("late", "early")
    ]
    heads += [(f"fused {c:g} MiB", LossHead("fused", c, kernel="xla"), None) for c in chunk_mibs]
    for block in kernel_rows or [None]:
        rows_name = "" if block is None else f" rows {block}"
        for c in chunk_mibs:
            positions = sequence_chunks(shape["batch"], shape["seq"], shape["vocab"], int(c * MIB))
            if block is None or block <= shape["batch"] * positions.size:  # a block within the chunk's tokens
                heads.append((f"pallas {c:g} MiB{rows_name}", LossHead("fused", c, kernel="pallas"), block))
    for name, head, block in heads:
        with kernel_block_rows(block):
            step = head_step(head).lower(*args).compile()  # compiled once: timed and read
        chunked = head.kind == "chunked"
        row = {
            "head": name,
            "kind": head.kind,
            "kernel": head.kernel,
            "kernel_rows": block,
            "chunk_mib": None if head.kind == "logits" else head.chunk_mib,
            "weight_grad": head.weight_grad if chunked else None,
        }
        if chunked:
            chunks = vocab_chunks(tokens, shape["vocab"], 1, head.budget_bytes)
            row |= {"chunks": chunks.count, "chunk_columns": chunks.size}
        elif head.kind == "fused":
            positions = sequence_chunks(shape["batch"], shape["seq"], shape["vocab"], head.budget_bytes)
            row |= {"chunks": positions.count, "chunk_positions": positions.size}
        row |= {"ms": median_ms(step, args, repeats), "temp_bytes": temp_bytes(step)}
        rows.append(row)
    floor = median_ms(matmul_floor(), args, repeats)
    for row in rows:
        row["vs_logits"] = row["ms"] / rows[0]["ms"]
        row["vs_floor"] = row["ms"] / floor
    return {
        "shape": shape,
        "dtype": "bfloat16",
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "repeats": repeats,
        "matmul_floor_ms": floor,
        "heads": rows,
    }


def table(result: dict) -> str:
    """The heads side by side: chunks, milliseconds, ratios, temporaries."""
    lines = [
        f"loss head fwd+bwd on {result['device']} ({result['jax']}), {result['shape']}, bf16, "
        f"median of {result['repeats']}; matmul floor {result['matmul_floor_ms']:.2f} ms",
        f"{'head':<26} {'chunks':>12} {'ms':>9} {'vs logits':>10} {'vs floor':>9} {'temporaries':>12}",
    ]
    for row in result["heads"]:
        size = row.get("chunk_columns", row.get("chunk_positions"))  # vocabulary columns, or sequence positions
        chunks = f"{row['chunks']} x {size}" if "chunks" in row else "whole"
        temps = "-" if row["temp_bytes"] is None else f"{row['temp_bytes'] / 2**20:,.0f} MiB"
        lines.append(
            f"{row['head']:<26} {chunks:>12} {row['ms']:>9.2f} {row['vs_logits']:>9.3f}x "
            f"{row['vs_floor']:>8.3f}x {temps:>12}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    chunk_mibs = ",".join(f"{c:g}" for c in CHUNK_MIB)
    parser.add_argument("--chunk-mib", default=chunk_mibs, help="chunked and fused heads to time")
    parser.add_argument(
        "--kernel-rows", default="", help="the Pallas head's blocks of tokens to time (default: its choice)"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    for key, value in V5E_SHAPE.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    args = parser.parse_args(argv)
    shape = {key: getattr(args, key) for key in V5E_SHAPE}
    chunk_mibs = [float(c) for c in args.chunk_mib.split(",") if c]
    kernel_rows = [int(r) for r in args.kernel_rows.split(",") if r]
    result = measure(shape, chunk_mibs, args.repeats, kernel_rows)
    print(table(result), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    main()
