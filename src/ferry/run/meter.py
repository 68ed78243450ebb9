"""What a logged step's record says besides the step's own metrics: its time, tokens/s, model
TFLOP/s per device and MFU, and the pinned host bytes planned and compiled and the device's
measured peak memory."""

import dataclasses
from typing import Any

import jax

from ferry.config.root import FerryConfig
from ferry.offload.schedule import TransferSchedule
from ferry.run.memory_report import device_memory_peak
from ferry.train.memory import CompiledMemory
from ferry.train.step_flops import CONVENTION, CONVENTION_LINE, training_flops
from ferry.xla.peak import device_peak


@dataclasses.dataclass(frozen=True)
class StepMeter:
    tokens_per_step: int
    flops: float  # model FLOPs per step and device, causal attention halved (`step_flops.CONVENTION`)
    peak: float | None  # the device's peak FLOP/s; None: MFU is not reported
    peak_source: str
    schedule: TransferSchedule
    memory: CompiledMemory | None = None  # the compiled step's analysis, once compiled
    flops_full_attention: float | None = None  # the same with attention over the whole T x T

    @classmethod
    def of(cls, config: FerryConfig, schedule: TransferSchedule) -> "StepMeter":
        """The run's FLOPs per step and device and its device's peak (a CPU's is measured)."""
        tc = config.train
        counted = training_flops(config.model, tc.global_batch_size, tc.seq_len)
        devices = jax.device_count()
        peak, peak_source = device_peak(jax.devices()[0], tc.compute_dtype)
        tokens = tc.global_batch_size * tc.seq_len
        full = counted.full_attention_total / devices
        return cls(tokens, counted.per_device(devices), peak, peak_source, schedule, flops_full_attention=full)

    def describe(self) -> str:
        """The FLOPs and the peak, in one line."""
        peak = f"{self.peak / 1e12:.4g} TFLOP/s ({self.peak_source})" if self.peak else self.peak_source
        return f"model FLOPs per step and device {self.flops / 1e12:.4g} TFLOP ({CONVENTION_LINE}); peak {peak}"

    def record(self, step: int, step_time: float) -> dict[str, Any]:
        """The record of `step`, which took `step_time` seconds."""
        record: dict[str, Any] = {
            "step": step,
            "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
            "tflops_per_s_per_device": self.flops / step_time / 1e12,
            "pinned_host_bytes_planned": self.schedule.pinned_host_bytes,
        }
        if self.memory is not None:
            record["pinned_host_bytes_compiled"] = self.memory.host_temporaries
        if self.peak:
            record["mfu"] = self.flops / step_time / self.peak
            record["mfu_convention"] = CONVENTION  # how `mfu` counts attention (ferry.train.step_flops)
            if self.flops_full_attention is not None:
                record["mfu_full_attention"] = self.flops_full_attention / step_time / self.peak
        if self.memory is not None:
            record["device_memory_compiled_bytes"] = self.memory.device_bytes
        memory_peak = device_memory_peak(self.memory)
        if memory_peak is not None:
            record |= memory_peak.record()
        return record
