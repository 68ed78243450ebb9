"""Generate text from a trained run's checkpoint:

    python launch/sample.py RUN_DIR --prompt "def main("                    # greedy, the latest checkpoint
    python launch/sample.py RUN_DIR --prompt "import " --temperature 0.8 --top-p 0.95 --seed 1 --step 200

RUN_DIR is a directory `launch/run.py` wrote (its config.yaml and checkpoints/). The checkpoint is
restored as `launch/export_hf.py` restores it; the prompt is encoded by the run's tokenizer
(`data.tokenizer`: byte-level, or the run's tokenizer.json) as training encoded a document; the
prompt's prefill and every decode step run as one compiled program over a key/value cache
(`ferry.generate`), on this machine's accelerator (or its CPU). Generation stops at the run's
end-of-document token or after --max-new-tokens; the prompt and the new tokens must fit the run's
context (train.seq_len). The text goes to stdout, then one line to stderr: tokens, time and
tokens/s.

Exit status: 0 generated; 2 refused (one line: no run directory, no checkpoint or no such step,
a tokenizer that is not there, a prompt longer than the context, a bad temperature or top-p, ...).
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ferry.errors import FerryError
from ferry.generate import Generation, Sampling, generate, new_tokens
from ferry.generate.prompt import new_token_budget, prompt_ids
from ferry.precision import cast_floating
from ferry.run.saved_run import saved_run

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class SampleError(FerryError, ValueError):
    """A sampling run that cannot start: a dtype ferry does not decode in."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """What a sampling run made: the continuation's text and ids, and how long it took."""

    text: str
    ids: list[int]
    prompt_length: int
    step: int
    compile_seconds: float
    seconds: float  # the prefill and every decode step, compiled

    @property
    def tokens_per_second(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else float("inf")


def sample(
    run_dir: Path,
    prompt: str,
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    step: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Sample:
    """Continue `prompt` from checkpoint `step` (default: the latest) of `run_dir`. Every input is
    checked before the checkpoint is restored."""
    if dtype not in DTYPES:
        raise SampleError(f"--dtype {dtype}: decode in one of {sorted(DTYPES)}")
    run = saved_run(run_dir, step)
    tokenizer = run.tokenizer
    sampling = Sampling(temperature, top_p, vocab_size=tokenizer.vocab_size)
    ids = prompt_ids(tokenizer, prompt)
    budget = new_token_budget(len(ids), max_new_tokens, run.config.train.seq_len)

    model = cast_floating(run.model(), DTYPES[dtype])
    stop = tokenizer.end_of_document
    arguments = (model, jnp.asarray(ids[None]), jax.random.key(seed), budget, sampling, stop)
    started = time.perf_counter()
    compiled = eqx.filter_jit(generate).lower(*arguments).compile()
    compiled_at = time.perf_counter()
    generation: Generation = jax.block_until_ready(compiled(*arguments))
    done = time.perf_counter()
    continuation = new_tokens(generation, stop_token=stop)
    text = tokenizer.decode(np.asarray(continuation, np.int64))
    return Sample(text, continuation, len(ids), run.step, compiled_at - started, done - compiled_at)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory launch/run.py wrote")
    parser.add_argument("--prompt", required=True, help="the text to continue ('' starts a new document)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="at most this many new tokens (default: 256, or what fits)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); > 0: sample")
    parser.add_argument("--top-p", type=float, default=1.0, help="draw from the nucleus of this probability (<= 1)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling's random seed")
    parser.add_argument("--dtype", default="float32", help="float32 (the checkpoint's weights) or bfloat16")
    args = parser.parse_args(argv)
    try:
        made = sample(
            args.run_dir,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            step=args.step,
            seed=args.seed,
            dtype=args.dtype,
        )
    except FerryError as error:
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    print(args.prompt + made.text)
    print(
        f"{len(made.ids)} new tokens after a prompt of {made.prompt_length} in {made.seconds:.3f} s: "
        f"{made.tokens_per_second:.1f} tokens/s on {jax.devices()[0].platform} "
        f"(compiled in {made.compile_seconds:.1f} s; checkpoint step {made.step} of {args.run_dir})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    from ferry.cpu_only import keep_jax_to_the_cpu

    keep_jax_to_the_cpu()  # before JAX starts a backend: no accelerator plugin's traceback on a CPU-only machine
    sys.exit(main(sys.argv[1:]))
