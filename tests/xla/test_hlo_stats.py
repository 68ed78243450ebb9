"""Collective bytes read from HLO text, weighted by the trip counts of the loops around them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ferry.xla.hlo_collectives import collective_bytes, collectives
from ferry.xla.hlo_flops import matmul_flops
from ferry.xla.hlo_host_copies import host_copies, overlapped_flops
from ferry.xla.hlo_parse import byte_strides, execution_counts, shape_bytes
from ferry.xla.hlo_slice_walks import host_slice_walks
from tests.conftest import needs_cuda_plugin, needs_libtpu

MODULE = """HloModule jit_step, entry_computation_layout={(f32[3,4,16]{2,1,0})->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %sum = f32[] add(%x, %y)
}

%layer_body (param: (s32[], f32[2,16])) -> (s32[], f32[2,16]) {
  %slice = f32[4,16]{1,0} fusion(%param), kind=kLoop, calls=%fused_slice
  %all-gather.1 = f32[16,16]{1,0} all-gather(%slice), channel_id=1, dimensions={0}
  %all-reduce.2 = (f32[16,16]{1,0}, bf16[8]{0}) all-reduce(%a, %b), channel_id=2, to_apply=%add
  %h = f32[2,16]{1,0} parameter(1)
  %w = f32[16,16]{1,0} parameter(2)
  %dot.1 = f32[2,16]{1,0} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tuple = (s32[], f32[2,16]) tuple(%i, %h)
}

%layer_cond (param: (s32[], f32[2,16])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%fused_slice (p: (s32[], f32[2,16])) -> f32[4,16] {
  ROOT %s = f32[4,16]{1,0} dynamic-slice(%p)
}

ENTRY %main (p0: f32[3,4,16]) -> f32[] {
  %while.1 = (s32[], f32[2,16]{1,0}) while(%init), condition=%layer_cond, body=%layer_body, \
backend_config={"known_trip_count":{"n":"3"}}
  %rs-start = ((f32[8,16]{1,0}), f32[2,16]{1,0}) reduce-scatter-start(%g), channel_id=3, dimensions={0}
  %rs-done = f32[2,16]{1,0} reduce-scatter-done(%rs-start)
  %x3 = bf16[4,8,32]{2,1,0} parameter(1)
  %y3 = bf16[4,32,8]{2,1,0} parameter(2)
  %gemm = (f32[4,8,8]{2,1,0}, s8[1024]{0}) custom-call(%x3, %y3), custom_call_target="__cublas$lt$matmul", \
backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],\
"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]}}}
  ROOT %out = f32[] reduce(%x, %zero), to_apply=%add
}
"""


def test_shape_bytes_reads_arrays_and_tuples():
    assert shape_bytes("f32[8,64]{1,0}") == 8 * 64 * 4
    assert shape_bytes("(bf16[2,2]{1,0}, s32[])") == 8 + 4
    assert shape_bytes("pred[]") == 1


def test_loop_bodies_run_trip_count_times():
    counts = execution_counts(MODULE)
    assert counts["main"] == 1 and counts["layer_body"] == 3 and counts["fused_slice"] == 3


def test_collective_bytes_weight_each_collective_by_its_loop():
    totals = collective_bytes(MODULE)
    assert totals["all-gather"] == 3 * 16 * 16 * 4
    assert totals["all-reduce"] == 3 * (16 * 16 * 4 + 8 * 2)
    assert totals["reduce-scatter"] == 2 * 16 * 4  # the async pair counts once, by its result
    assert set(totals) == {"all-gather", "all-reduce", "reduce-scatter"}


def test_matmul_flops_count_dots_and_gemms_per_loop_iteration():
    dot_in_loop = 3 * 2 * (2 * 16) * 16  # 3 iterations of [2,16] x [16,16]
    gemm = 2 * (4 * 8 * 8) * 32  # batched [4,8,32] x [4,32,8], once
    assert matmul_flops(MODULE) == dot_in_loop + gemm


# A layer loop of 4 trips (TPU style: no known_trip_count, the bound is in the condition) that
# offloads one [1,8,16] slice per trip while a [8,16]x[16,16] matmul (as a TPU convolution) runs,
# then a reload after the loop with nothing scheduled under it.
OFFLOAD_MODULE = """HloModule jit_step, is_scheduled=true

%body (p: (s32[], bf16[4,8,16])) -> (s32[], bf16[4,8,16]) {
  %buffer = bf16[4,8,16]{2,1,0:T(8,128)S(5)} parameter(0)
  %slice = bf16[1,8,16]{2,1,0:T(8,128)} parameter(1)
  %i = s32[]{:T(128)} parameter(2)
  %h = bf16[8,16]{1,0} parameter(3)
  %w = bf16[16,16]{1,0} parameter(4)
  %dus-start = ((bf16[4,8,16]{2,1,0:T(8,128)S(5)}, bf16[1,8,16]{2,1,0:T(8,128)}, s32[]{:T(128)}), \
bf16[4,8,16]{2,1,0:T(8,128)S(5)}, u32[]) dynamic-update-slice-start(%buffer, %slice, %i)
  %conv = bf16[8,16]{1,0} convolution(%h, %w), dim_labels=bf_io->bf
  %dus-done = bf16[4,8,16]{2,1,0:T(8,128)S(5)} dynamic-update-slice-done(%dus-start)
  ROOT %t = (s32[], bf16[4,8,16]) tuple(%i, %dus-done)
}

%cond (p: (s32[], bf16[4,8,16])) -> pred[] {
  %bound = s32[]{:T(128)} constant(4)
  %i = s32[]{:T(128)} parameter(0)
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

ENTRY %main (p0: bf16[4,8,16]) -> bf16[4,8,16] {
  %init = (s32[], bf16[4,8,16]) parameter(0)
  %loop = (s32[], bf16[4,8,16]{2,1,0:T(8,128)S(5)}) while(%init), condition=%cond, body=%body
  %saved = bf16[4,8,16]{2,1,0:T(8,128)S(5)} get-tuple-element(%loop), index=1
  %copy-start = (bf16[4,8,16]{2,1,0}, bf16[4,8,16]{2,1,0:S(5)}, u32[]) copy-start(%saved)
  %copy-done = bf16[4,8,16]{2,1,0} copy-done(%copy-start)
  ROOT %out = bf16[4,8,16]{2,1,0} negate(%copy-done)
}
"""


def test_a_loop_without_a_known_trip_count_runs_its_condition_bound():
    assert execution_counts(OFFLOAD_MODULE)["body"] == 4
    assert matmul_flops(OFFLOAD_MODULE) == 4 * 2 * (8 * 16) * 16  # the convolution reads 16 features


def test_host_copies_carry_their_bytes_and_the_compute_scheduled_under_them():
    offload, reload = host_copies(OFFLOAD_MODULE)
    assert (offload.direction, offload.computation, offload.executions) == ("to host", "body", 4)
    assert offload.bytes == 8 * 16 * 2  # the slice that crosses, not the host buffer
    assert offload.hiding_flops == 2 * (8 * 16) * 16
    assert (reload.direction, reload.bytes, reload.executions, reload.hiding_flops) == (
        "to device",
        4 * 8 * 16 * 2,
        1,
        0,
    )
    assert overlapped_flops(OFFLOAD_MODULE, [offload, reload]) == {"body": 2 * (8 * 16) * 16, "main": 0}


# FLOPs of programs compiled for a TPU v5p and an H200 without either (compile-only devices), one
# per pattern the counter reads, each against a count by hand.


def compiled_text(target: str, fn, *shapes: tuple[tuple[int, ...], str]) -> str:
    from jax.sharding import SingleDeviceSharding

    from ferry.xla.targets import TARGETS

    device = TARGETS[target]
    sharding = SingleDeviceSharding(device.devices(4 if device.platform == "tpu" else 1)[0])
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    return jax.jit(fn).lower(*args).compile(device.compile_options({})).as_text()


@needs_libtpu
def test_a_tpu_product_batched_over_experts_counts_one_window_tap_per_output():
    """XLA:TPU writes a product batched over 8 experts as a convolution whose batch is a base-
    dilated spatial dimension (`size=8 stride=7 lhs_dilate=8`): each output reads one of the 8
    taps, so it costs 2 x 8 x 512 x 256 x 128, not 8 times as much."""
    hlo = compiled_text(
        "v5p", lambda a, b: jnp.einsum("nrd,nre->nde", a, b), ((8, 512, 256), "bfloat16"), ((8, 512, 128), "bfloat16")
    )
    assert "lhs_dilate=8" in hlo
    assert matmul_flops(hlo) == 2 * 8 * 512 * 256 * 128


# As XLA:TPU (libtpu 0.0.42) wrote a layer's projection of 8 rows x 2048 tokens in a v5e step:
# the 8 rows a spatial dimension of the kernel, the input's one element padded by 7 on each side
PADDED_BATCH_CONVOLUTION = """HloModule jit_step, is_scheduled=true

ENTRY %main (x: bf16[2048,2048,1], w: bf16[8,2048,2048]) -> bf16[8,2048,2048] {
  %x = bf16[2048,2048,1]{1,0,2:T(8,128)(2,1)} parameter(0)
  %w = bf16[8,2048,2048]{1,2,0:T(8,128)(2,1)} parameter(1)
  ROOT %conv = bf16[8,2048,2048]{1,2,0:T(8,128)(2,1)} convolution(%x, %w), window={size=8 pad=7_7 rhs_reversal=1}, \
dim_labels=fb0_0oi->0fb
}
"""


def test_a_product_batched_as_a_padded_spatial_dimension_counts_one_tap_per_output():
    """Each of the 8 outputs along the padded dimension reads one of its 8 taps (the rest land on
    padding): 2 x 8 x 2048 x 2048 x 2048, not 8 times as much (a v5e plan counted 89.6 TFLOP for a
    full_remat step of 33)."""
    assert matmul_flops(PADDED_BATCH_CONVOLUTION) == 2 * 8 * 2048 * 2048 * 2048


@needs_libtpu
def test_a_v5e_projection_into_heads_counts_its_product_once():
    """Compiled for a v5e without one: a projection into 8 heads of 64, which XLA:TPU writes with
    the heads as a padded spatial dimension of the kernel (`size=1x8 pad=0_0x7_7`), costs
    2 x 8 x 512 x 512 x 512, not 8 times as much."""
    hlo = compiled_text(
        "v5e",
        lambda x, w: jnp.einsum("bsd,dhk->bshk", x, w),
        ((8, 512, 512), "bfloat16"),
        ((512, 8, 64), "bfloat16"),
    )
    assert "pad=0_0x7_7" in hlo
    assert matmul_flops(hlo) == 2 * 8 * 512 * 512 * 8 * 64


@needs_libtpu
def test_tpu_grouped_kernels_count_their_routed_rows():
    """The forward product of Pallas megablox `gmm` and both of its backward products (`gmm` on
    the transposed weights, `tgmm`), compiled for v5p, count 2 x rows x 256 x 128 each (their
    `cost_estimate`): 304 rows (the group sizes, known at run time, may cover fewer) in 8 groups of
    [256, 128] matrices."""
    from ferry.nn.moe.megablox import megablox_matmul

    def loss(x, w, group_sizes):
        return jnp.sum(jnp.square(megablox_matmul(x, w, group_sizes).astype(jnp.float32)))

    hlo = compiled_text(
        "v5p", jax.grad(loss, (0, 1)), ((304, 256), "bfloat16"), ((8, 256, 128), "bfloat16"), ((8,), "int32")
    )
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 3
    assert matmul_flops(hlo) == 3 * 2 * 304 * 256 * 128


@needs_cuda_plugin
def test_cublas_gemms_compiled_for_an_h200_count_their_product():
    hlo = compiled_text("h200", lambda a, b: a @ b, ((512, 256), "bfloat16"), ((256, 384), "bfloat16"))
    assert "__cublas$lt$matmul" in hlo
    assert matmul_flops(hlo) == 2 * 512 * 256 * 384


# A grouped GEMM (XLA:GPU's `ragged_dot` rewrite where the BLAS library has one): 300 rows in 8
# groups times [8, 256, 128] matrices, then its weight gradient [8, 256, 128] from two row blocks.
GROUPED_GEMM_MODULE = """HloModule jit_step

ENTRY %main (x: bf16[300,256], w: bf16[8,256,128], sizes: s32[8], g: bf16[300,128]) -> bf16[8,256,128] {
  %x = bf16[300,256]{1,0} parameter(0)
  %w = bf16[8,256,128]{2,1,0} parameter(1)
  %sizes = s32[8]{0} parameter(2)
  %g = bf16[300,128]{1,0} parameter(3)
  %forward = (bf16[300,128]{1,0}, s8[1024]{0}) custom-call(%x, %w, %sizes), \
custom_call_target="__cublas$lt$groupedMatmul", backend_config={"grouped_gemm_backend_config":{}}
  ROOT %weights = (bf16[8,256,128]{2,1,0}, s8[1024]{0}) custom-call(%x, %g, %sizes), \
custom_call_target="__cublas$lt$groupedMatmul", backend_config={"grouped_gemm_backend_config":{}}
}
"""


def test_grouped_gemms_count_their_rows_from_their_shapes():
    assert matmul_flops(GROUPED_GEMM_MODULE) == 2 * (2 * 300 * 256 * 128)


WALK = """HloModule walks

%fused_index (p: s32[]) -> s32[] {
  %last = s32[] constant(3)
  %p = s32[] parameter(0)
  ROOT %sub = s32[] subtract(%last, %p)
}

%wrapped_read (buffer: bf16[4,8], i: s32[], j: s32[]) -> bf16[1,8] {
  %buffer = bf16[4,8]{1,0:S(5)} parameter(0)
  %i = s32[] parameter(1)
  %j = s32[] parameter(2)
  ROOT %slice = bf16[1,8]{1,0} dynamic-slice(%buffer, %i, %j), dynamic_slice_sizes={1,8}, \
backend_config={"dynamic_slice_config":{"loop_index":"0",DESCRIPTOR}}
}

%body (param: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %param = (s32[], bf16[4,8]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %buffer = bf16[4,8]{1,0:S(5)} get-tuple-element(%param), index=1
  %index = s32[] fusion(%i), kind=kLoop, calls=%fused_index
  %zero = s32[] constant(0)
  %read = ((bf16[4,8]{1,0:S(5)}, s32[], s32[]), bf16[1,8]{1,0}, u32[]) fusion-start(%buffer, %index, %zero), \
kind=kLoop, calls=%wrapped_read, metadata={op_name="jit(step)/transpose(jvp())/while/body/dynamic_slice"}
  %done = bf16[1,8]{1,0} fusion-done(%read)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[4,8]{1,0:S(5)}) tuple(%next, %buffer)
}

%cond (param: (s32[], bf16[4,8])) -> pred[] {
  %param = (s32[], bf16[4,8]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (b: bf16[4,8]) -> (s32[], bf16[4,8]) {
  %b = bf16[4,8]{1,0:S(5)} parameter(0)
  %start = s32[] constant(0)
  %init = (s32[], bf16[4,8]{1,0:S(5)}) tuple(%start, %b)
  ROOT %loop = (s32[], bf16[4,8]{1,0:S(5)}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"4"}}
}
""".replace("\\\n", "")


def test_host_slice_walks_evaluate_the_index_and_read_both_descriptor_formats():
    """A backward loop's read of row 3 - i of a 4 x 16-byte host buffer: the index evaluates to 3,
    2, ... (byte offset 48, stride -16); jax 0.12's `linear` descriptor and jax 0.10's top-level
    one are both read, and the #46231 descriptor (offset 0, stride +16) disagrees."""
    right_012 = '"byte_offset":"0","byte_stride":"0","linear":{"byte_offset":"48","byte_stride":"-16"}'
    right_010 = '"byte_offset":"48","byte_stride":"-16"'
    wrong = '"byte_offset":"0","byte_stride":"16"'
    for descriptor, agrees in ((right_012, True), (right_010, True), (wrong, False)):
        (walk,) = host_slice_walks(WALK.replace("DESCRIPTOR", descriptor))
        assert (walk.kind, walk.buffer_shape, walk.slice_bytes, walk.trip_count) == ("host read", "bf16[4,8]", 16, 4)
        assert (walk.index_start, walk.index_next) == (3, 2)
        assert (walk.expected_offset, walk.expected_stride) == (48, -16)
        assert walk.agrees is agrees and walk.checked
    assert byte_strides("bf16[4,8]{1,0}") == [16, 2] and byte_strides("f32[4,8]{0,1}") == [4, 16]


GROUPS_MODULE = """HloModule groups, num_partitions=8

ENTRY %main (p0: f32[4,16]) -> f32[] {
  %ag = f32[16,16]{1,0} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %ar-start = ((f32[256]{0}), f32[256]{0}) all-reduce-start(%x), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), \
to_apply=%add
  %ar-done = f32[256]{0} all-reduce-done(%ar-start)
  %rs = f32[2,16]{1,0} reduce-scatter(%y), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}
  %a2a = f32[8,16]{1,0} all-to-all(%z), channel_id=4, replica_groups={}, dimensions={0}
  %cp = f32[8,16]{1,0} collective-permute(%z), channel_id=5, source_target_pairs={{0,1},{1,2},{2,0}}
  ROOT %out = f32[] constant(0)
}
"""


def test_collectives_read_every_spelling_of_their_groups_and_their_ring_bytes():
    """Listed, iota (transposed) and mesh-axes groups, none (every partition) and permute pairs;
    the bytes a device sends by a ring over n: (n-1)/n of an all-gather's or all-to-all's result,
    n-1 of a reduce-scatter's results, 2 (n-1)/n of an all-reduce, a permute's buffer once."""
    found = {c.op: c for c in collectives(GROUPS_MODULE)}
    assert found["all-gather"].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert found["all-reduce"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))  # iota [2,4] transposed
    assert found["reduce-scatter"].groups == ((0, 1, 2, 3), (4, 5, 6, 7))  # along mesh axis b
    assert found["all-to-all"].groups == (tuple(range(8)),)
    assert found["collective-permute"].groups == ((0, 1), (1, 2), (2, 0))
    assert found["all-gather"].algorithmic_bytes == 16 * 16 * 4 * 3 / 4
    assert found["all-reduce"].algorithmic_bytes == 256 * 4 * 2 * 1 / 2  # the done's result, groups of 2
    assert found["reduce-scatter"].algorithmic_bytes == 2 * 16 * 4 * 3
    assert found["all-to-all"].algorithmic_bytes == 8 * 16 * 4 * 7 / 8
    assert found["collective-permute"].algorithmic_bytes == 8 * 16 * 4


@needs_cuda_plugin
def test_an_fsdp_step_compiled_for_h200s_gathers_and_scatters_its_weight_shards():
    """A weight sharded over 8 H200s (FSDP) and used by a batch sharded the same way: the forward
    gathers the [512, 256] f32 weight (each device sends 7/8 of it), the gradient is reduce-
    scattered back to the shards (each device sends 7 shards of 64 x 256)."""
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    from ferry.xla.targets import TARGETS

    mesh = Mesh(np.array(TARGETS["h200"].devices(8)), ("fsdp",), axis_types=(AxisType.Explicit,))
    weight = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp", None)))
    batch = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp", None)))

    def grad(w, x):
        def loss(w):
            full = jax.sharding.reshard(w, PartitionSpec(None, None))
            return jnp.sum(jnp.tanh(x @ full))

        return jax.sharding.reshard(jax.grad(loss)(w), PartitionSpec("fsdp", None))

    with jax.set_mesh(mesh):
        hlo = jax.jit(grad).lower(weight, batch).compile(TARGETS["h200"].compile_options({})).as_text()
    sent = {}
    for c in collectives(hlo):
        assert c.groups == (tuple(range(8)),) or c.group_size == 8
        sent[c.op] = sent.get(c.op, 0) + c.algorithmic_bytes * c.executions
    assert sent["all-gather"] == 512 * 256 * 4 * 7 / 8
    assert sent["reduce-scatter"] == 64 * 256 * 4 * 7
    assert set(sent) == {"all-gather", "reduce-scatter"}


def test_a_one_trip_loop_walk_is_judged_by_its_offset_alone():
    """XLA's pipelined host offloading peels a two-layer loop to one trip, whose descriptor says
    stride 0: there is no second address to get wrong."""
    from ferry.xla.hlo_slice_walks import HostSliceWalk

    walk = HostSliceWalk("body", "ds", "host read", "bf16[2,8]", 16, "", 1, 0, -1, 0, -16, 0, 0)
    assert walk.checked and walk.agrees
    assert not dataclasses.replace(walk, descriptor_offset=16).agrees
    assert not dataclasses.replace(walk, trip_count=2).agrees
