"""An offload policy: where each tagged activation lives between the forward and the backward
pass. Plain data, validated once, shared by both halves of the engine (`ferry.offload.engine`,
`ferry.offload.scan`), the planner and the trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Literal, cast, get_args

from ferry.errors import FerryError

Placement = Literal["device", "offload", "remat"]
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)
Engine = Literal["ferry", "jax"]
ENGINES: tuple[Engine, ...] = get_args(Engine)
LAYER_INPUT = "decoder_layer_input"
"""The name of a layer's input. It is a residual of every layer and cannot be recomputed
inside the layer, so a policy places it on `device` (the default) or `offload`s it."""


class PolicyError(FerryError, ValueError):
    """A policy that cannot be applied: a bad placement or a name the model does not tag."""


@dataclasses.dataclass(frozen=True)
class Policy(Mapping[str, Placement]):
    """Where each tagged activation lives between the forward and the backward pass: an
    immutable mapping from the tensor names it mentions to their placement.

    Names not mentioned are rematerialised (the layer input: kept on device); `placement(name)`
    answers for any name. `keep_all` disables the custom VJP altogether, so JAX's own autodiff
    keeps every residual in HBM: the `save_all` reference every other policy is compared against.
    `pipelined` (the default) moves a scanned stack's offloaded values one layer apart
    (`ferry.offload.scan`): each copy hides under a whole layer, for one more layer of them in
    HBM; False moves them inside each layer (`offloaded`). `peel` runs a pipelined stack's
    first layer and its last `peel` layers outside its loop (`peel` + 2 copies of the layer in the
    program): no placeholder crosses the link, and the copies of the layers outside the loop may
    overlap any work around them (the loss head), where a loop iteration's must finish under it.
    `engine="jax"` places the same tensors with JAX's own offload instead (`checkpointed_by_jax`),
    the baseline ferry's engine is measured against.
    """

    placements: tuple[tuple[str, str], ...] | Mapping[str, str] = ()
    keep_all: bool = False
    pipelined: bool = True
    peel: int = 0
    engine: str = "ferry"

    def __post_init__(self) -> None:
        # `Policy({"mlpwo": "offload"})` reads as a user writes it; stored as sorted pairs, so two
        # policies placing the same names alike are equal and hash alike (it is a jit static).
        pairs = self.placements.items() if isinstance(self.placements, Mapping) else self.placements
        stored = tuple(sorted((str(k), str(v)) for k, v in pairs))
        object.__setattr__(self, "placements", stored)
        for name, placement in stored:
            if placement not in PLACEMENTS:
                raise PolicyError(
                    f"tensor {name!r} has placement {placement!r}; a placement is one of {', '.join(PLACEMENTS)}"
                )
            if name == LAYER_INPUT and placement == "remat":
                raise PolicyError(
                    f"{LAYER_INPUT} cannot be rematerialised: nothing inside the layer computes it; "
                    "place it on 'device' or 'offload'"
                )
        names = [name for name, _ in stored]
        if len(set(names)) != len(names):
            raise PolicyError(f"a tensor is placed twice in {names}")
        if self.peel < 0:
            raise PolicyError(f"peel is {self.peel}; it counts the last layers run outside the loop: 0 or more")
        if self.keep_all and any(p != "device" for _, p in stored):
            raise PolicyError("keep_all keeps every residual on device; it takes no other placements")
        if self.engine not in ENGINES:
            raise PolicyError(f"engine is {self.engine!r}; an offload engine is one of {', '.join(ENGINES)}")
        if self.engine == "jax" and dict(self.placements).get(LAYER_INPUT) == "offload":
            raise PolicyError(
                f"engine 'jax' cannot offload {LAYER_INPUT}: jax.checkpoint keeps a layer's input where the "
                "scan put it (HBM); place it on 'device', or use engine 'ferry'"
            )

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, str] | None = None,
        *,
        keep_all: bool = False,
        pipelined: bool = True,
        peel: int = 0,
        engine: str = "ferry",
    ) -> Policy:
        """Build a policy from `{tensor name: placement}` (e.g. a Hydra config node); the same as
        `Policy(tensors)`."""
        return cls(dict(tensors or {}), keep_all, pipelined, peel, engine)

    @classmethod
    def save_all(cls) -> Policy:
        """Keep every residual on device: no recompute, no transfers."""
        return cls(keep_all=True)

    @property
    def pairs(self) -> tuple[tuple[str, Placement], ...]:
        """The placements as `__post_init__` stores them: sorted (name, placement) pairs."""
        return cast(tuple[tuple[str, Placement], ...], self.placements)

    @property
    def copies_to_host(self) -> bool:
        """Does this policy offload any tensor (so the step copies to pinned host)?"""
        return not self.keep_all and any(place == "offload" for _, place in self.pairs)

    @property
    def peeled(self) -> bool:
        """Does this policy peel its scanned stacks of two layers or more (`peels`)?"""
        return self.peel > 0 and self.pipelined_by_ferry

    @property
    def pipelined_by_ferry(self) -> bool:
        """Does ferry's engine move a scanned stack's copies one layer apart (`ferry.offload.scan`)?
        JAX's own offload (`engine="jax"`) has no such schedule."""
        return self.pipelined and not self.keep_all and self.engine == "ferry"

    def peels(self, num_layers: int) -> int:
        """How many of a scanned stack's last layers run outside its loop under this policy
        (`ferry.offload.scan`; its first layer too, where any do): `peel`, at most all but the
        first, and only in a pipelined stack."""
        return min(self.peel, num_layers - 1) if self.peeled and num_layers >= 2 else 0

    def placement(self, name: str) -> Placement:
        if self.keep_all:
            return "device"
        default: Placement = "device" if name == LAYER_INPUT else "remat"
        return dict(self.pairs).get(name, default)

    def __getitem__(self, name: str) -> Placement:
        return dict(self.pairs)[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.pairs)

    def __len__(self) -> int:
        return len(self.placements)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self)

    def validate(self, tagged: frozenset[str] | set[str]) -> None:
        """Refuse names the model never tags, listing the ones it does tag."""
        unknown = sorted(self.names - set(tagged) - {LAYER_INPUT})
        if unknown:
            raise PolicyError(
                f"the offload policy names {unknown}, which this model never tags; "
                f"it tags: {', '.join(sorted(set(tagged) | {LAYER_INPUT}))}"
            )


SAVE_ALL = Policy.save_all()
"""The default policy of a model called directly: no custom VJP, every residual in HBM."""
