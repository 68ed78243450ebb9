"""Where each ferry parameter lives in a Hugging Face checkpoint.

ferry stacks identical layers (and experts) along leading axes and stores Linear weights as
[in, out]; Hugging Face stores one tensor per layer and expert, Linear weights as [out, in]. A
`TensorMap` names the Hugging Face tensor behind every index of a ferry array's stacked axes,
so an array is assembled slice by slice on import and split back into tensors on export.
"""

import dataclasses
from collections.abc import Callable, Iterator
from typing import cast

import jax
import numpy as np
from jaxtyping import Array, Float

from ferry.hf.safetensors_io import SCALE_SUFFIX, CheckpointError, CheckpointReader


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One ferry array as Hugging Face tensors: `names[i, j, ...]` is the tensor at index
    (i, j, ...) of the array's leading stacked axes (layers, experts; a 0-d array for an
    unstacked parameter). `transposed`: a Linear weight ([out, in] there, [in, out] here).
    `aliases`: further names export writes the same tensor under and import ignores (DeepSeek's
    MTP layers repeat the embedding and the output head)."""

    names: np.ndarray
    transposed: bool = False
    aliases: tuple[str, ...] = ()

    def hf_shape(self, ferry_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each Hugging Face tensor of a ferry array of `ferry_shape`."""
        tail = ferry_shape[self.names.ndim :]
        return tail[::-1] if self.transposed else tail

    def items(self) -> Iterator[tuple[tuple[int, ...], str]]:
        """(index into the stacked axes, tensor name), in order."""
        for position in np.ndindex(self.names.shape):
            yield position, str(self.names[position])


def single(name: str, transposed: bool = False, aliases: tuple[str, ...] = ()) -> TensorMap:
    return TensorMap(np.array(name, dtype=object), transposed, aliases)


def stacked(name: Callable[..., str], *sizes: int, transposed: bool = False) -> TensorMap:
    """A map over stacked axes of `sizes`; `name(i, j, ...)` gives each tensor's name."""
    names = np.empty(sizes, dtype=object)
    for position in np.ndindex(*sizes):
        names[position] = name(*position)
    return TensorMap(names, transposed)


def check_tensors(
    reader: CheckpointReader,
    maps: dict[str, TensorMap],
    abstract: dict[str, jax.ShapeDtypeStruct],
    ignored: Callable[[str], bool] = lambda name: False,
) -> None:
    """Every tensor the model needs is present with the shape its config implies, and every
    other tensor of the checkpoint is one the family knows to skip (`ignored`): the checkpoint's
    headers only, before any data is read."""
    problems, used = [], set()
    for path, tensor_map in maps.items():
        shape = tensor_map.hf_shape(abstract[path].shape)
        for _, name in tensor_map.items():
            used.add(name)
            problem = reader.problem(name, shape)
            if problem:
                problems.append(problem)
        used.update(tensor_map.aliases)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{reader.directory} does not hold the model its config.json describes: {shown}")
    used |= {name + SCALE_SUFFIX for name in used}
    unused = sorted(name for name in reader.names() - used if not ignored(name))
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise CheckpointError(
            f"{reader.directory} holds {len(unused)} tensor(s) ferry's model has no place for: {shown}; "
            "it is a variant of the architecture ferry does not implement"
        )


def _normalise(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))


def read_block(reader: CheckpointReader, tensor_map: TensorMap, shape: tuple[int, ...], index: tuple) -> np.ndarray:
    """The block `index` of a ferry array of `shape`, read from the tensors that hold it."""
    index = _normalise(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)
    lead = tensor_map.names.ndim
    names = np.asarray(tensor_map.names[index[:lead]], dtype=object)  # 0-d for an unstacked array
    tail = index[lead:]
    hf_index = tail[::-1] if tensor_map.transposed else tail
    block = np.empty(names.shape + tuple(s.stop - s.start for s in tail), np.float32)
    for position in np.ndindex(names.shape):
        tensor = reader.read(str(names[position]), hf_index)
        block[position] = tensor.T if tensor_map.transposed else tensor
    return block


def load_array(
    reader: CheckpointReader, tensor_map: TensorMap, like: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding
) -> Float[Array, "..."]:
    """A ferry array placed straight onto `sharding`: each device's shard is read from disk by
    itself (only the slices this process's devices hold are read)."""
    return jax.make_array_from_callback(
        like.shape,
        sharding,
        lambda index: read_block(reader, tensor_map, like.shape, cast(tuple[slice, ...], index)).astype(like.dtype),
    )


def host_tensors(array: Float[Array, "..."], tensor_map: TensorMap) -> Iterator[tuple[str, np.ndarray]]:
    """(name, host tensor in Hugging Face's layout) for every tensor of a ferry array, one at a
    time, so no more than one tensor is on the host at once. Every process must call this (a
    tensor of an array spread over processes is gathered from all of them)."""
    for position, name in tensor_map.items():
        tensor = _to_host(_take(array, np.asarray(position, np.int32)) if position else array)
        tensor = tensor.T if tensor_map.transposed else tensor
        yield name, tensor
        for alias in tensor_map.aliases:
            yield alias, tensor


@jax.jit
def _take(array: jax.Array, position: jax.Array) -> jax.Array:
    """array[layer, expert, ...] with the position traced: one compile per array, not per index."""
    return array[tuple(position)]


def _to_host(array: jax.Array) -> np.ndarray:
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
