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


def test_every_platform_preset_lists_every_platform_key():
    """Each configs/platform/ file holds every PlatformConfig key, so any of them is set as
    `platform.KEY=VALUE` on any platform (`platform.compilation_cache` needed `+` on platform=cpu)."""
    import dataclasses

    from omegaconf import OmegaConf

    from ferry.platform import PlatformConfig
    from tests.conftest import CONFIGS, compose_config

    keys = {f.name for f in dataclasses.fields(PlatformConfig)}
    for path in sorted((CONFIGS / "platform").glob("*.yaml")):
        assert set(OmegaConf.load(path)) == keys, path.name
    assert compose_config("platform.compilation_cache=/tmp/cache").platform.compilation_cache == "/tmp/cache"


def test_an_unwritable_compilation_cache_is_refused_naming_where_it_was_set(monkeypatch, tmp_path):
    """JAX turns a cache it cannot write off with a warning (and compiles every time): refused
    before anything starts, naming the key, or the exported variable that wins over it."""
    from ferry.errors import ConfigError
    from ferry.run.config_paths import check_config_paths
    from tests.conftest import compose_config

    (tmp_path / "a_file").write_text("x")
    below_a_file = str(tmp_path / "a_file" / "cache")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    config = compose_config(f"platform.compilation_cache={below_a_file}")
    with pytest.raises(ConfigError, match=f"platform.compilation_cache={below_a_file} cannot be made"):
        check_config_paths(config)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", below_a_file)
    with pytest.raises(ConfigError, match=f"JAX_COMPILATION_CACHE_DIR={below_a_file} cannot be made"):
        check_config_paths(compose_config())
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))
    check_config_paths(config)  # the exported directory wins, and is writable


def test_jax_platforms_naming_another_backend_is_refused():
    """`JAX_PLATFORMS=tpu` (exported, or in platform.env) with platform=cpu would train on the CPU
    behind a start-up line showing it applied. An exported `cpu` alone is what ferry exports on a
    machine without an accelerator, and is let be."""
    from ferry.platform import PlatformConfig, PlatformError, check_jax_platforms

    cpu, tpu = PlatformConfig("cpu"), PlatformConfig("tpu")
    for environ in ({}, {"JAX_PLATFORMS": "cpu"}, {"JAX_PLATFORMS": "cpu,tpu"}, {"JAX_PLATFORMS": ""}):
        check_jax_platforms(cpu, environ)
    check_jax_platforms(tpu, {"JAX_PLATFORMS": "cpu"})  # ferry's own; a TPU's absence is refused at its start
    check_jax_platforms(PlatformConfig("gpu"), {"JAX_PLATFORMS": "cuda"})
    with pytest.raises(PlatformError, match="^JAX_PLATFORMS=tpu asks JAX .* platform=tpu and unset JAX_PLATFORMS"):
        check_jax_platforms(cpu, {"JAX_PLATFORMS": "tpu"})
    with pytest.raises(PlatformError, match="^JAX_PLATFORMS=cuda asks .* platform=gpu"):
        check_jax_platforms(tpu, {"JAX_PLATFORMS": "cuda"})
    with pytest.raises(PlatformError, match="^platform.env.JAX_PLATFORMS=tpu .* drop platform.env.JAX_PLATFORMS"):
        check_jax_platforms(PlatformConfig("cpu", env={"JAX_PLATFORMS": "tpu"}), {})


def test_an_exported_jax_platforms_the_run_would_not_use_is_one_line_exit_2(tmp_path):
    """The probe's command: `JAX_PLATFORMS=tpu python launch/run.py` on a machine without a TPU."""
    import subprocess
    import sys

    from tests.conftest import ROOT, SMALL_RUN

    result = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "run.py"), *SMALL_RUN, f"run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "tpu"},
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert error.startswith("error: JAX_PLATFORMS=tpu asks JAX for another backend than platform=cpu's")
    assert not (tmp_path / "run").exists()
