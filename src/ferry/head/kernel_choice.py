"""`train.loss_kernel`: who makes the fused loss head's chunks, XLA or the Pallas kernel of
`ferry.head.kernel`, for the platform and mesh the step is traced for.

`auto` (the default) takes the kernel on a TPU whose devices each hold the whole vocabulary and
whose VMEM holds blocks of at least `MIN_AUTO_ROWS` tokens at this vocabulary and width; XLA
elsewhere, saying why. `pallas` is refused where it cannot run: on a GPU (a Mosaic kernel is
TPU-only), on a mesh that splits the vocabulary (a token's log-sum-exp would span devices), where
no block of tokens fits the VMEM; off a TPU it runs in Pallas interpret mode (the CPU tests).
"""

import dataclasses

from jax.sharding import AbstractMesh, Mesh

from ferry.errors import ConfigError
from ferry.head.kernel import V5E_VMEM, HeadTiles, choose_tiles, vmem_capacity
from ferry.sharding import context_mesh, lowering_platform

# blocks below this walk the weight too often to beat XLA (measured on v5e: docs/results/tpu-v5e.md,
# run 11, "What made it faster than XLA")
MIN_AUTO_ROWS = 512
SMALLEST_VMEM = 16 * 2**20  # v2 to v4's, taken for a TPU of a kind JAX's table does not name


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Who makes a fused head's chunks ("xla" or "pallas"), the kernel's blocks and whether it
    runs in interpret mode, and why."""

    kernel: str
    tiles: HeadTiles | None
    interpret: bool
    why: str


def device_kind(mesh: Mesh | AbstractMesh | None) -> str | None:
    """The kind of the devices the step is traced for ("TPU v5 lite"): a concrete mesh's (a
    compile-only mesh of a target's devices too), else None (as `mesh_platform` reads a mesh)."""
    return mesh.devices.flat[0].device_kind if isinstance(mesh, Mesh) else None


def choose_kernel(
    setting: str, tokens: int, columns: int, vocab: int, dim: int, itemsize: int, mesh=None
) -> KernelChoice:
    """`setting`'s choice for a device's chunk of `tokens` tokens and `columns` of the `vocab`
    vocabulary columns at width `dim` (the compute dtype `itemsize` bytes), under `mesh`
    (default: the context's)."""
    if setting == "xla":
        return KernelChoice("xla", None, False, "as set")
    platform = lowering_platform()
    kind = device_kind(context_mesh() if mesh is None else mesh) if platform == "tpu" else None
    vmem = vmem_capacity(kind) if platform == "tpu" else V5E_VMEM  # interpret mode: as a v5e
    tiles = _tiles(tokens, columns, dim, itemsize, SMALLEST_VMEM if vmem is None else vmem)
    if setting == "auto":
        return _auto(platform, kind, vmem, tiles, columns == vocab)
    if platform == "gpu":
        raise ConfigError(
            "train.loss_kernel=pallas is a TPU kernel (Pallas Mosaic); on a GPU use train.loss_kernel=xla"
        )
    if columns != vocab:
        raise ConfigError(
            "train.loss_kernel=pallas needs each device to hold the whole vocabulary, and this mesh splits the "
            f"{vocab:,} logits columns over its tensor axis; use train.loss_kernel=xla (or auto) or mesh.tensor=1"
        )
    if tiles is None:
        raise ConfigError(
            f"train.loss_kernel=pallas: no block of tokens fits {vmem_text(vmem)} of VMEM at a vocabulary of "
            f"{vocab:,} and width {dim:,}; use train.loss_kernel=xla (or auto)"
        )
    interpret = platform != "tpu"
    why = f"as set, in Pallas interpret mode ({platform})" if interpret else "as set"
    return KernelChoice("pallas", tiles, interpret, why)


def _tiles(tokens: int, columns: int, dim: int, itemsize: int, vmem: int) -> HeadTiles | None:
    try:
        return choose_tiles(tokens, columns, dim, itemsize, vmem)
    except ValueError:
        return None


def _auto(platform: str, kind: str | None, vmem: int | None, tiles: HeadTiles | None, whole: bool) -> KernelChoice:
    if platform != "tpu":
        return KernelChoice("xla", None, False, f"{platform}, not a TPU")
    if not whole:
        return KernelChoice("xla", None, False, "the mesh splits the vocabulary")
    if vmem is None:
        return KernelChoice("xla", None, False, f"the VMEM of a {kind or 'TPU of unnamed kind'} is not in JAX's table")
    if tiles is None or tiles.rows < MIN_AUTO_ROWS:
        held = "no block" if tiles is None else f"blocks of {tiles.rows:,} tokens"
        return KernelChoice(
            "xla", None, False, f"{vmem_text(vmem)} of VMEM holds {held} here, under the {MIN_AUTO_ROWS} that beat XLA"
        )
    return KernelChoice("pallas", tiles, False, f"a {kind or 'TPU'}, the vocabulary whole on each device")


def vmem_text(vmem: int | None) -> str:
    return "an unknown amount" if vmem is None else f"{vmem / 2**20:,.0f} MiB"
