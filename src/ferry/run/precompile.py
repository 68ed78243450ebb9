"""`mode=compile target=<TPU>`: a run's train step, and its state's random init, compiled for its
TPU on this machine's CPU, into JAX's persistent compilation cache (`platform.compilation_cache`),
so that the same run on the chip loads the programs instead of compiling them (most of a run's
start at the v5e benchmark's shape: docs/results/tpu-v5e.md, run 6). It never opens a chip, so
compiles run side by side, beside a run that holds the chip. A step over the chip's HBM is the
run's own one-line refusal, before any run starts.

The program is the run's to the byte (`ferry.train.recipe.StepRecipe`, compiled over a mesh of
the target's compile-only devices), under the run's XLA flags: JAX keys its cache on the program,
the flags (`LIBTPU_INIT_ARGS`), the compile options and the chip's topology, and a run misses the
cache, compiling as before, where any of them differs."""

import dataclasses
import os
import time

import jax
from rich.console import Console

from ferry.config.root import FerryConfig
from ferry.errors import ConfigError
from ferry.plan.planner import compile_only_mesh, for_target
from ferry.platform import CACHE_VARIABLE
from ferry.run.out_of_memory import over_hbm_refusal
from ferry.run.preflight import checked_corpus, checked_tokenizer
from ferry.train.memory import CompiledMemory
from ferry.train.recipe import StepRecipe
from ferry.train.state_layout import random_init
from ferry.xla.compile_oom import StepOverHbm
from ferry.xla.scheduler_costs import ProfileCache
from ferry.xla.targets import TARGETS, Target, target_names


def check_compile_target(config: FerryConfig) -> Target:
    """The TPU `mode=compile` compiles for; refused (a ConfigError) for any other target, a
    platform other than the TPU's, or without a cache to fill."""
    target = TARGETS.get(config.target or "")
    if target is None or target.platform != "tpu":
        raise ConfigError(
            f"mode=compile target={config.target}: it compiles for TPUs ({', '.join(target_names('tpu'))}), "
            "whose compiler runs without a chip; a GPU run compiles on its own GPU"
        )
    if config.platform.name != "tpu":
        raise ConfigError("mode=compile compiles the run of platform=tpu; add platform=tpu to the command")
    if config.platform.compilation_cache is None and not os.environ.get(CACHE_VARIABLE):
        raise ConfigError("mode=compile fills JAX's compilation cache: set platform.compilation_cache to a directory")
    return target


def precompile(config: FerryConfig, console: Console) -> str:
    """Compile `config`'s train step for `config.target` into the compilation cache
    (`check_compile_target`); return the line saying what was compiled, in how long, and where
    (`console` takes what preparing the data says)."""
    target = check_compile_target(config)
    variables = config.run_platform.environment(os.environ)  # the run's flags: part of the cache's key
    cache = variables.get(CACHE_VARIABLE) or os.environ[CACHE_VARIABLE]
    os.environ.update(variables)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's lockfile would keep it off a busy VM
    jax.config.update("jax_platforms", "cpu")  # libtpu then only serves the compile-only topology
    jax.config.update("jax_compilation_cache_dir", cache)
    config = dataclasses.replace(config, model=for_target(config.model, target))  # as the chip runs it
    mesh = compile_only_mesh(target, config.mesh)
    checked_corpus(config, checked_tokenizer(config), console)  # the data prepared too: the run reads its cache
    recipe = StepRecipe.of(config, mesh)
    where = f"{mesh.size} x {target.description}"
    try:  # as the run compiles it (`compile_checked`): no per-compile options
        step = recipe.compile(None, ProfileCache.of(config.platform), None, where)
    except StepOverHbm as over:
        raise over_hbm_refusal(over, config, target.name) from over
    memory = CompiledMemory.of(step.compiled)
    size = "" if memory is None else f" ({memory.describe()}; step peak {memory.device_bytes / 2**30:.2f} GiB)"
    init = ""
    if config.init.from_hf is None:  # the state's random init, which the run compiles before its first step
        started = time.perf_counter()
        with jax.set_mesh(mesh):  # as the run builds its state
            random_init(recipe.layout).lower().compile()
        init = f" and the state's random init in {time.perf_counter() - started:.1f} s"
    return f"compiled the train step for {where} in {step.seconds:.1f} s{size}{init}, into {cache}"
