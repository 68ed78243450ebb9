"""Model FLOPs of a training step by MaxText's convention, for TFLOPs/s/device and MFU.

Counted: every matmul with a weight, forward and backward (3 x the forward's 2 x m x n x k), and
attention's QK^T and PV products with the causal mask halving them (`CONVENTION`: MaxText counts
so since its PR #1988; before, and in some peers' figures, the whole T x T was counted, which a
run reports beside as `mfu_full_attention`: `StepFlops.full_attention_total`). Not counted: recomputation
(rematerialisation is the run's choice, not the model's work), norms, softmax, RoPE and other
elementwise work. Each family's config gives its forward pass's count (`forward_flops`):
DeepSeek-V3 counts MLA's down and up projections, the router (gate), the shared experts and only
the top-k routed experts a token visits, and each multi-token-prediction depth (its projection,
one MoE layer and the shared output head) at its shorter sequence.
"""

import dataclasses

from ferry.models.base import AbstractModelConfig

# How MFU counts attention, as metrics.jsonl's `mfu_convention` names it: causal attention's QK^T and
# PV at half the whole T x T (the products above the diagonal are masked, not work)
CONVENTION = "causal_attention_halved"
CONVENTION_LINE = "causal attention's FLOPs halved, as MaxText since its PR #1988"


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step (forward and backward) of the whole global batch."""

    weights: float  # matmuls with a learnable weight
    attention: float  # QK^T and PV, causal

    @property
    def total(self) -> float:
        """By `CONVENTION`: causal attention halved."""
        return self.weights + self.attention

    @property
    def full_attention_total(self) -> float:
        """With attention's products over the whole T x T (the convention before MaxText's PR #1988)."""
        return self.weights + 2 * self.attention

    def per_device(self, num_devices: int) -> float:
        return self.total / num_devices


def training_flops(model_config: AbstractModelConfig, batch: int, seq: int) -> StepFlops:
    """Model FLOPs of one training step over `batch` sequences of `seq` tokens: 3 x forward
    (the backward pass computes two products per forward matmul)."""
    weights, attention = model_config.forward_flops(batch, seq)
    return StepFlops(float(3 * weights), float(3 * attention))
