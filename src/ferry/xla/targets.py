"""Device facts of the clusters ferry plans for, and how XLA compiles for each without the hardware:
NVIDIA GPUs through the CUDA plugin's compile-only topology (a `GpuTargetConfigProto` built from the
facts below), TPUs through libtpu's topologies.

`TARGETS` is the one registry of targets: a target is added there (its peak and device kind in
`ferry.xla.hardware`), and every list of targets a user reads (the config's refusals, mode=compile's
TPUs, the launcher's --help) is `target_names`' reading of it."""

import dataclasses
import math
import threading
from typing import Any, ClassVar

from ferry.errors import ConfigError
from ferry.xla.hardware import BF16_PEAK_FLOPS

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
# The plan compiles its presets on threads: the first topology a process asks for loads the PJRT
# plugin, and two threads loading it at once fail ("PJRT_Api already exists for device type tpu")
_TOPOLOGY_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Target:
    """What the plan needs of one device: its HBM, its link to host memory and its peak."""

    platform: ClassVar[str]  # the configs/platform preset whose XLA flags a real run uses
    # the share of HBM offload=auto leaves free beside a compiled program's own bytes
    hbm_headroom: ClassVar[float]
    name: str
    description: str
    hbm_bytes: int
    host_link_bandwidth: float  # bytes/s each way, for the transfer-time model
    bf16_peak_flops: float  # dense, per device
    interconnect_bandwidth: float = 0.0  # bytes/s each way per device within a scale-up domain (NVLink, ICI)
    domain_size: int = 1  # devices one scale-up domain joins (an NVLink domain, a TPU slice)
    scale_out_bandwidth: float = 0.0  # bytes/s each way per device between domains (InfiniBand, DCN)
    # a step's compute against its matmuls at the peak, measured on the device: the program's matmul
    # FLOPs at `bf16_peak_flops` over the measured step of a preset that copies nothing (kernels,
    # elementwise work and the optimizer included); 1.0 where no chip was measured
    compute_fraction: float = 1.0

    @property
    def matmul_rate(self) -> float:
        """FLOP/s the step-time estimate runs a program's matmuls at: the peak times `compute_fraction`."""
        return self.bf16_peak_flops * self.compute_fraction

    def devices(self, num_devices: int) -> list[Any]:
        """`num_devices` compile-only devices of this target."""
        raise NotImplementedError

    def collective_bandwidth(self, groups: tuple[tuple[int, ...], ...]) -> float:
        """Bytes/s each way a collective over `groups` (device ids, a domain holding consecutive
        ids) gets per device: the scale-up link when every group lies in one domain, else the
        scale-out network, which the ring then crosses."""
        within = all(len({device // self.domain_size for device in group}) <= 1 for group in groups)
        return self.interconnect_bandwidth if within else self.scale_out_bandwidth

    def compile_options(self, xla_flags: dict[str, object]) -> dict[str, object]:
        """The per-compile options: the platform's XLA flags, plus what compiling without the
        device needs."""
        return dict(xla_flags)

    def topology(self, num_devices: int) -> str:
        """The topology string of `num_devices` devices (each platform's target says how)."""
        raise NotImplementedError(f"{type(self).__name__} has no topology")


@dataclasses.dataclass(frozen=True)
class GpuTarget(Target):
    platform: ClassVar[str] = "gpu"
    # outside the program: the allocator's fragmentation, cuDNN's and NCCL's workspaces
    hbm_headroom: ClassVar[float] = 0.05
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

        with _TOPOLOGY_LOCK:
            desc = topologies.get_topology_desc(
                platform="cuda", target_config=self.target_config(), topology=self.topology(num_devices)
            )
        return list(desc.devices)

    def compile_options(self, xla_flags: dict[str, object]) -> dict[str, object]:
        # Triton GEMM autotuning needs a device to time candidates on; cuBLAS needs none. Without a
        # device autotuning has nothing to time either, and spends most of a small compile on it
        # (docs/results/deviceless.md, "Compiling for a GPU without autotuning"); without it the
        # program's memory, matmuls and host copies (and the compute scheduled under each) are the
        # same, only kernels' launch configs differ.
        return dict(xla_flags) | {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}


@dataclasses.dataclass(frozen=True)
class TpuTarget(Target):
    platform: ClassVar[str] = "tpu"
    # none: XLA refuses at compile a TPU program over the HBM the runtime gives it, and one it
    # accepts holds on the chip just what it compiled to (every case measured on a v5e chip, up to
    # nearly all of its HBM: docs/results/tpu-v5e.md, "The memory figures" and run 5)
    hbm_headroom: ClassVar[float] = 0.0
    generation: str = "v5p"
    torus_dims: int = 3  # v5p slices are 3-D tori, v5e and v6e 2-D
    max_devices: int = 8960
    hbm_bandwidth: float = 0.0  # bytes/s

    def slice_sizes(self) -> str:
        """The chip counts Google Cloud rents this generation in, as a user reads them."""
        least = "1, 4" if self.single_chip else "4"
        return f"{least} or a larger power of two up to {self.max_devices}"

    @property
    def single_chip(self) -> bool:
        """v5e and v6e (2-D tori) are also rented as one chip (`v5litepod-1`, `v6e-1`: a 1x1
        topology); v5p's smallest slice is 2x2x1."""
        return self.torus_dims == 2

    def topology(self, num_devices: int) -> str:
        """The most even power-of-two slice of `num_devices` chips, hosts of 2x2 chips, as Google
        Cloud's TPU pages list them: 64 v5p chips are `v5p:4x4x4`, 8 v5e chips `v5e:2x4`, 32 v6e
        chips `v6e:4x8`; one v5e or v6e chip is `v5e:1x1`."""
        power_of_two = num_devices >= 4 and not num_devices & (num_devices - 1)
        if not (power_of_two or (num_devices == 1 and self.single_chip)) or num_devices > self.max_devices:
            raise ValueError(f"{num_devices} {self.name} chips are not a TPU slice; use {self.slice_sizes()}")
        if num_devices == 1:
            return f"{self.generation}:" + "x".join(["1"] * self.torus_dims)
        dims = [2, 2] + [1] * (self.torus_dims - 2)
        while math.prod(dims) < num_devices:
            smallest = min(range(len(dims)), key=lambda i: (dims[i], -i))
            dims[smallest] *= 2
        return f"{self.generation}:" + "x".join(str(d) for d in dims)

    def devices(self, num_devices: int) -> list[Any]:
        from jax.experimental import topologies

        topology = self.topology(num_devices)
        # one chip is its own host: older libtpu (jax 0.10.2's) assumes 2x2 chips per host and
        # refuses a 1x1 layout unless told
        bounds = {"chips_per_host_bounds": [1, 1, 1]} if num_devices == 1 else {}
        with _TOPOLOGY_LOCK:
            return list(topologies.get_topology_desc(platform="tpu", topology_name=topology, **bounds).devices)


def _gpu(name, description, chip, hbm, hbm_bandwidth, host_link, links) -> GpuTarget:
    """`chip`: (compute capability, cores, clock GHz, L2 bytes); `links`: (scale-up bytes/s each
    way, devices per scale-up domain, scale-out bytes/s each way); the peak is `ferry.xla.hardware`'s."""
    capability, cores, clock, l2 = chip
    nvlink, domain, network = links
    return GpuTarget(
        name,
        description,
        hbm,
        host_link,
        BF16_PEAK_FLOPS[name],
        interconnect_bandwidth=nvlink,
        domain_size=domain,
        scale_out_bandwidth=network,
        compute_capability=capability,
        core_count=cores,
        clock_rate_ghz=clock,
        hbm_bandwidth=int(hbm_bandwidth),
        l2_cache_bytes=l2,
    )


def _tpu(
    name, description, hbm, hbm_bandwidth, host_link, ici, generation, torus_dims, max_devices, compute_fraction=1.0
) -> TpuTarget:
    """The peak is `ferry.xla.hardware`'s."""
    return TpuTarget(
        name,
        description,
        hbm,
        host_link,
        BF16_PEAK_FLOPS[name],
        interconnect_bandwidth=ici,
        domain_size=max_devices,
        scale_out_bandwidth=ici,
        generation=generation,
        torus_dims=torus_dims,
        max_devices=max_devices,
        compute_fraction=compute_fraction,
        hbm_bandwidth=hbm_bandwidth,
    )


# Sources, bandwidths given each way (half a published bidirectional figure):
# - HBM: NVIDIA's data sheets (www.nvidia.com/en-us/data-center/h100/, /h200/, /dgx-b200/,
#   /gb200-nvl72/; the per-device figures are in `TARGETS` below), Google Cloud's TPU pages
#   (docs.cloud.google.com/tpu/docs/v5p, /v5e, /v6e; their HBM bandwidth: v5p 2,765 GB/s, v5e 819 GB/s,
#   v6e 1,640 GB/s). The dense bf16 peaks are in ferry/xla/hardware.py.
# - Host link: H100, H200 and B200 reach the CPU over PCIe Gen5 x16, 128 GB/s bidirectional (their
#   data sheets): 64 GB/s. GB200's GPUs reach Grace's LPDDR5X over NVLink-C2C, 900 GB/s
#   bidirectional (GB200 NVL72 data sheet): 450 GB/s. v6e chips connect to their host over PCIe
#   Gen5 (the v6e page): 64 GB/s; v5p publishes none, PCIe Gen4 x16 is assumed: 32 GB/s. v5e:
#   measured, not assumed: the mean of one chip's two directions inside a compiled program
#   (benchmarks/tpu_check.py's link probe; docs/results/tpu-v5e.md, "Offloading does not pay
#   here"), under half the PCIe Gen4 figure.
# - Scale-up: H100 and H200 SXM have NVLink 4 at 900 GB/s bidirectional per GPU, 8 GPUs per HGX
#   board; B200 NVLink 5 at 1.8 TB/s, 8 per HGX board; GB200 NVLink 5 at 1.8 TB/s, 72 GPUs in an
#   NVL72 domain (the data sheets). TPU ICI per chip, bidirectional (the TPU pages): v5p 1,200 GB/s,
#   v5e 400 GB/s, v6e 800 GB/s, over the whole slice; every port of a chip is counted, which a
#   collective over one axis of the torus does not use: optimistic.
# - Scale-out: one ConnectX-7 400 Gb/s InfiniBand port per GPU (DGX H100/H200/B200 and GB200 NVL72
#   compute trays): 50 GB/s. A TPU slice is one ICI domain (multislice DCN is not planned).
# what a v5e chip lets a program use: memory_stats()["bytes_limit"] on the chip (jax 0.10.2), the
# "available HBM (15.75G)" of XLA's out-of-memory error; its 16 GiB less the runtime's reserve
V5E_HBM = 16_909_336_064
# measured: full_remat's step of the 386M Llama shape at batch 8, its matmuls at the peak over the
# step one v5e chip ran (docs/results/tpu-v5e.md, "The planner against the chip"): splash
# attention's kernels, elementwise work and the optimizer ride on the matmuls' time. With it the
# plan's other presets land close to their measured steps
V5E_COMPUTE_FRACTION = 212.09 / 325.88
_HGX_NVLINK4 = (450e9, 8, 50e9)  # H100, H200: NVLink 4 within an 8-GPU board, 400 Gb/s IB between
_HGX_NVLINK5 = (900e9, 8, 50e9)  # B200: NVLink 5 within an 8-GPU board
_NVL72 = (900e9, 72, 50e9)  # GB200: NVLink 5 across a 72-GPU rack

_HOPPER = (9, 132, 1.98, 52428800)  # compute capability, cores, clock GHz, L2 bytes

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _gpu("h100", "NVIDIA H100 80GB HBM3", _HOPPER, 84942979072, 3352320e6, 64e9, _HGX_NVLINK4),
        _gpu("h200", "NVIDIA H200 141GB HBM3e", _HOPPER, 151397597184, 4800e9, 64e9, _HGX_NVLINK4),
        _gpu("b200", "NVIDIA B200", (10, 148, 1.965, 132644864), 191514411008, 7672320e6, 64e9, _HGX_NVLINK5),
        _gpu("gb200", "NVIDIA GB200", (10, 152, 2.062, 135528448), 197897748480, 7928064e6, 450e9, _NVL72),
        _tpu("v5p", "TPU v5p", 95 * 2**30, 2765e9, 32e9, 600e9, "v5p", 3, 8960),
        _tpu("v5e", "TPU v5e", V5E_HBM, 819e9, 14.5e9, 200e9, "v5e", 2, 256, V5E_COMPUTE_FRACTION),
        _tpu("v6e", "TPU v6e", 32 * 2**30, 1640e9, 64e9, 400e9, "v6e", 2, 256),
    )
}


def target_names(platform: str | None = None) -> tuple[str, ...]:
    """The targets' names in `TARGETS`' order; only those of `platform` (gpu, tpu) where given."""
    return tuple(name for name, target in TARGETS.items() if platform in (None, target.platform))


def named_target(name: str | None) -> Target:
    """The target `target=NAME` names; refused, naming every target, for a name `TARGETS` lacks."""
    target = TARGETS.get(name or "")
    if target is None:
        raise ConfigError(f"target={name} is not a target the planner knows; use one of {', '.join(target_names())}")
    return target
