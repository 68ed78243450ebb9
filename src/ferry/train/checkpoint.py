"""Orbax checkpoints of a run: the train state, the data iterator's position and what the state
belongs to (the model and its parameter shapes), saved together as one step.

Orbax writes each step into a temporary directory and renames it once complete, so a crash
during a save leaves the earlier steps as they were; saves are asynchronous (the state is copied
to host memory before `save` returns, so the next step may reuse its buffers). Every process
calls `save` and `restore`: Orbax writes and reads each process's shards. Restoring places every
array in the sharding of the current mesh, whatever mesh wrote it.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from ferry.train.config import CheckpointConfig

ITEMS = ("state", "data", "model")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here: another model, or unreadable."""


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
    """The run's CheckpointManager."""

    def __init__(self, directory: Path, config: CheckpointConfig):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            keep_period=config.keep_every,
            enable_async_checkpointing=config.async_save,
            create=True,
        )
        self.directory = directory.absolute()
        self.every = config.every
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state_arrays: Any, data_state: dict[str, Any], identity: dict[str, Any]) -> None:
        """Start saving `step` (returns once the arrays are on the host)."""
        if step in self.manager.all_steps():
            return
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state_arrays),
            data=ocp.args.JsonSave(data_state),
            model=ocp.args.JsonSave(identity),
        )
        self.manager.save(step, args=args, force=True)

    def read_identity(self, step: int) -> dict[str, Any]:
        try:
            return self.manager.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore())).model
        except Exception as error:
            raise self._unreadable(step, error) from error

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """The state's arrays (placed as `abstract_state`'s shardings say) and the data position."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as error:  # Orbax and TensorStore raise many kinds for a damaged step
            raise self._unreadable(step, error) from error
        return restored.state, dict(restored.data)

    def _unreadable(self, step: int, error: Exception) -> CheckpointError:
        earlier = [s for s in self.manager.all_steps() if s < step]
        advice = (
            f"move {self.directory / str(step)} aside to resume from step {max(earlier)} (left untouched)"
            if earlier
            else "no earlier checkpoint exists; start a new run.dir"
        )
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return CheckpointError(f"checkpoint step {step} in {self.directory} cannot be read ({first_line}); {advice}")

    def close(self) -> None:
        """Wait for any save in flight, then release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
