"""A flash-attention kernel as the offload engine sees it: a forward pass whose residuals, the
output and the log-sum-exp of every query row, are tagged activations, and a backward pass that
starts from them.

`FlashAttention.__call__` computes `out, lse = forward(q, k, v)` under `stop_gradient` (the
forward has no VJP of its own), tags them `attention_out` and `attention_lse`, and returns
`attach_gradient(q, k, v, out, lse)`: a custom VJP whose primal output is `out` itself and whose
backward runs the kernel's backward from (q, k, v, out, lse, d_out). In the backward pass of an
offloaded layer the engine replays the layer with saved values injected at their tags; when both
`attention_out` and `attention_lse` are saved (kept or offloaded), the replayed forward kernel's
outputs are all replaced, so it is dead code and XLA removes it: the backward kernel reads the
saved residuals straight. When they are rematerialised the replay runs the forward kernel again
(full_remat). `jax.checkpoint`-style remat of a kernel with its own custom VJP could not do this:
its residuals would live inside the VJP, out of the engine's reach.
"""

import abc
import functools

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int

from ferry.offload.engine import tag
from ferry.sharding import HEADS

ATTENTION_OUT = "attention_out"
ATTENTION_LSE = "attention_lse"

SegmentIds = Int[Array, "batch seq"] | None


def with_declared_lse(names: frozenset[str]) -> frozenset[str]:
    """The names a layer that tags `names` may tag: with `attention_out`, `attention_lse` too. A
    flash kernel (splash, cuDNN) tags its log-sum-exp and the xla path has none, so the names are
    declared alike on every backend: a policy places the same names whatever backend, dtype or
    shape the layer was traced with to find them (a name the kernel does not tag is not placed)."""
    return names | {ATTENTION_LSE} if ATTENTION_OUT in names else names


class AttentionKernel(eqx.Module):
    """Causal (grouped-query) attention of one layer, its context tagged `attention_out`."""

    @abc.abstractmethod
    def __call__(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        k: Float[Array, "batch seq kv_heads qk_dim"],
        v: Float[Array, "batch seq kv_heads v_dim"],
        scale: float,
        segment_ids: SegmentIds = None,
    ) -> Float[Array, "batch seq heads_v_dim"]:
        """softmax(q k^T * scale + causal mask [+ segment mask]) v, its heads flattened
        (batch, seq, heads * v_dim), tagged `attention_out`."""

    @abc.abstractmethod
    def describe(self) -> str:
        """What runs, in a few words, for the start-up report."""


class FlashAttention(AttentionKernel):
    """A kernel with a forward that returns its log-sum-exp and a backward that takes it."""

    @abc.abstractmethod
    def forward(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        k: Float[Array, "batch seq kv_heads qk_dim"],
        v: Float[Array, "batch seq kv_heads v_dim"],
        scale: float,
        segment_ids: SegmentIds,
    ) -> tuple[Float[Array, "batch seq heads v_dim"], Float[Array, "batch seq heads"]]:
        """(output, float32 log-sum-exp of each query row's scaled, masked scores)."""

    @abc.abstractmethod
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
        """(dq, dk, dv) from the forward's residuals and the output's cotangent."""

    def __call__(
        self,
        q: Float[Array, "batch seq heads qk_dim"],
        k: Float[Array, "batch seq kv_heads qk_dim"],
        v: Float[Array, "batch seq kv_heads v_dim"],
        scale: float,
        segment_ids: SegmentIds = None,
    ) -> Float[Array, "batch seq heads_v_dim"]:
        batch, seq, heads, _ = q.shape
        # the inputs' gradients stop too: the forward is traced without tangents, as a primal computation
        out, lse = self.forward(*jax.lax.stop_gradient((q, k, v)), scale, segment_ids)
        out = tag(out.reshape(batch, seq, heads * v.shape[-1]), ATTENTION_OUT, HEADS)
        lse = tag(lse, ATTENTION_LSE, HEADS)
        return attach_gradient(self, scale, q, k, v, out, lse, segment_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attach_gradient(
    kernel: FlashAttention,
    scale: float,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    segment_ids: SegmentIds,
) -> Array:
    """`out`, differentiable with respect to q, k and v through `kernel.backward` (out and lse
    are residuals: their own cotangents are zero, as the stop_gradient they come from says)."""
    return out


def _attach_forward(kernel, scale, q, k, v, out, lse, segment_ids):  # noqa: ANN001, ANN202
    return out, (q, k, v, out, lse, segment_ids)


def _attach_backward(kernel, scale, residuals, d_out):  # noqa: ANN001, ANN202
    q, k, v, out, lse, segment_ids = residuals
    split = lambda t: t.reshape(*q.shape[:3], v.shape[-1])
    dq, dk, dv = kernel.backward(q, k, v, split(out), lse, split(d_out), scale, segment_ids)
    return dq, dk, dv, None, None, None


attach_gradient.defvjp(_attach_forward, _attach_backward)
