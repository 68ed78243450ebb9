"""Reading and writing Hugging Face safetensors checkpoints, tensor by tensor.

Reading maps each tensor's bytes from its file (the header gives dtype, shape and offsets) and
slices the map, so only the requested rows and columns are read from disk: a process loads the
shards its devices hold, never the whole checkpoint. The format is read directly because
`safe_open(..., framework="numpy")` cannot return float8 tensors (safetensors 0.8), which
DeepSeek-V3's published weights are. FP8 weights are dequantised with their block scales
(`<name>_scale_inv`, one float32 per block of `weight_block_size` rows x columns).

Writing goes through `safetensors.numpy.save_file`, one file per shard of at most
`max_shard_bytes`, with the `model.safetensors.index.json` that `transformers` reads.
"""

import dataclasses
import json
import math
import stat
import struct
from pathlib import Path
from typing import cast

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from ferry.errors import FerryError, read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
FP8 = "F8_E4M3"


class CheckpointError(FerryError, ValueError):
    """A checkpoint directory ferry cannot read, or one that does not hold the model it should."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: its file, dtype, shape and absolute byte offset."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one .safetensors file (an 8-byte little-endian header size, a JSON header
    of name -> dtype, shape and data offsets relative to the header's end, then the data). A file
    cut short or with a damaged header is refused naming it, before any tensor is mapped."""
    size_on_disk = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _damaged(file, f"it has {size_on_disk} bytes, fewer than the 8 of a header size")
        (size,) = struct.unpack("<Q", prefix)
        if 8 + size > size_on_disk:
            raise _damaged(file, f"its header claims {size:,} bytes but the file has {size_on_disk:,} (cut short?)")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise _damaged(file, f"its header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise _damaged(file, "its header is not a JSON object")
    header.pop("__metadata__", None)
    entries = {}
    for name, info in header.items():
        try:
            start, end = (int(v) for v in info["data_offsets"])
            entry = TensorEntry(file, str(info["dtype"]), tuple(int(d) for d in info["shape"]), 8 + size + start)
        except (KeyError, TypeError, ValueError) as error:
            raise _damaged(file, f"its header entry for {name!r} lacks dtype, shape or data_offsets") from error
        if 8 + size + end > size_on_disk:
            raise _damaged(
                file, f"tensor {name} ends at byte {8 + size + end:,} but the file has {size_on_disk:,} (cut short?)"
            )
        entries[name] = entry
    return entries


def _damaged(file: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{file} is not a readable safetensors file: {why}; download or copy it again")


class CheckpointReader:
    """The tensors of a checkpoint directory, read lazily by name and slice."""

    def __init__(self, directory: str | Path, fp8_block: tuple[int, int] | None = None):
        self.directory = Path(directory)
        self.fp8_block = fp8_block
        index = self.directory / INDEX_FILE
        if (self.directory / SINGLE_FILE).is_file():  # before the index, as transformers looks
            files = [SINGLE_FILE]
        elif index.is_file():
            index_data = read_json(index, "the checkpoint index")
            weight_map = index_data.get("weight_map") if isinstance(index_data, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map (tensor name -> file); download or copy it again")
            files = sorted(set(weight_map.values()))
        else:
            raise CheckpointError(
                f"{self.directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}; ferry reads safetensors "
                "checkpoints only (load a PyTorch .bin checkpoint in transformers and save it with save_pretrained)"
            )
        self.entries: dict[str, TensorEntry] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise CheckpointError(f"{INDEX_FILE} in {self.directory} names {name}, which is missing")
            self.entries |= read_header(path)

    def names(self) -> set[str]:
        return set(self.entries)

    def problem(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Why tensor `name` cannot be read as `shape` (absent, another shape, an unknown dtype, or
        FP8 without its block scales), or None."""
        entry = self.entries.get(name)
        if entry is None:
            return f"{name} is missing"
        if entry.shape != shape:
            return f"{name} has shape {list(entry.shape)}, the config needs {list(shape)}"
        if entry.dtype not in DTYPES:
            return f"{name} has dtype {entry.dtype}; ferry reads {sorted(DTYPES)}"
        if entry.dtype == FP8:
            if len(shape) != 2:
                return f"{name} is {FP8} with {len(shape)} dimensions; block scales cover matrices only"
            if self.fp8_block is None:
                return f"{name} is {FP8} but config.json has no quantization_config.weight_block_size"
            scale = self.entries.get(name + SCALE_SUFFIX)
            blocks = tuple(math.ceil(n / b) for n, b in zip(shape, self.fp8_block, strict=True))
            if scale is None or scale.shape != blocks:
                found = "missing" if scale is None else f"of shape {list(scale.shape)}"
                return f"{name} is {FP8}; its block scales {name + SCALE_SUFFIX} are {found}, need {list(blocks)}"
        return None

    def _mapped(self, entry: TensorEntry) -> np.ndarray:
        dtype = DTYPES[entry.dtype]
        if math.prod(entry.shape) == 0:
            return np.zeros(entry.shape, dtype)
        return np.memmap(entry.file, dtype, mode="r", offset=entry.offset, shape=entry.shape or (1,)).reshape(
            entry.shape
        )

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """The tensor's `index` slices (unit steps) in float32; FP8 dequantised block by block."""
        entry = self.entries[name]
        block = np.asarray(self._mapped(entry)[index]).astype(np.float32)
        if entry.dtype == FP8:
            full = tuple(index) + (slice(None),) * (len(entry.shape) - len(index))
            blocks = zip(full, entry.shape, cast(tuple[int, int], self.fp8_block), strict=True)  # set for FP8
            rows, cols = (np.arange(*s.indices(n)) // b for s, n, b in blocks)
            block = block * self._mapped(self.entries[name + SCALE_SUFFIX])[np.ix_(rows, cols)].astype(np.float32)
        check_finite(block, name, entry.file)
        return block


def check_finite(block: np.ndarray, name: str, file: Path) -> None:
    """A weight holding NaN or an infinity makes every loss NaN from the first step: refused
    naming the tensor and its file, before training starts."""
    finite = np.isfinite(block)
    if finite.all():
        return
    bad = int(finite.size - np.count_nonzero(finite))
    first = tuple(int(i) for i in np.argwhere(~finite)[0])
    raise CheckpointError(
        f"{file}: tensor {name} holds {bad} non-finite value(s) (NaN or infinity; the first at {list(first)} of the "
        "part read); a model cannot train from it: repair the checkpoint or use another"
    )


class ShardedWriter:
    """Writes named tensors into `model-0000i-of-0000n.safetensors` files of at most
    `max_shard_bytes` each (a larger tensor gets a file of its own) and their index; a single
    file is `model.safetensors`, as `save_pretrained` names it."""

    def __init__(self, directory: str | Path, max_shard_bytes: int):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: np.ndarray) -> None:
        if self.pending and self.pending_bytes + tensor.nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = np.ascontiguousarray(tensor)
        self.pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def _flush(self) -> None:
        save_file(self.pending, str(self.directory / f"shard-{len(self.shards)}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, name the files and write the index; returns the files written."""
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for i, name in enumerate(names):
            with_ordinary_mode(self.directory / f"shard-{i}.tmp", self.directory / name).replace(self.directory / name)
        written = [self.directory / name for name in names]
        if count > 1:
            weight_map = {tensor: name for name, tensors in zip(names, self.shards, strict=True) for tensor in tensors}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            written.append(self.directory / INDEX_FILE)
        return written


def with_ordinary_mode(written: Path, destination: Path) -> Path:
    """`written` given the permissions an ordinary file at `destination` has (0644 under umask 022).
    safetensors 0.8 writes every file through a temporary file created 0600, whatever the umask,
    and renames it into place (safetensors/safetensors#764; #782 reports it), so an export other
    users, a container or a serving process should read came out readable by its writer alone. The
    mode is the one `open()` gives `destination` (umask and default ACLs applied by the OS)."""
    destination.open("ab").close()  # made as any file is, or left as it is
    written.chmod(stat.S_IMODE(destination.stat().st_mode))
    return written
