"""A run that cannot be hurt: one writer per run directory, checkpoints verified by checksums,
memory checked before it is spent, Ctrl-C, retries after a failed start, logs that read well in a
file, and damaged Hugging Face checkpoints refused naming the file."""

import importlib.util
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console
from safetensors.numpy import save_file

import ferry.train.memory as memory_module
from ferry.errors import ConfigError, JsonFileError, read_json
from ferry.hf import CheckpointError as HFCheckpointError
from ferry.hf.safetensors_io import read_header
from ferry.run.checkpoint import Checkpoints, RunCheckpointError, array_checksums, checkpoint_steps
from ferry.run.details_log import DETAILS_LOG
from ferry.run.lock import LOCK_FILE, acquire
from ferry.run.preflight import prepare
from ferry.run.training import train
from ferry.train.memory import CompiledMemory, InsufficientMemoryError, check_step_fits
from tests.conftest import ROOT, compose_config
from tests.launcher_cases import load_launcher
from tests.old_default import OLD_DEFAULT
from tests.run.test_bad_inputs import COMMON, run_cases, tree_digest


def run_in_process(run_dir, *overrides):
    out = io.StringIO()
    console = Console(file=out, width=200)
    train(prepare(compose_config(*COMMON, *overrides, f"run.dir={run_dir}"), console), "config: test\n", console)
    return out.getvalue()


@pytest.fixture(scope="module")
def two_checkpoints(finished_run):
    """A finished run with checkpoints at steps 2 and 4 (the bad-input table's, never changed)."""
    assert checkpoint_steps(finished_run / "checkpoints") == [2, 4]
    return finished_run


# --- one writer per run directory ---------------------------------------------------------------


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": "node7", "pid": 999999, "since": "yesterday"}))
    lock = acquire(run_dir)
    assert lock.stale_holder == "pid 999999 on host node7 since yesterday"
    lock.started = True
    lock.release()
    assert (run_dir / LOCK_FILE).read_text() == ""  # released cleanly: nothing stale next time
    assert acquire(run_dir).stale_holder is None


@pytest.mark.filterwarnings("ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_step_that_exists_is_never_silently_skipped(two_checkpoints, tmp_path):
    config = compose_config(*COMMON)
    checkpoints = Checkpoints(two_checkpoints / "checkpoints", config.checkpoint)
    try:
        with pytest.raises(RunCheckpointError, match="step 4 already exists .* this run did not write it"):
            checkpoints.save(4, {"x": jnp.zeros(3)}, {"next_index": 0}, {})
    finally:
        checkpoints.close()


# --- checkpoints verified ---------------------------------------------------------------------


def test_checksums_see_one_flipped_bit_and_a_swap():
    x = jnp.arange(1000, dtype=jnp.float32)
    flipped = x.at[517].set(jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x[517], jnp.uint32) ^ 1, x.dtype))
    swapped = x.at[3].set(x[4]).at[4].set(x[3])
    sums = [array_checksums({"a": v})["['a']"] for v in (x, flipped, swapped)]
    assert len({tuple(s) for s in sums}) == 3
    assert array_checksums({"a": x.astype(jnp.bfloat16)}) == array_checksums({"a": x.astype(jnp.bfloat16)})


def test_checksums_keep_the_values_earlier_checkpoints_were_saved_with():
    """The digests of checkpoint format 2 as the first ferry to write them computed them (one
    program over all leaves; now one per leaf kind): a step saved before verifies after."""
    tree = {
        "f32": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
        "bf16": jnp.linspace(-1, 1, 6, dtype=jnp.bfloat16),
        "step": jnp.array(7, jnp.int32),
        "mask": jnp.array([True, False, True]),
        "key": jax.random.key(0),
    }
    assert array_checksums(tree) == {
        "['bf16']": [3159276653, 2758662146],
        "['f32']": [1490278729, 116424568],
        "['key']": [3192479952, 3997981219],
        "['mask']": [509044187, 3132041000],
        "['step']": [2370615769, 2003762935],
    }


# Orbax's failed restore can leave a TensorStore callback to an asyncio loop it has closed
@pytest.mark.filterwarnings("ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_changed_in_place_is_refused_and_nothing_is_rotated_away(two_checkpoints, tmp_path):
    """5 KB overwritten inside the largest array file of the latest step, the file's size kept:
    the resume is refused naming the step to fall back to, both steps stay, and after moving the
    damaged one aside the run resumes from the earlier one."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    files = [p for p in (run_dir / "checkpoints" / "4" / "state").rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 5120] = np.random.default_rng(0).integers(0, 256, 5120, dtype=np.uint8).tobytes()
    largest.write_bytes(bytes(data))
    before = tree_digest(run_dir)
    refusal = r"step 4 .* (fails its checksums|cannot be read).* resume from step 2"
    with pytest.raises(RunCheckpointError, match=refusal):
        run_in_process(run_dir, "train.steps=8", "checkpoint.keep=1")
    after = tree_digest(run_dir)
    after.pop(DETAILS_LOG, None)  # where an unreadable step's whole error goes
    assert after == before  # nothing written, nothing rotated away
    shutil.move(run_dir / "checkpoints" / "4", tmp_path / "damaged_4")
    assert "resuming from step 2" in run_in_process(run_dir, "train.steps=6")


# --- memory checked before it is spent --------------------------------------------------------


def test_a_step_that_cannot_fit_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    """The compiled step's memory analysis against a host with 1 MiB free: refused naming the
    figures and the levers; the run directory it claimed is gone again."""
    monkeypatch.setattr(memory_module, "step_capacity", lambda: (None, 2**20, "host RAM available (test)"))
    run_dir = tmp_path / "run"
    with pytest.raises(InsufficientMemoryError) as refused:
        run_in_process(run_dir)
    message = str(refused.value)
    assert "the compiled train step needs" in message and "temporaries" in message and "1.0 MiB available" in message
    for lever in ("offload=", "train.micro_batch_size=", "train.seq_len", "mode=plan"):
        assert lever in message
    assert not run_dir.exists()


def test_a_device_step_is_checked_against_the_device():
    gib = 2**30
    step = CompiledMemory(arguments=gib, outputs=gib, aliased=gib, temporaries=30 * gib, code=0, host_temporaries=0)
    assert step.device_bytes == 31 * 2**30
    capacity = memory_module.step_capacity
    try:
        memory_module.step_capacity = lambda: (16 * 2**30, 2**40, "H200 memory_stats()")
        with pytest.raises(InsufficientMemoryError, match=r"needs 31.00 GiB per device .* 16.00 GiB free"):
            check_step_fits(step, "levers")
        memory_module.step_capacity = lambda: (64 * 2**30, 2**40, "H200 memory_stats()")
        check_step_fits(step, "levers")
    finally:
        memory_module.step_capacity = capacity


# --- Ctrl-C, retries, and logs in a file ------------------------------------------------------


# The launcher with Ctrl-C as a terminal delivers it: a shell's background job (CI run with `&`)
# starts its children ignoring SIGINT, and Python then never raises KeyboardInterrupt. Set in the
# child itself (a `preexec_fn` would fork a threaded process).
WITH_CTRL_C = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_interrupted_start_then_retry_then_resume_after_a_dead_holder(tmp_path):
    """Ctrl-C before the first checkpoint exits 130 saying so, in a launcher whose output goes to a
    file: the tables are whole and there is no CUDA or libtpu start-up noise. The same run.dir
    then starts over (train.steps=10, whose default warmup does not fit, with a note); a lock left
    by a dead process and a torn last metrics line do not stop the next resume."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "COLUMNS")}
    command = [*COMMON, "train.steps=100000", "train.log_every=1", "checkpoint.every=0", f"run.dir={run_dir}"]
    command.append("log.verbose=true")  # the start-up report on stdout, whose tables must be whole
    command.append(OLD_DEFAULT)  # its pinned host figure is the offloading preset's (tests/old_default.py)
    with open(tmp_path / "stdout.txt", "w") as out, open(tmp_path / "stderr.txt", "w") as err:
        first = subprocess.Popen(
            [sys.executable, "-c", WITH_CTRL_C, str(ROOT / "launch" / "run.py"), *command],
            cwd=ROOT,
            stdout=out,
            stderr=err,
            env=env,
        )
    deadline = time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and first.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    code = first.wait(timeout=120)
    stdout, stderr = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert code == 130, stdout + stderr
    assert stdout.strip().splitlines()[-1] == (
        f"interrupted before the first checkpoint of {run_dir}; the same command starts the run over"
    )
    assert "Traceback" not in stderr
    assert "│ decoder x2 │ decoder_layer_input │" in stdout and "placement" in stdout  # whole, not cut at 80
    assert "pinned host per device: planned 352.0 KiB (the schedule), compiled 0 B" in stdout
    for noise in ("cuda", "CUDA", "libtpu", "TPU", "Source Location Trace"):
        assert noise not in stderr, stderr

    output = run_in_process(run_dir, "train.steps=10", "train.warmup_steps=20", "train.log_every=1")
    assert "starting it over" in output
    config = compose_config(*COMMON, "train.steps=10", "train.warmup_steps=20")
    assert config.train.warmup_steps == 1 and "warming up over 1 step(s)" in config.notes[0]
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, 11))  # the interrupted attempt's records are gone

    (run_dir / LOCK_FILE).write_text(json.dumps({"host": "node7", "pid": 999999, "since": "yesterday"}))
    with metrics.open("a") as f:
        f.write('{"step": 11, "loss": 4.')  # a write cut short by a kill
    with pytest.warns(UserWarning, match=r"metrics.jsonl:\d+ is not a JSON record .* dropped"):
        output = run_in_process(run_dir, "train.steps=12", "train.log_every=1")
    assert "took over the lock of pid 999999 on host node7" in output and "resuming from step 10" in output
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, 13))


# --- refusals of the planner's extra and of damaged files -------------------------------------


def test_plan_without_the_extra_says_how_to_install_it():
    launcher = load_launcher()
    for target in ("h200", "v5p"):
        with pytest.raises(ConfigError, match=r'pip install -e "\.\[plan\]"'):
            launcher.check_plan_extra(target, find_spec=lambda name: None)
    if importlib.util.find_spec("jax_cuda12_plugin") is not None:  # the plan extra is installed (not on 3.11)
        launcher.check_plan_extra("h200")


def test_invalid_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    with pytest.raises(JsonFileError, match=rf"{path} is not valid JSON: .* line 3, column"):
        read_json(path, "the checkpoint's config")


def test_damaged_safetensors_are_refused_naming_the_file(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, str(good))
    assert read_header(good)["w"].shape == (8, 8)
    damaged = {
        "tiny.safetensors": good.read_bytes()[:5],
        "short.safetensors": good.read_bytes()[:-16],
        "header.safetensors": struct.pack("<Q", 10) + b"not json!!" + b"\0" * 8,
        "claims.safetensors": struct.pack("<Q", 10**9) + b"{}",
    }
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(HFCheckpointError, match=rf"{tmp_path / name} is not a readable safetensors file"):
            read_header(tmp_path / name)


def test_damaged_hf_checkpoints_through_the_launcher(tmp_path):
    from ferry.hf import save_pretrained
    from ferry.models.registry import build_model

    config = compose_config(*COMMON)
    source = tmp_path / "hf"
    save_pretrained(build_model(config.model, jax.random.key(0)), source)
    short, bad_json = tmp_path / "short", tmp_path / "bad_json"
    shutil.copytree(source, short)
    shutil.copytree(source, bad_json)
    weights = short / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (bad_json / "config.json").write_text((source / "config.json").read_text()[:-20])
    results = run_cases(
        [[*COMMON, f"init.from_hf={d}", f"run.dir={tmp_path / d.name / 'run'}"] for d in (short, bad_json)]
    )
    for result, named in zip(results, (weights, bad_json / "config.json"), strict=True):
        assert result["code"] == 2 and "Traceback" not in result["stderr"], result
        (error,) = [line for line in result["stdout"].splitlines() if line.startswith("error:")]
        assert "init.from_hf=" in error and str(named) in error, error
    assert "line " in error  # the JSON's line and column
    assert not (short / "run").exists() and not (bad_json / "run").exists()


def test_checkpoint_final_false_saves_only_the_periodic_steps(tmp_path):
    """checkpoint.final=false (a benchmark's throwaway run): no save after the last step, the
    periodic ones and SIGTERM's kept."""
    from ferry.config.root import CheckpointConfig

    keeping = Checkpoints(tmp_path / "a", CheckpointConfig(every=5))
    throwaway = Checkpoints(tmp_path / "b", CheckpointConfig(every=5, final=False))
    assert keeping.due(7, last=True) and not throwaway.due(7, last=True)
    assert throwaway.due(5) and throwaway.due(10, last=True) and not throwaway.due(7)
    keeping.close()
    throwaway.close()
