"""cuDNN's fused flash attention on NVIDIA GPUs (`model.attention=cudnn`, and `auto` on a GPU where
the shape allows it): the kernel `jax.nn.dot_product_attention(..., implementation="cudnn")` runs,
grouped-query attention natively (key/value heads shared by their group of query heads).

The engine needs the forward's float32 softmax statistics (the log-sum-exp) and a backward that
starts from saved residuals. `jax.nn.dot_product_attention(return_residual=True)` returns the
statistics cast to the output's dtype (bfloat16: too coarse to differentiate through), and no
public API runs cuDNN's backward alone, so both are JAX's own cuDNN entry points in
`jax._src.cudnn.fused_attention_stablehlo` (jax 0.12), checked by their signatures: a jax whose
entry points differ chooses `xla` under `auto` and refuses `cudnn`, naming the reason.

Not taken: segment ids (`data.document_mask`): jax.nn's cuDNN path has no segment ids (its private
packed layout needs per-document lengths and offsets with a static count of documents per row);
float32 inputs (cuDNN takes bf16 and fp16); heads wider than cuDNN takes, which JAX checks against
the GPU this process sees (deviceless, JAX sees none and allows 128 at most: DeepSeek-V3's MLA,
q/k heads 192, plans with `xla` on a GPU target).
"""

import inspect
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ferry.nn.kernels.flash import FlashAttention, SegmentIds

try:  # JAX's cuDNN attention: no public API gives its float32 statistics or its backward alone
    from jax._src.cudnn import fused_attention_stablehlo

    _cudnn: ModuleType | None = fused_attention_stablehlo
except ImportError:  # pragma: no cover - every jax ferry supports has it
    _cudnn = None

_FORWARD_PARAMETERS = (
    "query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
    "page_table_v", "score_mod_args", "scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
    "sliding_window_length", "score_mod", "cudnn_version", "return_residual",
)  # fmt: skip
_BACKWARD_PARAMETERS = (
    "scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout", "sliding_window_length", "score_mod",
    "cudnn_version", "return_residual", "res", "grad_output",
)  # fmt: skip


# The cuDNN a compile for a GPU this process does not have assumes (the planner's deviceless
# programs): the version the planner's GPU targets declare (`dnn_version_info` 9.10.0 in
# `ferry.xla.targets`), which jax's lowering reads where it would ask the loaded library.
DEVICELESS_CUDNN_VERSION = 91000


def cudnn_version() -> int | None:
    """The loaded cuDNN's version (91000 for 9.10.0); with no GPU in this process, the planner's
    targets' (`DEVICELESS_CUDNN_VERSION`: the program is compiled for a GPU elsewhere); None where
    a GPU process has no cuDNN."""
    if _cudnn is not None:
        try:
            return _cudnn.check_cudnn_version()
        except (RuntimeError, AttributeError):
            pass
    return DEVICELESS_CUDNN_VERSION if jax.default_backend() != "gpu" else None


def _jax_cudnn() -> ModuleType:
    """JAX's cuDNN attention module, for callers that `cudnn_unavailable_reason` cleared."""
    assert _cudnn is not None, "jax has no cuDNN attention module (see cudnn_unavailable_reason)"
    return _cudnn


def cudnn_unavailable_reason() -> str | None:
    """Why this jax cannot run ferry's cuDNN attention (None: it can)."""
    if _cudnn is None:
        return f"jax {jax.__version__} has no cuDNN attention module"
    forward = getattr(_cudnn, "_dot_product_attention_fwd", None)
    backward = getattr(_cudnn, "_dot_product_attention_bwd_rule", None)
    if forward is None or backward is None:
        return f"jax {jax.__version__}'s cuDNN attention has no separate forward and backward"
    if tuple(inspect.signature(forward).parameters) != _FORWARD_PARAMETERS or (
        tuple(inspect.signature(backward).parameters) != _BACKWARD_PARAMETERS
    ):
        return f"jax {jax.__version__}'s cuDNN attention entry points differ from jax 0.12's, which ferry calls"
    if cudnn_version() is None:
        return "this GPU process loaded no cuDNN library"
    return None


def cudnn_shape_reason(
    batch: int, seq: int, heads: int, kv_heads: int, qk_dim: int, v_dim: int, dtype: str, segmented: bool
) -> str | None:
    """Why cuDNN's flash attention cannot take this call (None: it can), as JAX checks it."""
    unavailable = cudnn_unavailable_reason()
    if unavailable is not None:
        return unavailable
    if segmented:
        return "jax's cuDNN attention takes no segment ids (data.document_mask)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN takes bfloat16 or float16 inputs, not {jnp.dtype(dtype).name}"
    q = jax.ShapeDtypeStruct((batch, seq, heads, qk_dim), dtype)
    k = jax.ShapeDtypeStruct((batch, seq, kv_heads, qk_dim), dtype)
    v = jax.ShapeDtypeStruct((batch, seq, kv_heads, v_dim), dtype)
    try:
        cudnn = _jax_cudnn()
        cudnn.check_is_flash_attention(q, k, v, cudnn.AttentionLayout.BTNH.value, cudnn_version(), False, True)
    except NotImplementedError as error:
        return f"cuDNN flash attention does not take it: {error}"
    return None


class CudnnAttention(FlashAttention):
    """cuDNN flash attention, causal, in ferry's (batch, seq, heads, dim) layout (cuDNN's BTNH)."""

    def describe(self) -> str:
        return "cudnn (cuDNN fused flash attention)"

    def _options(self, scale: float) -> dict[str, Any]:
        cudnn = _jax_cudnn()
        return dict(
            scale=scale,
            seed=0,
            dropout_rate=0.0,
            variadic_args=(False, False),  # no bias, no bias gradient
            mask_type=cudnn.MaskType.CAUSAL,
            layout=cudnn.AttentionLayout.BTNH.value,
            sliding_window_length=None,
            score_mod=None,
            cudnn_version=cudnn_version(),
        )

    @staticmethod
    def _unused(q: Array) -> Array:
        return jnp.zeros(0, q.dtype)  # what jax passes for an absent bias, lengths, offsets, pages

    def forward(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        k: Float[Array, "batch seq kv_heads qk_dim"],
        v: Float[Array, "batch seq kv_heads v_dim"],
        scale: float,
        segment_ids: SegmentIds,
    ) -> tuple[Float[Array, "batch seq heads v_dim"], Float[Array, "batch seq heads"]]:
        assert segment_ids is None, "chosen only without segment ids (ferry.nn.kernels.choice)"
        unused = self._unused(q)
        out, stats = _jax_cudnn()._dot_product_attention_fwd(  # noqa: SLF001 (see the module docstring)
            q, k, v, *(unused,) * 7, (), return_residual=True, **self._options(scale)
        )
        return out, stats.transpose(0, 2, 1)  # cuDNN's (batch, heads, seq) -> ferry's (batch, seq, heads)

    def backward(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        k: Float[Array, "batch seq kv_heads qk_dim"],
        v: Float[Array, "batch seq kv_heads v_dim"],
        out: Float[Array, "batch seq heads v_dim"],
        lse: Float[Array, "batch seq heads"],
        d_out: Float[Array, "batch seq heads v_dim"],
        scale: float,
        segment_ids: SegmentIds,
    ) -> tuple[Array, Array, Array]:
        unused = self._unused(q)
        residuals = (q, k, v, *(unused,) * 7, (), lse.transpose(0, 2, 1), out.astype(q.dtype))
        grads = _jax_cudnn()._dot_product_attention_bwd_rule(  # noqa: SLF001 (see the module docstring)
            **self._options(scale), return_residual=False, res=residuals, grad_output=d_out.astype(q.dtype)
        )
        return grads[0], grads[1], grads[2]
