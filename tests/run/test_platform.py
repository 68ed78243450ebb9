"""Platform configs: XLA flags reach the backend only when applied before it starts."""

import os

import jax
import pytest

from ferry.platform import GPU_MIN_JAX, apply_platform, jax_release
from tests.conftest import load_platform, run_launcher, run_python

# Below GPU_MIN_JAX the launcher refuses platform=gpu before it shows the platform's flags
# (test_gpu_needs_jax_0_12_and_says_why checks that refusal on every jax).
needs_gpu_jax = pytest.mark.skipif(
    jax_release(jax.__version__) < GPU_MIN_JAX,
    reason=f"jax {jax.__version__} refuses platform=gpu before its flags are shown (jax >= 0.12 shows them)",
)


def test_gpu_flags_and_host_pool():
    gpu = load_platform("gpu")
    assert gpu.flag_string() == (
        "--xla_disable_hlo_passes=rematerialization --xla_gpu_enable_latency_hiding_scheduler=true "
        "--xla_gpu_enable_pipelined_host_offloading=false --xla_gpu_memory_limit_slop_factor=112"
    )
    env = gpu.environment({"XLA_FLAGS": "--xla_dump_to=/tmp/dump"})
    assert env["XLA_FLAGS"].endswith(" --xla_dump_to=/tmp/dump")  # the user's own flags are kept, read last
    assert env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "64" and env["XLA_CLIENT_MEM_FRACTION"] == "0.95"
    assert load_platform("tpu").flag_variable == "LIBTPU_INIT_ARGS"
    assert load_platform("cpu").environment({}) == {}


def test_accelerators_keep_a_persistent_compilation_cache_an_exported_one_wins():
    home = os.path.expanduser("~")
    for name in ("tpu", "gpu"):
        assert load_platform(name).environment({})["JAX_COMPILATION_CACHE_DIR"] == f"{home}/.cache/ferry/jax"
        assert "JAX_COMPILATION_CACHE_DIR" not in load_platform(name).environment({"JAX_COMPILATION_CACHE_DIR": "/x"})
    assert load_platform("cpu").compilation_cache is None


def test_the_compilation_cache_receives_the_programs_compiled_after_the_platform_is_applied(tmp_path):
    code = (
        "import os; os.environ.pop('JAX_COMPILATION_CACHE_DIR', None); "  # the test session's own cache
        "import jax, jax.numpy as jnp; from ferry.platform import PlatformConfig, apply_platform; "
        "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
        f"apply_platform(PlatformConfig('cpu', compilation_cache={str(tmp_path / 'cache')!r})); "
        "print(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(4)).sum())"
    )
    result = run_python(code, timeout=120)
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "cache").iterdir()), "no program reached the cache"


def test_flags_take_effect_before_the_backend_starts():
    code = (
        "import jax; from ferry.platform import PlatformConfig, apply_platform; "
        "apply_platform(PlatformConfig('cpu', {'xla_force_host_platform_device_count': 3})); "
        "print(jax.device_count())"
    )
    result = run_python(code, timeout=120)
    assert result.stdout.strip() == "3", result.stderr


def test_applying_after_the_backend_started_is_refused():
    jax.devices()
    with pytest.raises(RuntimeError, match="already started"):
        apply_platform(load_platform("gpu"))


@needs_gpu_jax
def test_launcher_prints_the_platform_and_refuses_a_gpu_it_does_not_have(tmp_path):
    """platform=gpu on this CPU-only machine: the flags are shown, then the run is refused in one
    line instead of training on the CPU without a word."""
    result = run_launcher("platform=gpu", "train.steps=1", "train.warmup_steps=0", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr + result.stdout
    assert (
        "platform gpu: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=64, XLA_CLIENT_MEM_FRACTION=0.95, "
        "XLA_FLAGS=--xla_disable_hlo_passes=rematerialization" in result.stdout
    )
    assert "platform=gpu but JAX cannot start a GPU backend" in result.stdout and "platform=cpu" in result.stdout
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def test_gpu_needs_jax_0_12_and_says_why(monkeypatch):
    """Below jax 0.12 XLA:GPU miscompiles host reads in backward loops (openxla/xla #46231):
    platform=gpu is refused in one line naming the bug and the upgrade, before any backend
    starts; CPU and TPU still run on that jax."""
    from tests.launcher_cases import load_launcher, run_case

    assert jax_release("0.12.0.1") == (0, 12, 0, 1) and jax_release("0.10.2.dev20260101") == (0, 10, 2)
    assert jax_release("0.13.0rc1") == (0, 13, 0) > (0, 12)
    monkeypatch.setattr(jax, "__version__", "0.10.2")
    launcher = load_launcher()
    refused = run_case(launcher, ["platform=gpu", "train.steps=1", "train.warmup_steps=0"])
    assert refused["code"] == 2, refused
    line = refused["stdout"].strip()
    assert "\n" not in line and "platform=gpu needs jax >= 0.12, and this is jax 0.10.2" in line
    assert "openxla/xla #46231" in line and 'pip install -U "jax[cuda12]>=0.12"' in line
    assert "platform gpu:" not in line  # refused before the platform's flags were applied
