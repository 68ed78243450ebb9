"""Facts of the accelerators ferry knows, written once: each one's dense bf16 peak, and how JAX's
`device.device_kind` names it. A leaf module: the planner's targets (`ferry.xla.targets`) and a
run's MFU (`ferry.xla.peak`) both read it, and it imports nothing of ferry."""

# Dense bf16 peak FLOP/s per device, by accelerator name (the planner's target names). Sources:
# NVIDIA's data sheets (www.nvidia.com/en-us/data-center/h100/, /h200/, /dgx-b200/, /gb200-nvl72/;
# H100 SXM 989 TFLOP/s, H200 989, B200 ~2,250, GB200 ~2,500) and Google Cloud's TPU pages
# (docs.cloud.google.com/tpu/docs/v5p, /v5e, /v6e).
BF16_PEAK_FLOPS: dict[str, float] = {
    "h100": 989e12,
    "h200": 989e12,
    "b200": 2250e12,
    "gb200": 2500e12,
    "v5p": 459e12,
    "v5e": 197e12,
    "v6e": 918e12,
}

# Substrings of `device.device_kind` -> accelerator name; the first match wins (GB200 before B200).
DEVICE_KINDS: tuple[tuple[str, str], ...] = (
    ("GB200", "gb200"),
    ("B200", "b200"),
    ("H200", "h200"),
    ("H100", "h100"),
    ("v5p", "v5p"),
    ("v5 lite", "v5e"),
    ("v5e", "v5e"),
    ("v6 lite", "v6e"),
    ("v6e", "v6e"),
)


def accelerator_name(device_kind: str) -> str | None:
    """The accelerator a device kind names (case-insensitive), or None for one ferry does not know."""
    for fragment, name in DEVICE_KINDS:
        if fragment.lower() in device_kind.lower():
            return name
    return None
