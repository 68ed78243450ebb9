"""Device facts of the clusters ferry plans for, and how XLA compiles for each without the hardware:
NVIDIA GPUs through the CUDA plugin's compile-only topology (a `GpuTargetConfigProto` built from the
facts below), TPUs through libtpu's topologies."""

import dataclasses
import math
from typing import Any, ClassVar

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
class Target:
    """What the plan needs of one device: its HBM, its link to host memory and its peak."""

    platform: ClassVar[str]  # the configs/platform preset whose XLA flags a real run uses
    name: str
    description: str
    hbm_bytes: int
    host_link_bandwidth: float  # bytes/s each way, for the transfer-time model
    bf16_peak_flops: float  # dense, per device

    def devices(self, num_devices: int) -> list[Any]:
        """`num_devices` compile-only devices of this target."""
        raise NotImplementedError

    def compile_options(self, xla_flags: dict[str, object]) -> dict[str, object]:
        """The per-compile options: the platform's XLA flags, plus what compiling without the
        device needs."""
        return dict(xla_flags)


@dataclasses.dataclass(frozen=True)
class GpuTarget(Target):
    platform: ClassVar[str] = "gpu"
    compute_capability: int = 9
    core_count: int = 132
    clock_rate_ghz: float = 1.98
    hbm_bandwidth: int = 0  # bytes/s
    l2_cache_bytes: int = 0

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

    def devices(self, num_devices: int) -> list[Any]:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(
            platform="cuda", target_config=self.target_config(), topology=self.topology(num_devices)
        )
        return list(desc.devices)

    def compile_options(self, xla_flags: dict[str, object]) -> dict[str, object]:
        # Triton GEMM autotuning needs a device to time candidates on; cuBLAS needs none
        return dict(xla_flags) | {"xla_gpu_enable_triton_gemm": False}


@dataclasses.dataclass(frozen=True)
class TpuTarget(Target):
    platform: ClassVar[str] = "tpu"
    generation: str = "v5p"
    torus_dims: int = 3  # v5p slices are 3-D tori, v5e and v6e 2-D
    max_devices: int = 8960

    def topology(self, num_devices: int) -> str:
        """The most even power-of-two slice of `num_devices` chips, hosts of 2x2 chips: 64 v5p
        chips are `v5p:4x4x4`, 32 v6e chips `v6e:4x8`."""
        if num_devices < 4 or num_devices & (num_devices - 1) or num_devices > self.max_devices:
            raise ValueError(
                f"{num_devices} {self.name} chips are not a TPU slice; use a power of two from 4 to {self.max_devices}"
            )
        dims = [2, 2] + [1] * (self.torus_dims - 2)
        while math.prod(dims) < num_devices:
            smallest = min(range(len(dims)), key=lambda i: (dims[i], -i))
            dims[smallest] *= 2
        return f"{self.generation}:" + "x".join(str(d) for d in dims)

    def devices(self, num_devices: int) -> list[Any]:
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(platform="tpu", topology_name=self.topology(num_devices)).devices)


def _gpu(name, description, capability, cores, clock, hbm, bandwidth, l2, host_link, peak) -> GpuTarget:
    return GpuTarget(name, description, hbm, host_link, peak, capability, cores, clock, bandwidth, l2)


# Sources: NVIDIA's data sheets (see ../shared/gpu_targets.md) and Google Cloud's TPU pages. TPU
# host links are not published per chip: PCIe Gen4 x16 (32 GB/s each way) is assumed for all three.
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _gpu("h100", "NVIDIA H100 80GB HBM3", 9, 132, 1.98, 84942979072, 3352320000000, 52428800, 64e9, 989e12),
        _gpu("h200", "NVIDIA H200 141GB HBM3e", 9, 132, 1.98, 151397597184, 4800000000000, 52428800, 64e9, 989e12),
        _gpu("b200", "NVIDIA B200", 10, 148, 1.965, 191514411008, 7672320000000, 132644864, 64e9, 2250e12),
        _gpu("gb200", "NVIDIA GB200", 10, 152, 2.062, 197897748480, 7928064000000, 135528448, 450e9, 2500e12),
        TpuTarget("v5p", "TPU v5p", 95 * 2**30, 32e9, 459e12, "v5p", 3, 8960),
        TpuTarget("v5e", "TPU v5e", 16 * 2**30, 32e9, 197e12, "v5e", 2, 256),
        TpuTarget("v6e", "TPU v6e", 32 * 2**30, 32e9, 918e12, "v6e", 2, 256),
    )
}
