"""`mode=compile target=v5e`: a run's train step compiled for the TPU on this CPU, into JAX's
compilation cache, writing nothing else; refused where it could not serve the run. That the chip's
run then loads the program instead of compiling it is measured on the chip (`tpu_check`'s cases:
`compiled_ahead_s` in benchmarks/results/tpu_v5e.json)."""

from ferry.platform import CACHE_VARIABLE
from tests.conftest import needs_libtpu, run_launcher

COMPILE = ("model=llama_tiny", "data=synthetic", "mode=compile", "target=v5e", "platform=tpu")


@needs_libtpu
def test_the_step_and_the_init_land_in_the_cache_and_nothing_else_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_VARIABLE, raising=False)  # the tests' own cache, which would win
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    where = (f"platform.compilation_cache={cache}", f"run.dir={run_dir}")
    done = run_launcher(*COMPILE, "offload=minimal_offloaded", *where, old_default=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiled the train step for 1 x TPU v5e" in done.stdout and str(cache) in done.stdout
    assert "and the state's random init in" in done.stdout
    for noise in ("unexpected worker hostname", "Source Location Trace", "E0000"):  # libtpu's, on no TPU VM
        assert noise not in done.stderr, done.stderr
    entries = sorted(p.name for p in cache.glob("*-cache"))  # JAX keeps an access time beside each (`-atime`)
    assert [name.split("-")[0] for name in entries] == ["jit_initial_arrays", "jit_step"], entries  # no other program
    assert not run_dir.exists()


def test_a_run_that_chooses_its_preset_at_start_up_is_refused(tmp_path):
    """Without offload= a run picks its preset on its own chip (`ferry.run.default_policy`): which
    step to compile is not known here."""
    done = run_launcher(*COMPILE, f"run.dir={tmp_path}", old_default=False)
    assert done.returncode == 2 and "error: mode=compile compiles one preset's step" in done.stdout


@needs_libtpu
def test_autos_candidates_compile_ahead_side_by_side_each_saying_how_it_went(tmp_path, monkeypatch):
    """`ferry.run.compile_ahead`: each run config in its own process, at once; one that cannot be
    compiled for the chip says why, and costs the others nothing."""
    from ferry.config.overrides import compose_node
    from ferry.run.compile_ahead import compile_in_subprocesses
    from tests.conftest import CONFIGS

    monkeypatch.delenv(CACHE_VARIABLE, raising=False)
    cache = tmp_path / "cache"
    run = ["model=llama_tiny", "data=synthetic", "offload=minimal"]
    tpu = ["platform=tpu", f"platform.compilation_cache={cache}"]
    nodes = [compose_node("train", [*run, *tpu], CONFIGS), compose_node("train", [*run, "platform=cpu"], CONFIGS)]
    compiled, refused = compile_in_subprocesses(nodes, "v5e", timeout_s=300.0)
    assert compiled.startswith("compiled the train step for 1 x TPU v5e"), compiled
    assert refused.startswith("not compiled: mode=compile compiles the run of platform=tpu"), refused
    assert len(list(cache.glob("jit_step-*-cache"))) == 1
