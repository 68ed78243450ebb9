"""A run whose train step XLA refuses to compile over HBM: one line saying what the step needs,
what the device has, and what would fit, before any state is allocated or anything written."""

from pathlib import Path

import jax

from ferry.config.root import FerryConfig
from ferry.plan.advice import plan_advice
from ferry.train.memory import InsufficientMemoryError
from ferry.xla.compile_oom import StepOverHbm
from ferry.xla.hardware import accelerator_name


def over_hbm_refusal(over: StepOverHbm, config: FerryConfig, accelerator: str | None = None) -> InsufficientMemoryError:
    """The refusal of a run whose step is over HBM: XLA's figures, then what the newest plan of
    this step on the accelerator (default: this machine's) under `run.root` found to fit
    (`ferry.plan.advice`), else how to make one, then the levers that shrink a step."""
    accelerator = accelerator or accelerator_name(jax.devices()[0].device_kind)
    advice = plan_advice(Path(config.run.root), config, accelerator)
    target = accelerator or "<gpu or tpu>"
    if advice is None:
        found = (
            f"No plan of this step for {target} under run.root={config.run.root}: mode=plan target={target} with "
            "the same overrides compiles each preset without the chip and names those that fit"
        )
    else:
        found = advice.describe()
    return InsufficientMemoryError(f"{over}. {found}. Levers: {', '.join(levers(config))}")


def levers(config: FerryConfig) -> list[str]:
    """What shrinks a step's HBM, in this run's terms (those it does not use already)."""
    offload, train = config.offload, config.train
    rows = train.micro_batch_size or train.rows_per_device(config.mesh.data_parallel)
    out = [f"offload=full_remat or an offloading preset (now offload={offload.name})"]
    if rows > 1:
        out.append(f"train.micro_batch_size={rows // 2} (gradient accumulation; now {rows} rows per device a pass)")
    if offload.optimizer != "host":
        out.append("offload.optimizer=host (AdamW's moments in pinned host memory)")
    out.append(f"a shorter train.seq_len (now {train.seq_len})")
    return out
