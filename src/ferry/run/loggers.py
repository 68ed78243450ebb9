"""Where a logged step goes: metrics.jsonl, TensorBoard event files and (optionally) Weights &
Biases. Only process 0 logs; the others get a `RunLoggers` that writes nothing."""

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

from ferry.config.root import LogConfig
from ferry.errors import ConfigError, FerryError
from ferry.run.metrics import MetricsWriter


class RunLogError(FerryError, OSError):
    """metrics.jsonl could not be written (a full disk, a file made unwritable): the run stops."""


def check_wandb(config: LogConfig) -> None:
    """W&B is optional: asking for it without it installed is refused before the run starts."""
    if config.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError as error:
            message = "log.wandb=true needs Weights & Biases: pip install wandb (or log.wandb=false)"
            raise ConfigError(message) from error


def drop_records_after(path: Path, step: int) -> None:
    """Keep the metrics of steps up to `step`: a resumed run logs the later ones again. A line
    that does not parse (the last one, torn by a kill during its write) is dropped with a
    warning naming it."""
    if not path.exists():
        return
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            warnings.warn(f"{path}:{number} is not a JSON record (a write cut short?); dropped", stacklevel=2)
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
    temporary = path.with_suffix(".tmp")
    try:
        temporary.write_text("".join(f"{line}\n" for line in kept))
        temporary.replace(path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise RunLogError(f"{path} cannot be rewritten ({error.strerror or error}); it is left as it was") from error


class RunLoggers:
    def __init__(
        self,
        run_dir: Path,
        config: LogConfig,
        resume_step: int | None,
        enabled: bool,
        run_config: dict[str, Any] | None = None,
    ):
        self.jsonl = self.tensorboard = self.wandb_run = None
        if not enabled:
            return
        if resume_step is not None:
            drop_records_after(run_dir / "metrics.jsonl", resume_step)
        self.jsonl = MetricsWriter(run_dir / "metrics.jsonl")
        if config.tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step hides the events of steps after the checkpoint an earlier attempt wrote
            purge = None if resume_step is None else resume_step + 1
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge, flush_secs=10)
        if config.wandb:
            import wandb

            self.wandb_run = wandb.init(
                project=config.wandb_project, dir=str(run_dir), id=run_dir.name, resume="allow", config=run_config
            )

    def write(self, record: dict[str, Any]) -> None:
        if self.jsonl is None:
            return
        try:
            self.jsonl.write(record)
        except OSError as error:
            path = self.jsonl.path
            with contextlib.suppress(OSError):  # its unwritten line would fail again at exit
                self.jsonl.close()
            self.jsonl = None
            raise RunLogError(
                f"step {record.get('step')}'s metrics could not be written to {path} "
                f"({error.strerror or error}); the run stops here. The same command resumes from the last "
                "checkpoint once the file can be written"
            ) from error
        step = int(record["step"])
        numbers = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        if self.tensorboard is not None:
            for name, value in numbers.items():
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(numbers, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
