"""`model.attention`: which kernel computes attention, per backend.

- `xla`: ferry's query-chunked einsum path (`ferry.nn.kernels.xla`), on every backend; the CPU's.
- `splash`: JAX's Pallas splash kernel (`ferry.nn.kernels.splash`) on a TPU; on the CPU in Pallas
  interpret mode (slow: for tests); refused on a GPU.
- `cudnn`: cuDNN flash attention (`ferry.nn.kernels.cudnn`) on an NVIDIA GPU; refused elsewhere and
  for a call cuDNN cannot take (see that module), naming why.
- `auto`: splash on a TPU; cuDNN on a GPU where the call allows it, else xla; xla on a CPU.

The backend is the platform the program is compiled for: the one `attention_platform` names (the
planner's transfer schedule, traced abstractly for a target), else the devices of the mesh set by
`jax.set_mesh` (the planner's compile-only GPU or TPU devices), else JAX's default backend. A run
says what it chose at start-up (`describe_attention`).
"""

import dataclasses

from jaxtyping import Array, Float

from ferry.errors import FerryError
from ferry.nn.kernels.cudnn import CudnnAttention, cudnn_shape_reason
from ferry.nn.kernels.flash import AttentionKernel, SegmentIds
from ferry.nn.kernels.splash import SplashAttention, block_size, round_up
from ferry.nn.kernels.xla import XlaAttention
from ferry.sharding import lowering_platform

ATTENTION_CHOICES = ("auto", "xla", "splash", "cudnn")


class AttentionChoiceError(FerryError, ValueError):
    """`model.attention` names a kernel this backend or this call cannot run."""


def check_attention_setting(setting: str) -> None:
    """Refuse a `model.attention` that names no kernel (a ValueError the config loader reports as
    a one-line ConfigError naming the key)."""
    if setting not in ATTENTION_CHOICES:
        raise ValueError(f"attention is {setting!r}; choose one of {', '.join(ATTENTION_CHOICES)}")


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """What the choice depends on: one call's shapes, dtype and masks, and the backend."""

    platform: str  # "cpu", "gpu" or "tpu"
    batch: int
    seq: int
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    dtype: str
    segmented: bool  # segment ids (data.document_mask)


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    kernel: AttentionKernel
    why: str  # how the setting led to it

    def describe(self, setting: str) -> str:
        return f"attention: {self.kernel.describe()} [model.attention={setting}: {self.why}]"


def choose_attention(setting: str, call: AttentionCall) -> AttentionChoice:
    """The kernel `setting` picks for `call` (an AttentionChoiceError where it names one that
    cannot run it)."""
    check_attention_setting(setting)
    cudnn_reason = (
        cudnn_shape_reason(
            call.batch, call.seq, call.heads, call.kv_heads, call.qk_dim, call.v_dim, call.dtype, call.segmented
        )
        if call.platform == "gpu"
        else "cuDNN runs on NVIDIA GPUs only"
    )
    if setting == "xla":
        return AttentionChoice(XlaAttention(), "as set")
    if setting == "splash":
        if call.platform == "gpu":
            raise AttentionChoiceError(
                "model.attention=splash is a TPU kernel (Pallas Mosaic); on a GPU use cudnn, xla or auto"
            )
        interpret = call.platform != "tpu"
        return AttentionChoice(SplashAttention(interpret=interpret), "as set" + (" (not a TPU)" if interpret else ""))
    if setting == "cudnn":
        if cudnn_reason is not None:
            raise AttentionChoiceError(f"model.attention=cudnn cannot run here: {cudnn_reason}; use auto or xla")
        return AttentionChoice(CudnnAttention(), "as set")
    if call.platform == "tpu":
        return AttentionChoice(SplashAttention(), "TPU")
    if call.platform == "gpu":
        if cudnn_reason is None:
            return AttentionChoice(CudnnAttention(), "GPU, the shape allows cuDNN")
        return AttentionChoice(XlaAttention(), f"GPU, {cudnn_reason}")
    return AttentionChoice(XlaAttention(), f"{call.platform}: the reference path")


def attend(
    setting: str,
    q: Float[Array, "batch seq heads qk_dim"],
    k: Float[Array, "batch seq kv_heads qk_dim"],
    v: Float[Array, "batch seq kv_heads v_dim"],
    scale: float,
    segment_ids: SegmentIds = None,
) -> Float[Array, "batch seq heads_v_dim"]:
    """Causal attention by the kernel `setting` chooses for this call and backend, its context
    (batch, seq, heads * v_dim) tagged `attention_out` (and `attention_lse` for a kernel)."""
    batch, seq, heads, qk_dim = q.shape
    call = AttentionCall(
        lowering_platform(), batch, seq, heads, k.shape[2], qk_dim, v.shape[-1], str(q.dtype), segment_ids is not None
    )
    return choose_attention(setting, call).kernel(q, k, v, scale, segment_ids)


def describe_attention(
    setting: str,
    *,
    heads: int,
    kv_heads: int,
    qk_dim: int,
    v_dim: int,
    seq: int,
    dtype: str = "bfloat16",
    segmented: bool = False,
    batch: int = 1,
    platform: str | None = None,
) -> str:
    """One line for the start-up report: the kernel `setting` chooses for a layer of these heads at
    this sequence length on `platform` (default: this process's backend), and why; the splash
    block size and padding where it applies. An AttentionChoiceError where it cannot run."""
    platform = platform or lowering_platform()
    call = AttentionCall(platform, batch, seq, heads, kv_heads, qk_dim, v_dim, dtype, segmented)
    choice = choose_attention(setting, call)
    line = choice.describe(setting)
    if isinstance(choice.kernel, SplashAttention):
        padded = round_up(seq, 128)
        pads = [f"seq {seq} -> {padded}"] if padded != seq else []
        qk, vv = round_up(qk_dim, choice.kernel.head_multiple), round_up(v_dim, choice.kernel.head_multiple)
        if qk != qk_dim:
            pads.append(f"q/k heads {qk_dim} -> {qk} (x{qk / qk_dim:.2f} score FLOPs)")
        if vv != v_dim:
            pads.append(f"v heads {v_dim} -> {vv}")
        line += f"; block {block_size(seq)}" + (f"; padded: {', '.join(pads)}" if pads else "")
    return line
