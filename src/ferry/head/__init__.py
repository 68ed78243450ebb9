"""The loss head: the output projection and the next-token cross-entropy, made so that the
float32 logits of a whole batch need never be held.

- `loss`: `LossHead` (train.loss_head: `logits`, `chunked` or `fused`) and the loss it computes;
- `chunked`: the logits a vocabulary chunk at a time, their gradient by recomputing each chunk;
- `fused`: the loss and its gradients in one pass over sequence chunks;
- `kernel`: the fused head's chunk as a Pallas TPU kernel, its logits kept in VMEM;
- `kernel_choice`: where that kernel runs (`train.loss_kernel=auto`), and why.
"""

from ferry.head.chunked import OutputHead
from ferry.head.loss import DEFAULT_HEAD, LOSS_HEADS, LOSS_KERNELS, LossHead, next_token_loss, whole_logits

__all__ = ["DEFAULT_HEAD", "LOSS_HEADS", "LOSS_KERNELS", "LossHead", "OutputHead", "next_token_loss", "whole_logits"]
