"""Reading memory placements out of a jaxpr, including the bodies of scans and custom rules."""

from jax.extend import core


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, core.Jaxpr):
                yield item


def count_device_puts(jaxpr, memory_kind: str) -> int:
    """How many values `device_put`s in `jaxpr` (recursively) move to `memory_kind`."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            count += sum(getattr(d, "memory_kind", None) == memory_kind for d in eqn.params["devices"])
        for sub in _sub_jaxprs(eqn):
            count += count_device_puts(sub, memory_kind)
    return count


def host_copies(jaxpr):
    """Every `device_put` to pinned host in `jaxpr` (recursively), as (target sharding, value
    moved, the equation that produced the value or None when it is an input of the jaxpr)."""
    producers = {}
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for value, target in zip(eqn.invars, eqn.params["devices"], strict=True):
                if getattr(target, "memory_kind", None) == "pinned_host":
                    found.append((target, value, producers.get(value)))
        for out in eqn.outvars:
            producers[out] = eqn
        for sub in _sub_jaxprs(eqn):
            found += host_copies(sub)
    return found
