"""A complete training run on CPU: checkpoints and exact resume, preemption, a damaged checkpoint,
evaluation, metrics, TensorBoard, profiling and non-finite losses.

The runs are shared between the assertions (module-scoped) and run in this process, except the
preempted one, a real `launch/run.py` process that gets SIGTERM (it runs alongside the others).
"""

import hashlib
import io
import json
import shutil
import signal
import struct
import threading
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

import ferry.train.step as step_module
from ferry.data.pipeline import PackedWindows, window_batches
from ferry.run.checkpoint import Checkpoints, RunCheckpointError, checkpoint_steps
from ferry.run.details_log import DETAILS_LOG
from ferry.run.lock import RunDirectoryError
from ferry.run.nonfinite import NonFiniteLossError
from ferry.run.preflight import prepare
from ferry.run.training import train
from ferry.train.optimizer import make_optimizer
from ferry.train.state_layout import state_layout
from tests.conftest import compose_config, start_launcher

STEPS = 8
COMMON = (
    f"train.steps={STEPS}",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.eval_every=4",
    "train.eval_batches=1",
    "train.global_batch_size=4",
    "train.seq_len=32",
    "checkpoint.every=4",
    "data=synthetic",
    "data.synthetic_tokens=20000",
)
METRIC_FIELDS = {
    "step",
    "loss",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "tflops_per_s_per_device",
    "mfu",
    "mfu_convention",
    "mfu_full_attention",
    "pinned_host_bytes_planned",
    "pinned_host_bytes_compiled",
    "nonfinite_steps",
}


def run(run_dir, *overrides):
    """`python launch/run.py COMMON OVERRIDES run.dir=RUN_DIR` in this process; returns what it printed."""
    out = io.StringIO()
    console = Console(file=out, width=200)
    config = compose_config(*COMMON, *overrides, f"run.dir={run_dir}")
    train(prepare(config, console), "config: test\n", console)
    return out.getvalue()


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in records(run_dir) if "loss" in r]


def tensorboard_scalars(run_dir, tag):
    """(step, value) of a scalar, read from the event files' TFRecord framing and Event protos."""
    from tensorboardX.proto.event_pb2 import Event

    values = []
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            values += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return values


def tree_digest(path):
    return {p.relative_to(path): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()}


def poison_batch_loss(monkeypatch, step):
    """Make the total loss NaN for the batch of `step` (found through the data pipeline)."""
    config = compose_config(*COMMON)
    tokens = np.random.default_rng(config.data.seed).integers(0, 256, config.data.synthetic_tokens).astype(np.uint8)
    windows = PackedWindows(tokens, config.train.seq_len)
    row = windows.rows(window_batches(windows, config.train.global_batch_size, config.data.seed)[step - 1])[0]
    real = step_module.batch_loss

    def poisoned(model, batch, settings):
        loss, stats = real(model, batch, settings)
        return loss * jnp.where(jnp.all(batch[0] == row), jnp.nan, 1.0), stats

    monkeypatch.setattr(step_module, "batch_loss", poisoned)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A launcher process on 2 CPU devices (FSDP) that gets SIGTERM once training has started;
    it runs while the tests in this process do."""
    run_dir = tmp_path_factory.mktemp("preempted") / "run"
    process = start_launcher(
        *COMMON,
        "train.steps=100000",
        "checkpoint.every=0",
        "log.tensorboard=false",
        "platform.cpu_devices=2",
        "mesh.fsdp=2",
        f"run.dir={run_dir}",
        log_dir=run_dir.parent / "logs",
    )

    def terminate_once_started() -> None:
        deadline = time.monotonic() + 240
        while not (run_dir / "config.yaml").exists() and process.process.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)  # config.yaml is written once SIGTERM is handled, before compiling
        process.process.send_signal(signal.SIGTERM)

    signaller = threading.Thread(target=terminate_once_started, daemon=True)
    signaller.start()
    yield run_dir, process
    signaller.join()
    if process.process.poll() is None:
        process.process.kill()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, preempted):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    output = run(run_dir, "profile.start_step=2", "profile.steps=2")
    return run_dir, output


@pytest.fixture(scope="module")
def stopped_then_resumed(tmp_path_factory, uninterrupted):
    """Step 6's loss is NaN: the run stops with step 5 checkpointed; the same command resumes."""
    run_dir = tmp_path_factory.mktemp("resumed") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        poison_batch_loss(monkeypatch, 6)
        with pytest.raises(NonFiniteLossError) as stopped:
            run(run_dir)
    stopped_records = records(run_dir)
    stopped_steps = checkpoint_steps(run_dir / "checkpoints")
    output = run(run_dir)
    return run_dir, str(stopped.value), stopped_records, stopped_steps, output


def test_run_logs_metrics_evaluation_tensorboard_and_a_profile(uninterrupted):
    run_dir, output = uninterrupted
    text = " ".join(output.split())
    for printed in ("131,392 parameters", "mesh data=1 x fsdp=1", "offload schedule: minimal_offloaded", "D2H"):
        assert printed in text
    assert "compiled step, per device: arguments" in text and "temporaries" in text
    assert "peak" in text and "bfloat16 matmul measured on this CPU" in text
    logged = [r for r in records(run_dir) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    for record in logged:
        assert METRIC_FIELDS <= record.keys(), METRIC_FIELDS - record.keys()
        assert record["tflops_per_s_per_device"] > 0 and 0 < record["mfu"] < 1
        # causal attention halved (MaxText since its PR #1988); the whole T x T beside it, higher
        assert record["mfu_convention"] == "causal_attention_halved" and record["mfu_full_attention"] > record["mfu"]
        assert record["pinned_host_bytes_planned"] > 0 and record["nonfinite_steps"] == 0
        assert record["pinned_host_bytes_compiled"] == 0  # the CPU backend's memory analysis: no pinned host
    evals = {r["step"]: r for r in records(run_dir) if "eval_loss" in r}
    assert sorted(evals) == [0, 4, 8]
    assert evals[8]["eval_perplexity"] == pytest.approx(np.exp(evals[8]["eval_loss"]))
    assert tensorboard_scalars(run_dir, "loss") == [(r["step"], pytest.approx(r["loss"])) for r in logged]
    assert [s for s, _ in tensorboard_scalars(run_dir, "eval_loss")] == [0, 4, 8]
    assert list((run_dir / "profile").rglob("*.xplane.pb"))
    assert checkpoint_steps(run_dir / "checkpoints") == [4, 8]


def test_stopped_and_resumed_run_repeats_the_uninterrupted_losses_bitwise(uninterrupted, stopped_then_resumed):
    run_dir, message, stopped_records, stopped_steps, output = stopped_then_resumed
    assert "not finite at step 6" in message and "the state of step 5 is checkpointed" in message
    assert stopped_steps == [4, 5]
    assert [r["step"] for r in stopped_records if "loss" in r] == [1, 2, 3, 4, 5]
    assert "resuming from step 5" in output
    assert losses(run_dir) == losses(uninterrupted[0])  # floats from JSON: bitwise
    evals = [(r["step"], r["eval_loss"]) for r in records(run_dir) if "eval_loss" in r]
    assert evals == [(r["step"], r["eval_loss"]) for r in records(uninterrupted[0]) if "eval_loss" in r]
    assert checkpoint_steps(run_dir / "checkpoints") == [4, 5, 8]


def test_sigterm_saves_a_checkpoint_that_restores_onto_another_mesh(preempted, uninterrupted):
    run_dir, process = preempted
    code, stdout, stderr = process.wait(timeout=300)
    assert code == 0, stderr[-3000:]
    (step,) = checkpoint_steps(run_dir / "checkpoints")
    assert f"SIGTERM: stopped after step {step}" in " ".join(stdout.split())
    assert records(run_dir)[-1]["step"] == step
    # written on 2 devices (FSDP), restored onto this process's single device
    config = compose_config(*COMMON)
    mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    layout = state_layout(config.model, make_optimizer(config.train), mesh)
    checkpoints = Checkpoints(run_dir / "checkpoints", config.checkpoint)
    arrays, data_state = checkpoints.restore(step, layout.abstract())
    checkpoints.close()
    assert int(arrays.step) == step and data_state == {"next_index": step}
    embed = arrays.model.embed.weight
    assert embed.sharding.mesh.size == 1 and np.isfinite(np.asarray(embed)).all()


def test_a_run_directory_is_resumed_only_by_its_own_model(uninterrupted, tmp_path):
    run_dir = uninterrupted[0]
    with pytest.raises(RunDirectoryError, match="holds checkpoints up to step 8 and run.resume=false refuses"):
        run(run_dir, "run.resume=false")
    with pytest.raises(RunCheckpointError, match=r"another model or shape: .*dim: 64 -> 32"):
        run(run_dir, "model.dim=32")
    before = tree_digest(run_dir)
    assert "is complete: its latest checkpoint is step 8" in run(run_dir)
    assert tree_digest(run_dir) == before
    (tmp_path / "metrics.jsonl").write_text("precious\n")
    with pytest.raises(RunDirectoryError, match="already holds files but no checkpoint to resume"):
        run(tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == "precious\n"


# Orbax's failed restore can leave a TensorStore callback to an asyncio loop it has closed
@pytest.mark.filterwarnings("ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_latest_checkpoint_fails_clearly_and_an_unfinished_save_is_ignored(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted[0], run_dir)
    # a save cut short leaves Orbax's temporary directory, never listed as a step
    shutil.copytree(run_dir / "checkpoints" / "8", run_dir / "checkpoints" / "12.orbax-checkpoint-tmp-1")
    (run_dir / "checkpoints" / "12.orbax-checkpoint-tmp-1" / "commit_success.txt").unlink()
    assert checkpoint_steps(run_dir / "checkpoints") == [4, 8]
    for path in (run_dir / "checkpoints" / "8" / "state").rglob("*"):
        if path.is_file() and "ocdbt" in str(path):
            path.write_bytes(b"damaged")
    before = tree_digest(run_dir)
    with pytest.raises(RunCheckpointError, match=r"checkpoint step 8 .* cannot be read .* to resume from step 4"):
        run(run_dir, "train.steps=12")
    after = tree_digest(run_dir)
    assert "Traceback" in (run_dir / DETAILS_LOG).read_text()  # TensorStore's whole error, kept off the line
    after.pop(Path(DETAILS_LOG))
    assert after == before  # nothing else written, step 4 untouched
    # as the message says: with step 8 moved aside the run resumes from step 4 (saved asynchronously
    # while the next steps reused the state's buffers), and repeats the uninterrupted losses
    shutil.move(run_dir / "checkpoints" / "8", tmp_path / "damaged_8")
    assert "resuming from step 4" in run(run_dir)
    assert losses(run_dir) == losses(uninterrupted[0])


def test_nonfinite_loss_is_skipped_and_counted(uninterrupted, tmp_path, monkeypatch):
    poison_batch_loss(monkeypatch, 6)
    output = run(tmp_path / "run", "train.on_nonfinite=skip")
    assert "train.on_nonfinite=skip: skipped the update of 1 of 8 steps" in " ".join(output.split())
    logged = {r["step"]: r for r in records(tmp_path / "run") if "loss" in r}
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert [logged[s]["nonfinite_steps"] for s in range(1, STEPS + 1)] == [0] * 5 + [1] * 3
    assert np.isnan(logged[6]["total_loss"]) and np.isfinite(logged[7]["loss"])
    reference = dict(losses(uninterrupted[0]))
    assert [logged[s]["loss"] for s in range(1, 7)] == [reference[s] for s in range(1, 7)]
    assert logged[7]["loss"] != reference[7]  # step 6's update was skipped
    config = compose_config(*COMMON)
    mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    checkpoints = Checkpoints(tmp_path / "run" / "checkpoints", config.checkpoint)
    arrays, _ = checkpoints.restore(8, state_layout(config.model, make_optimizer(config.train), mesh).abstract())
    checkpoints.close()
    assert int(arrays.step) == 8 and int(arrays.nonfinite_steps) == 1
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(eqx.filter(arrays, eqx.is_array)))
