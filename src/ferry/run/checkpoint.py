"""Orbax checkpoints of a run: the train state, the data iterator's position and what the state
belongs to (the model and its parameter shapes), saved together as one step.

Each step also holds a checksum of every array of the state, computed on the devices from the
very arrays saved, and checked against the restored arrays: a step whose files were changed after
saving (of the same size, which Orbax's own reads do not notice) is refused, naming the step to
fall back to. A step is written once: saving a step that exists and was not written or restored
by this run is an error, never a silent skip.

Each step also records itself (`ferry.run.step_record`): its step, the run's id and a digest of
its metadata, checked before a resume (`ferry.run.foreign_step`). Old steps are removed by ferry
(`ferry.run.rotation`), not Orbax: a step that cannot be removed is said as that, and the run goes
on.

Orbax writes each step into a temporary directory and renames it once complete, so a crash
during a save leaves the earlier steps as they were; saves are asynchronous (the state is copied
to host memory before `save` returns, so the next step may reuse its buffers). Every process
calls `save` and `restore`: Orbax writes and reads each process's shards. Restoring places every
array in the sharding of the current mesh, whatever mesh wrote it.

A save that fails (a full disk, a directory made a file, any Orbax error) stops the run at that
save with a `CheckpointSaveError` naming the step, the directory and the cause: the step
directory is made before `save` returns (Orbax's asynchronous creation left its writer threads
waiting forever for a directory that never came), and the background write's result is read at
the next step boundary (`poll`) or, at the latest, before the next save. The failed step's
temporary directory is removed; the earlier steps stay as they were. Orbax's own log records
(a traceback per thread for one failure) are kept off the console: the error says it in one line,
and so are the aborted save's straggling TensorStore writes, which finish after Orbax closed the
event loop they report to.
"""

import dataclasses
import json
import logging
import shutil
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import Array, UInt32

from ferry.config.root import CheckpointConfig
from ferry.distributed import is_main_process
from ferry.errors import FerryError
from ferry.run.details_log import cause_and_details, first_line
from ferry.run.rotation import remove_step, steps_to_remove
from ferry.run.step_record import RECORD_FORMAT, FoundStep, StepRecord, metadata_digest
from ferry.train.state_memory import on_host

ITEMS = ("state", "data", "model", "checksums")
# The identity's "checkpoint_format": 2 saves the checksums (and the data the state was trained on)
# with every step; a step of format 2 or later without its checksums has lost them, and is refused.
# 3 also records the step itself (`ferry.run.step_record`).
CHECKSUMS_FORMAT = 2
CHECKPOINT_FORMAT = RECORD_FORMAT


class RunCheckpointError(FerryError, ValueError):
    """A run's own checkpoint that cannot be resumed here: another model, unreadable, or changed
    since it was saved (a Hugging Face checkpoint's refusals are `ferry.hf.CheckpointError`)."""


class CheckpointSaveError(FerryError, OSError):
    """A checkpoint that could not be written: the run stops at that save, the earlier steps kept."""


def _in_orbax(filename: str) -> bool:
    return "/orbax/" in filename.replace("\\", "/")


class _NoOrbaxRecords(logging.Filter):
    """Orbax logs a failed save once per writer thread, each with its traceback, and asyncio logs
    each of the save's tasks whose failure Orbax never retrieved: ferry reports the failure itself,
    in one line. A record is Orbax's when Orbax logged it or its traceback passes through Orbax."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _in_orbax(record.pathname):
            return False
        frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info and record.exc_info[2] else []
        return not any(_in_orbax(frame.filename) for frame in frames)


_ORBAX_FILTER = _NoOrbaxRecords()
# absl's logger carries Orbax's own records; asyncio's, the unretrieved failures of Orbax's tasks.
_LOGGERS_WITH_ORBAX_RECORDS = ("absl", "asyncio")


def quiet_orbax_logs() -> None:
    """Keep Orbax's log records off the console (idempotent)."""
    for name in _LOGGERS_WITH_ORBAX_RECORDS:
        logger = logging.getLogger(name)
        if _ORBAX_FILTER not in logger.filters:
            logger.addFilter(_ORBAX_FILTER)


def _is_write_after_aborted_save(unraisable: Any) -> bool:
    """A TensorStore write of a failed save that finished after Orbax closed the save's event loop:
    its callback's `call_soon_threadsafe` raises `RuntimeError('Event loop is closed')`, which
    TensorStore reports as unraisable, one traceback per write still in flight."""
    error = unraisable.exc_value
    return (
        unraisable.object is None
        and isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and unraisable.exc_traceback is not None
        and "asyncio" in unraisable.exc_traceback.tb_frame.f_code.co_filename
    )


class _QuietAbortedWrites:
    """`sys.unraisablehook` after a failed save: the save's straggling writes dropped, every other
    unraisable error passed to the hook that was there before."""

    def __init__(self, previous: Any):
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        if not _is_write_after_aborted_save(unraisable):
            self.previous(unraisable)


def quiet_aborted_writes() -> None:
    """Keep a failed save's straggling writes' tracebacks off stderr (idempotent). Installed with
    the checkpoints, not at the failure: the stragglers report as the write fails, before the run
    reads that failure at its next step boundary."""
    if not isinstance(sys.unraisablehook, _QuietAbortedWrites):
        sys.unraisablehook = _QuietAbortedWrites(sys.unraisablehook)


def _mix(h: UInt32[Array, "*shape"]) -> UInt32[Array, "*shape"]:
    """MurmurHash3's 32-bit finaliser: every input bit reaches every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _fingerprint(x: Array, offset: Any = 0) -> UInt32[Array, "2"]:
    """Two 32-bit sums of hashed (position, bits) pairs of `x`'s raw bits. Sums wrap exactly, so
    the result does not depend on how the array is sharded or which mesh restored it. Positions
    come from iotas in `x`'s own sharding (a reshape of a sharded array would need one chosen)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    sharding = jax.typeof(bits).sharding
    index, stride = jnp.full_like(bits, offset), 1
    for axis in reversed(range(bits.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis, out_sharding=sharding)
        index, stride = index + iota * jnp.uint32(stride % 2**32), stride * bits.shape[axis]
    first = _mix(bits ^ _mix(index * jnp.uint32(0x9E3779B1) + jnp.uint32(1)))
    second = _mix(bits * jnp.uint32(0x2C1B3C6D) + _mix(index + jnp.uint32(0x297A2D39)))
    zero = jnp.uint32(0)  # both sums in one reduction: a quarter less to compile per leaf kind
    sums = jax.lax.reduce(
        (first, second), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(bits.ndim))
    )
    return jnp.stack(sums)


# a host-resident leaf up to this size is fingerprinted whole in HBM, one copy; a larger one a
# slice of its leading axis at a time
WHOLE_HOST_BYTES = 64 * 2**20


def _host_fingerprint(x: jax.Array) -> jax.Array:
    """`_fingerprint` of an array in pinned host memory (a train state kept on host), computed
    on the device: a small array brought whole, a larger one a slice of its leading axis at a
    time, so HBM holds one slice (the sums of the slices' sums, their positions offset, are the
    whole array's)."""
    if x.size * x.dtype.itemsize <= WHOLE_HOST_BYTES:
        return _fingerprint(jax.device_put(x, jax.memory.Space.Device))

    def add_slice(total: jax.Array, k: jax.Array) -> tuple[jax.Array, None]:
        # the slice keeps its leading axis of 1 (which adds nothing to the positions): squeezed in
        # host memory, XLA's TPU compiler refused a [1, 64] slice of a [2, 64] host array in its
        # tiled layout (a bitcast of 8 x 128 tiles to 128; the v5e chip, jax 0.10.2:
        # docs/results/tpu-v5e.md, run 8)
        row = jax.device_put(jax.lax.dynamic_slice_in_dim(x, k, 1), jax.memory.Space.Device)
        offset = k.astype(jnp.uint32) * jnp.uint32(row.size % 2**32)
        return total + _fingerprint(row, offset), None

    return jax.lax.scan(add_slice, jnp.zeros(2, jnp.uint32), jnp.arange(x.shape[0]))[0]


@jax.jit
def _leaf_fingerprint(x: Array) -> UInt32[Array, "2"]:
    """One leaf's fingerprint, a program of its own: jit's cache holds one per (shape, dtype,
    sharding), so a state's many leaves of few kinds compile a few small programs, reused at every
    save and restore and by every state of those kinds. (One program over all leaves compiled
    anew for each state's tree, about twice as slow: docs/results/cpu.md, "Checksums of a
    checkpoint".)"""
    return (_host_fingerprint if on_host(x) else _fingerprint)(x)


def array_checksums(arrays: Any) -> dict[str, list[int]]:
    """A checksum of every array in `arrays`, by its path (computed on the devices holding it).
    Every process runs the same programs in the same order (the leaves' order), one at a time:
    on a CPU mesh, programs with collectives dispatched all at once starved each other's
    rendezvous (an 8-device run under jax 0.10.2 hung at its final save)."""
    with_paths = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(arrays) if leaf is not None]
    sums = [jax.device_get(_leaf_fingerprint(leaf)) for _, leaf in with_paths]
    return {
        jax.tree_util.keystr(path): [int(v) for v in np.asarray(digest)]
        for (path, _), digest in zip(with_paths, sums, strict=True)
    }


def model_identity(model_name: str, model_config: Any, state_shapes: Any) -> dict[str, Any]:
    """What a checkpoint's state belongs to: the model config and every array's shape and dtype."""
    shapes = {
        jax.tree_util.keystr(path): [list(leaf.shape), str(leaf.dtype)]
        for path, leaf in jax.tree_util.tree_leaves_with_path(state_shapes)
    }
    config = json.loads(json.dumps(dataclasses.asdict(model_config), default=str))
    return {"model_name": model_name, "model": config, "shapes": shapes}


def identity_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's identity and the run's, in words, or None."""
    if saved.get("model") != current["model"]:
        keys = sorted(set(saved.get("model", {})) | set(current["model"]))
        changed = [
            f"{k}: {saved.get('model', {}).get(k)} -> {current['model'].get(k)}"
            for k in keys
            if saved.get("model", {}).get(k) != current["model"].get(k)
        ]
        return f"model {saved.get('model_name')} there, {current['model_name']} here ({'; '.join(changed)})"
    if saved.get("shapes") != current["shapes"]:
        differing = [k for k in current["shapes"] if saved["shapes"].get(k) != current["shapes"][k]]
        differing += [k for k in saved["shapes"] if k not in current["shapes"]]
        return f"the train state's arrays differ: {', '.join(differing[:5])}"
    return None


def checkpoint_steps(directory: Path) -> list[int]:
    """The completed steps under `directory` (unfinished saves are temporary directories Orbax
    never lists)."""
    if not directory.is_dir():
        return []
    with ocp.CheckpointManager(directory.absolute(), item_names=ITEMS) as manager:
        return sorted(manager.all_steps())


class Checkpoints:
    """The run's CheckpointManager. `run_id` goes into every step's record; `say` prints what the
    run goes on after (a step rotation could not remove)."""

    def __init__(
        self,
        directory: Path,
        config: CheckpointConfig,
        run_id: str | None = None,
        say: Callable[[str], None] | None = None,
    ):
        quiet_orbax_logs()
        quiet_aborted_writes()  # a failed write's stragglers report before the failure is read
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # ferry removes old steps itself (`_rotate`): Orbax keeps every step
            enable_async_checkpointing=config.async_save,
            create=True,
            # the step directory made in `save`: a failure to make it raises there, and leaves no
            # writer thread waiting for it (each would wait out Orbax's 20-minute timeout)
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        self.directory = directory.absolute()
        self.config = config
        self.every = config.every
        self.final = config.final
        self.run_id = run_id
        self.say = say or _warn
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        except OSError as error:
            raise CheckpointSaveError(
                f"checkpoints cannot be written in {self.directory} ({first_line(error)}); "
                "make it a writable directory, or pass another run.dir"
            ) from error
        self.own_steps: set[int] = set()  # steps this run saved or restored: their contents are known
        self.pending: int | None = None  # the step whose background write has not been checked yet
        self.unremovable: set[int] = set()  # steps rotation failed to remove: not tried again

    def due(self, step: int, last: bool = False) -> bool:
        """Is `step` saved: every `every` steps, and the run's `last` unless `final` is off."""
        return (self.every > 0 and step % self.every == 0) or (last and self.final)

    def save(self, step: int, state_arrays: Any, data_state: dict[str, Any], identity: dict[str, Any]) -> None:
        """Start saving `step` (returns once the arrays are on the host), with its record. A step
        this run saved or restored already holds this very state and is left as it is; any other
        existing step is another writer's, and refused."""
        if step in self.own_steps:
            return
        if step in self.manager.all_steps():
            raise RunCheckpointError(
                f"checkpoint step {step} already exists in {self.directory} but this run did not write it; "
                "another run writes the same run.dir. Its checkpoint is left as it is"
            )
        self.settle()  # the previous save's failure is that save's, not this one's
        model = {**identity, "checkpoint_format": CHECKPOINT_FORMAT}
        checksums = array_checksums(state_arrays)
        record = StepRecord(step, self.run_id, metadata_digest(model, data_state, checksums))
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state_arrays),
            data=ocp.args.JsonSave(data_state),
            model=ocp.args.JsonSave(model),
            checksums=ocp.args.JsonSave(checksums),
        )
        try:
            self.manager.save(step, args=args, force=True, custom_metadata=record.to_json())
        except Exception as error:  # Orbax and TensorStore raise many kinds for a failed write
            raise self._save_failed(step, error) from error
        self.own_steps.add(step)
        self.pending = step

    def poll(self) -> None:
        """At a step boundary: a finished background write's failure raised now, naming its step
        (nothing waits while the write goes on). With several processes each would see the write
        end at its own step, and stop at a different one: there the result is read at the next save."""
        if self.pending is not None and jax.process_count() == 1 and not self.manager.is_saving_in_progress():
            self.settle()

    def settle(self) -> None:
        """Wait for the save in flight; its failure raised as a `CheckpointSaveError`. Once it is
        whole, the steps the keep rules let go are removed."""
        if self.pending is None:
            return
        step, self.pending = self.pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as error:
            self.own_steps.discard(step)
            raise self._save_failed(step, error) from error
        self._rotate(step)

    def _rotate(self, saved: int) -> None:
        """Remove old steps (checkpoint.keep, checkpoint.keep_every), on process 0 as Orbax did;
        a step that cannot be removed is said, and the run goes on (`ferry.run.rotation`)."""
        doomed = steps_to_remove(list(self.manager.all_steps()), self.config.keep, self.config.keep_every)
        doomed = [step for step in doomed if step not in self.unremovable]
        if not doomed:
            return
        if is_main_process():
            for step in doomed:
                failure = remove_step(self.directory, step)
                if failure is not None:
                    self.unremovable.add(step)
                    self.say(failure.line(saved, self.directory))
        self.manager.reload()

    def _save_failed(self, step: int, error: BaseException) -> CheckpointSaveError:
        """The failure of saving `step`, in one line; its partial temporary directory removed (on
        a full disk it holds the space the next attempt needs)."""
        for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*") if self.directory.is_dir() else ():
            shutil.rmtree(partial, ignore_errors=True)
        try:
            earlier = sorted(s for s in self.manager.all_steps() if s < step)
        except Exception:  # the directory itself may be what failed
            earlier = []
        kept = (
            f"The last whole checkpoint, step {earlier[-1]}, is left as it was and the same command resumes from it"
            if earlier
            else "No earlier checkpoint was saved, so the same command starts the run over"
        )
        what = f"checkpoint step {step} could not be saved in {self.directory}"
        cause = cause_and_details(self.directory.parent, what, error)
        cause = cause if isinstance(error, OSError) else f"{type(error).__name__}: {cause}"
        return CheckpointSaveError(
            f"{what}: {cause}; the run stops here. "
            f"{kept} once {self.directory} is a writable directory with room for a checkpoint"
        )

    def read_step(self, step: int) -> FoundStep:
        """What step `step`'s directory holds about itself: its model item, its record and the
        digest of its metadata as it reads now (`ferry.run.foreign_step` checks them)."""
        items = {"model": ocp.args.JsonRestore(), "data": ocp.args.JsonRestore()}
        if (self.directory / str(step) / "checksums").exists():
            items["checksums"] = ocp.args.JsonRestore()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            custom = self.manager.metadata(step).custom_metadata
        except Exception as error:  # Orbax and TensorStore raise many kinds for a damaged step
            raise self._unreadable(step, error) from error
        model = dict(restored.model)
        if "checksums" not in items and model.get("checkpoint_format", 1) >= CHECKSUMS_FORMAT:
            raise self._checksums_gone(step)
        checksums = dict(restored.checksums) if "checksums" in items else None
        digest = metadata_digest(model, dict(restored.data), checksums)
        path = self.directory / str(step)
        return FoundStep(step, path, model, StepRecord.of(custom), digest, self._fallback(step))

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """The state's arrays (placed as `abstract_state`'s shardings say) and the data position,
        checked against the checksums saved with them. A step this ferry saved (format 2 or later)
        without its checksums lost them and is refused; an earlier ferry's is restored with a warning."""
        verified = (self.directory / str(step) / "checksums").exists()
        if not verified:
            self.read_step(step)  # refuses a step of this ferry whose checksums are gone
        items = {"state": ocp.args.StandardRestore(abstract_state), "data": ocp.args.JsonRestore()}
        if verified:
            items["checksums"] = ocp.args.JsonRestore()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as error:  # Orbax and TensorStore raise many kinds for a damaged step
            raise self._unreadable(step, error) from error
        if verified:
            self._check_sums(step, dict(restored.checksums), array_checksums(restored.state))
        else:
            warnings.warn(
                f"checkpoint step {step} in {self.directory} has no checksums (saved by an earlier ferry); "
                "restored without verifying it",
                stacklevel=2,
            )
        self.own_steps.add(step)
        return restored.state, dict(restored.data)

    def _check_sums(self, step: int, saved: dict[str, Any], found: dict[str, Any]) -> None:
        changed = sorted(k for k in saved.keys() | found.keys() if saved.get(k) != found.get(k))
        if changed:
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise RunCheckpointError(
                f"checkpoint step {step} in {self.directory} fails its checksums: {len(changed)} array(s) "
                f"differ from what was saved ({shown}), so its files changed after saving; "
                f"{self._fallback(step)}"
            )

    def _checksums_gone(self, step: int) -> RunCheckpointError:
        return RunCheckpointError(
            f"checkpoint step {step} in {self.directory} was saved with checksums, which are gone "
            f"({self.directory / str(step) / 'checksums'} is missing), so it cannot be verified; "
            f"{self._fallback(step)}"
        )

    def _fallback(self, step: int) -> str:
        earlier = [s for s in self.manager.all_steps() if s < step]
        if not earlier:
            return "no earlier checkpoint exists; start a new run.dir"
        return f"move {self.directory / str(step)} aside to resume from step {max(earlier)} (left untouched)"

    def _unreadable(self, step: int, error: Exception) -> RunCheckpointError:
        """A step Orbax or TensorStore could not read, in one short line: their own explanation of a
        truncated or missing file runs to thousands of characters, kept in the run's ferry.log."""
        what = f"checkpoint step {step} in {self.directory} cannot be read"
        cause = cause_and_details(self.directory.parent, what, error)
        _quiet_about_orbax_reads()
        return RunCheckpointError(
            f"{what} (a file of it is missing, truncated or damaged: {cause}); {self._fallback(step)}"
        )

    def close(self) -> None:
        """Wait for any save in flight (its failure raised), then release the manager."""
        self.settle()
        self.manager.close()


def _quiet_about_orbax_reads() -> None:
    """Orbax reads a checkpoint's arrays in coroutines: when one read fails, the others' failures
    surface later, as Python destroys them, as "Exception ignored" tracebacks on stderr after the
    one-line refusal (the failure is said and its details logged already). From here on, those of
    Orbax's own coroutines are dropped; any other unraisable exception is still printed."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_orbax", False):
        return

    def hook(unraisable: Any) -> None:
        frames = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
        if not any("orbax" in frame.filename for frame in frames):
            previous(unraisable)

    hook.quiets_orbax = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _warn(line: str) -> None:
    warnings.warn(line, stacklevel=3)
