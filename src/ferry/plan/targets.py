"""Device facts of the GPU targets ferry plans for, and the `GpuTargetConfigProto` text that lets
XLA compile for them without the hardware (the CUDA plugin's compile-only topology)."""

import dataclasses

_COMMON_DEVICE_INFO = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 49152,
    "shared_memory_per_core": 233472,
    "threads_per_core_limit": 2048,
    "fpus_per_core": 128,
    "block_dim_limit_x": 2147483647,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "shared_memory_per_block_optin": 232448,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str
    description: str
    compute_capability: int
    core_count: int
    clock_rate_ghz: float
    hbm_bytes: int
    hbm_bandwidth: int  # bytes/s
    l2_cache_bytes: int
    host_link_bandwidth: float  # bytes/s each way, for the transfer-time model
    bf16_peak_flops: float  # dense, per device

    def target_config(self) -> str:
        """The proto's text format, as the CUDA plugin's `get_topology_desc` takes it."""
        info = "\n".join(f"  {key}: {value}" for key, value in _COMMON_DEVICE_INFO.items())
        return (
            "gpu_device_info {\n"
            f"{info}\n"
            f"  cuda_compute_capability {{ major: {self.compute_capability} "
            "feature_extension: ACCELERATED_FEATURES }\n"
            f"  core_count: {self.core_count}\n"
            f"  clock_rate_ghz: {self.clock_rate_ghz}\n"
            f"  device_memory_size: {self.hbm_bytes}\n"
            f"  memory_bandwidth: {self.hbm_bandwidth}\n"
            f"  l2_cache_size: {self.l2_cache_bytes}\n"
            "}\n"
            'platform_name: "CUDA"\n'
            "dnn_version_info { major: 9 minor: 10 patch: 0 }\n"
            f'device_description_str: "{self.description}"\n'
        )

    def topology(self, num_devices: int) -> str:
        """SLICES x HOSTS x DEVICES_PER_HOST, 8 devices per host (1 host below 8)."""
        if num_devices <= 8:
            return f"1x1x{num_devices}"
        if num_devices % 8:
            raise ValueError(f"{num_devices} {self.name} devices do not fill hosts of 8; use a multiple of 8")
        return f"1x{num_devices // 8}x8"


GPU_TARGETS: dict[str, GpuTarget] = {
    t.name: t
    for t in (
        GpuTarget("h100", "NVIDIA H100 80GB HBM3", 9, 132, 1.98, 84942979072, 3352320000000, 52428800, 64e9, 989e12),
        GpuTarget("h200", "NVIDIA H200 141GB HBM3e", 9, 132, 1.98, 151397597184, 4800000000000, 52428800, 64e9, 989e12),
        GpuTarget("b200", "NVIDIA B200", 10, 148, 1.965, 191514411008, 7672320000000, 132644864, 64e9, 2250e12),
        GpuTarget("gb200", "NVIDIA GB200", 10, 152, 2.062, 197897748480, 7928064000000, 135528448, 450e9, 2500e12),
    )
}
