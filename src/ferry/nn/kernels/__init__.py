"""Attention kernels: how softmax(q k^T) v is computed, chosen per backend by `model.attention`
(`ferry.nn.kernels.choice`). `xla` is ferry's query-chunked einsum path, the reference; `splash` is
JAX's Pallas TPU kernel, `cudnn` NVIDIA's fused flash attention. The kernels hand their residuals
(output and log-sum-exp) to the offload engine as tags (`ferry.nn.kernels.flash`)."""
