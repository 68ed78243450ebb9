"""Shared fixtures: the tiny model and the offload presets, loaded from configs/ as a user's run
would load them."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Tests run on the CPU backend. With the planner's CUDA plugin installed, JAX would otherwise try
# (and fail) to start a GPU backend first; the plugin still serves compile-only GPU topologies.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's worker processes each compile for TPU targets without a TPU; libtpu's lockfile would
# let only the first of them load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# What ferry caches under $XDG_CACHE_HOME (the scheduler's cost profiles, raw sources' tokens) goes
# to a directory of this test session, not the user's cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ferry-tests-cache-")
# One persistent JAX compilation cache for the test session: its worker processes (xdist starts
# them with this process's environment), the runs they train in-process, and the launchers, scripts
# and helper processes they start compile each program once; a cached executable is the same code.
# A fresh directory per session, so nothing compiled by another version of ferry or jax is read. A
# size limit (far above what the suite writes) makes JAX lock the directory around each read and
# write: without one, a process could read an entry another is still writing.
os.environ.setdefault("FERRY_TESTS_JAX_CACHE_OWNER", str(os.getpid()))  # the session's first process
os.environ["FERRY_TESTS_JAX_CACHE"] = os.environ.get("FERRY_TESTS_JAX_CACHE") or tempfile.mkdtemp(
    prefix="ferry-tests-jax-cache-"
)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["FERRY_TESTS_JAX_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(64 * 2**30)
# The suite compiles tiny programs for the CPU backend hundreds of times, and LLVM's optimisation of
# the code it generates is most of each compile while buying nothing at these sizes: level 0 halves
# a compile (the DeepSeek launch test's step 17.6 s -> 8.8 s). Every process of the session,
# launchers included, compiles alike, so a comparison within the suite compares like with like.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import pytest
from omegaconf import OmegaConf

from ferry.config.overrides import group_presets, hydra_compose, preset_node
from ferry.config.root import FerryConfig, load_config
from ferry.config.train import OffloadConfig
from ferry.config_schema import from_dict
from ferry.models.registry import model_config
from ferry.platform import PlatformConfig
from tests.old_default import with_old_default

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
# the placement presets, as configs/offload/ holds them; `auto` is not one but the planner's
# instruction to choose one
PRESETS = [name for name in group_presets(CONFIGS / "offload") if name != "auto"]


# Deviceless compiles for GPU and TPU targets need the planner's extra (the CUDA plugin, libtpu).
needs_cuda_plugin = pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda12_plugin") is None,
    reason='the planner needs the CUDA plugin for GPU targets: pip install -e ".[plan]"',
)
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the planner needs libtpu for TPU targets: pip install -e ".[plan]"',
)
GPU_FLAGS = {"xla_gpu_enable_latency_hiding_scheduler": True}  # the scheduler gpu.yaml turns on; XLA defaults else


def pytest_configure(config):
    # JAX writes the executables of compile-only devices (the planner's TPU and H200 targets) to the
    # cache but cannot read them back without a client of that platform: it says so and compiles
    # again, as it would without a cache.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Error reading persistent compilation cache entry.*PjRtCompiler must be constructed with a Client",
    )


def pytest_unconfigure(config):
    """The session's compilation cache goes with the process that made it (its workers have ended)."""
    if os.environ["FERRY_TESTS_JAX_CACHE_OWNER"] == str(os.getpid()):
        shutil.rmtree(os.environ["FERRY_TESTS_JAX_CACHE"], ignore_errors=True)


def load_model_config(name: str, **overrides):
    node = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml"))
    return model_config({**node, **overrides})


def compose_config(*overrides: str) -> FerryConfig:
    """The validated config `python launch/run.py OVERRIDES...` would run (offload=minimal_offloaded
    where they name no preset)."""
    cfg = hydra_compose(CONFIGS, "train", list(with_old_default(overrides)))
    return load_config(OmegaConf.to_container(cfg, resolve=True))


def load_preset(name: str) -> OffloadConfig:
    """The preset as `offload=NAME` composes it (its file merged over the keys it inherits)."""
    return from_dict(OffloadConfig, preset_node(CONFIGS, "offload", name))


def load_platform(name: str) -> PlatformConfig:
    return from_dict(PlatformConfig, preset_node(CONFIGS, "platform", name))


def preset_policy(name: str, model):
    """The preset's policy for `model` (a preset's `default` covers the names the model tags)."""
    return load_preset(name).policy(model.tagged_names())


# presets that place a routed expert's tensors (MaxText's `moe_` names), which only MoE layers tag
MOE_ONLY_PRESETS = {name for name in PRESETS if any(t.startswith("moe_") for t in load_preset(name).tensors)}


def run_launcher(*overrides: str, timeout: float = 300, old_default: bool = True) -> subprocess.CompletedProcess:
    """`python launch/run.py ...` as a user types it (`old_default`: with offload=minimal_offloaded
    where it names no preset)."""
    overrides = with_old_default(overrides) if old_default else overrides
    return subprocess.run(
        [sys.executable, str(ROOT / "launch" / "run.py"), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "120"},
    )


def run_python(code: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -c CODE` from the repository root: for checks that need a fresh JAX backend
    (XLA flags, a device count) other than this process's."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


class Background:
    """A command running in the background, its output going to files (a full pipe would stall
    it while the test waits on something else)."""

    def __init__(self, command: list[str], log_dir: Path):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = log_dir / "stdout.txt", log_dir / "stderr.txt"
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            env = {**os.environ, "COLUMNS": "120"}
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True, env=env)

    def wait(self, timeout: float = 900) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once the command has finished."""
        code = self.process.wait(timeout=timeout)
        return code, self.stdout_path.read_text(), self.stderr_path.read_text()


def start_launcher(*overrides: str, log_dir: Path) -> Background:
    """`python launch/run.py ...` in the background (offload=minimal_offloaded where it names no preset)."""
    return Background([sys.executable, str(ROOT / "launch" / "run.py"), *with_old_default(overrides)], log_dir)


@pytest.fixture(scope="session")
def tiny_config():
    return load_model_config("llama_tiny")


# A small, quick run: 4 steps of llama_tiny on synthetic tokens, checkpoints at steps 2 and 4.
SMALL_RUN = (
    "train.steps=4",
    "train.warmup_steps=1",
    "train.log_every=2",
    "train.eval_every=4",
    "train.eval_batches=1",
    "train.global_batch_size=4",
    "train.seq_len=32",
    "checkpoint.every=2",
    "data=synthetic",
    "data.synthetic_tokens=20000",
    "log.tensorboard=false",
)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A finished SMALL_RUN (checkpoints at 2 and 4, metrics, its lock file), trained once per
    session; tests that point bad commands at it must leave it unchanged."""
    import io

    from rich.console import Console

    from ferry.run.preflight import prepare
    from ferry.run.training import train

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    console = Console(file=io.StringIO(), width=200)
    train(prepare(compose_config(*SMALL_RUN, f"run.dir={run_dir}"), console), "config: test\n", console)
    return run_dir


@pytest.fixture(scope="module")
def trained_run(finished_run, tmp_path_factory):
    """A module's copy of the finished run with its config.yaml (`tests.generate.saved_runs`)."""
    from tests.generate.saved_runs import trained_run_of

    return trained_run_of(finished_run, tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer_run(finished_run, tmp_path_factory):
    """A module's copy of the finished run trained with a Hugging Face tokenizer."""
    from tests.generate.saved_runs import tokenizer_run_of

    return tokenizer_run_of(finished_run, tmp_path_factory)
