"""Offloaded residuals keep their sharding: each host copy is placed with the spec of the device
value it copies. Traced on abstract 4-device meshes, so no devices are needed."""

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from ferry.offload.engine import LAYER_INPUT, Policy, offloaded, tag
from ferry.sharding import HEADS, MESH_AXES
from tests.placements import host_copies

BATCH = ("data", "fsdp", "expert")


def sharded_layer(w: jax.Array, x: jax.Array) -> jax.Array:
    h = tag(jnp.tanh(x @ w), "h", HEADS)  # [batch, seq, heads]: split over batch and tensor
    return x + tag(h @ w.T, "out")


def grad_jaxpr(axis_type: AxisType):
    mesh = AbstractMesh((2, 1, 2, 1), MESH_AXES, axis_types=(axis_type,) * 4)
    policy = Policy.from_dict({"h": "offload", "out": "offload", LAYER_INPUT: "offload"})
    layer = offloaded(sharded_layer, policy)
    with jax.sharding.use_abstract_mesh(mesh):
        x_spec = PartitionSpec("data", None, None) if axis_type == AxisType.Explicit else PartitionSpec()
        w = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
        x = jax.ShapeDtypeStruct((4, 6, 8), jnp.float32, sharding=NamedSharding(mesh, x_spec))
        return jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(layer(w, x))))(w, x).jaxpr


def test_host_copies_take_the_spec_in_the_value_type_on_explicit_axes():
    copies = host_copies(grad_jaxpr(AxisType.Explicit))
    assert len(copies) == 3
    for target, value, _ in copies:
        assert target.spec == value.aval.sharding.spec
        assert target.spec[0] == "data"  # sharded, not a replicated copy of the whole batch


def test_host_copies_take_the_spec_the_device_value_is_pinned_to_on_auto_axes():
    copies = host_copies(grad_jaxpr(AxisType.Auto))
    assert len(copies) == 3
    specs = []
    for target, _, producer in copies:
        assert producer is not None and producer.primitive.name == "sharding_constraint"
        assert producer.params["sharding"].spec == target.spec
        specs.append(target.spec)
    # the tagged [batch, seq, heads] value is split over batch and tensor; the others over batch
    assert PartitionSpec(BATCH, None, "tensor") in specs
    assert specs.count(PartitionSpec(BATCH, None, None)) == 2
