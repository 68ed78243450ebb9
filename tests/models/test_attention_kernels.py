"""model.attention: the splash kernel (Pallas interpret mode on the CPU) equals the reference
attention forward and backward, the offload engine keeps or recomputes its residuals under every
preset with save_all's gradients, `auto` picks per backend, and the compiled programs for a v5e
and an H200 (deviceless) hold the kernels."""

import collections
import functools
import json
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from ferry.data.segments import DocumentMask
from ferry.errors import ConfigError
from ferry.models.registry import abstract_model, build_model
from ferry.nn.kernels.choice import (
    AttentionCall,
    AttentionChoiceError,
    choose_attention,
)
from ferry.nn.kernels.cudnn import DEVICELESS_CUDNN_VERSION, CudnnAttention, cudnn_unavailable_reason
from ferry.nn.kernels.flash import ATTENTION_LSE, ATTENTION_OUT
from ferry.nn.kernels.splash import SplashAttention, block_size
from ferry.nn.kernels.xla import XlaAttention
from ferry.offload.engine import record_tags
from ferry.plan.planner import compile_config_step, compile_only_mesh
from ferry.sharding import attention_platform, lowering_platform
from ferry.train.step import LossSettings, batch_loss
from ferry.xla.hlo_flops import matmul_flops
from ferry.xla.targets import TARGETS
from tests.conftest import (
    GPU_FLAGS,
    MOE_ONLY_PRESETS,
    PRESETS,
    ROOT,
    compose_config,
    load_model_config,
    needs_cuda_plugin,
    needs_libtpu,
    preset_policy,
)

EOD = 0
# jax 0.10's cuDNN attention has other private entry points (ferry then picks xla on a GPU, saying so)
needs_cudnn_entry_points = pytest.mark.skipif(
    cudnn_unavailable_reason() is not None, reason=f"ferry's cuDNN attention: {cudnn_unavailable_reason()}"
)

# ---------------------------------------------------------------------------------------------
# The kernel against the reference, one attention call

# Tolerances, relative to the largest magnitude of the reference value: float32 inputs 1e-5 (the
# kernel sums in another order; measured <= 1.2e-6); bfloat16 inputs 2^-6 against the float32
# reference of the same bf16 values (bf16 keeps 8 significant bits, and the kernel rounds its
# probabilities and output to bf16 before the products that use them: measured <= 6.8e-3).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2.0**-6}


def relative_error(got: jax.Array, want: jax.Array) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def attention_case(batch, seq, heads, kv_heads, qk_dim, v_dim, dtype, documents):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, qk_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, qk_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, v_dim), dtype)
    d_out = jax.random.normal(keys[3], (batch, seq, heads * v_dim), jnp.float32)
    segment_ids = None
    if documents:  # three documents a row, the second row's cut elsewhere
        cuts = jnp.array([[seq // 3, 2 * seq // 3], [seq // 5, seq // 2]])[:batch]
        segment_ids = jnp.sum(jnp.arange(seq)[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)
    return (q, k, v), d_out, segment_ids


def value_and_grads(kernel, qkv, d_out, segment_ids, as_float32=False):
    scale = qkv[0].shape[-1] ** -0.5

    def objective(q, k, v):
        if as_float32:
            q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
        out = kernel(q, k, v, scale, segment_ids)
        return jnp.sum(out.astype(jnp.float32) * d_out), out

    (_, out), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True))(*qkv)
    return out, grads


CASES = {
    # name: (batch, seq, heads, kv_heads, qk_dim, v_dim, dtype, documents, kernel options)
    "gqa-f32": (2, 256, 4, 2, 128, 128, jnp.float32, False, {}),
    "gqa-bf16": (2, 256, 4, 2, 128, 128, jnp.bfloat16, False, {}),
    # DeepSeek-V3's MLA widths (q/k 192 padded to 256, v 128), MTP's seq - 1, packed documents
    "mla-mtp-documents-f32": (2, 255, 2, 2, 192, 128, jnp.float32, True, {}),
    "mla-mtp-documents-bf16": (2, 255, 2, 2, 192, 128, jnp.bfloat16, True, {}),
    "gqa-mha-kernel": (1, 256, 4, 2, 64, 64, jnp.float32, True, {"gqa": "mha"}),
    "gqa-separate-backward": (1, 256, 4, 2, 128, 128, jnp.float32, False, {"fused_backward": False}),
    "mla-unpadded-heads": (1, 128, 2, 2, 192, 128, jnp.float32, False, {"head_multiple": 64}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_splash_equals_the_reference_forward_and_backward(case):
    *shape, dtype, documents, options = CASES[case]
    qkv, d_out, segment_ids = attention_case(*shape, dtype, documents)
    kernel = SplashAttention(interpret=True, block=128, **options)
    out, grads = value_and_grads(kernel, qkv, d_out, segment_ids)
    want_out, want_grads = value_and_grads(XlaAttention(), qkv, d_out, segment_ids, as_float32=True)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert relative_error(out, want_out) <= TOLERANCE[dtype]
    for got, want in zip(grads, want_grads, strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        assert relative_error(got, want) <= TOLERANCE[dtype]


def test_splash_log_sum_exp_is_each_rows():
    """The residual the engine tags `attention_lse` is log sum exp of each query row's scaled,
    masked scores (float32), padded rows dropped."""
    (q, k, v), _, segment_ids = attention_case(2, 200, 4, 2, 128, 128, jnp.float32, True)
    scale = 128**-0.5
    out, lse = SplashAttention(interpret=True, block=128).forward(q, k, v, scale, segment_ids)
    scores = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 2, axis=2)) * scale
    causal = jnp.arange(200)[:, None] >= jnp.arange(200)[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    scores = jnp.where((causal & same)[:, None], scores, -jnp.inf)
    assert lse.shape == (2, 200, 4) and lse.dtype == jnp.float32 and out.shape == (2, 200, 4, 128)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(scores, axis=-1).transpose(0, 2, 1), rtol=1e-5, atol=1e-5)


def test_block_size_is_the_largest_that_divides_the_padded_sequence():
    assert [block_size(s) for s in (2048, 4096, 1536, 640, 255, 8191)] == [1024, 1024, 512, 128, 256, 1024]


# ---------------------------------------------------------------------------------------------
# The offload engine with the kernel: every preset's gradients equal save_all's


@functools.cache
def llama_pair(scan_layers: bool):
    """llama_tiny with splash (interpret mode) and with xla, the same weights."""
    models = {
        a: build_model(load_model_config("llama_tiny", attention=a, scan_layers=scan_layers), jax.random.key(0))
        for a in ("splash", "xla")
    }
    batch = jax.random.randint(jax.random.key(1), (2, 33), 0, models["xla"].config.vocab_size)
    return models, batch


@eqx.filter_jit
def loss_grad(model, batch, preset, documents=None):
    settings = LossSettings(preset_policy(preset, model), "float32", documents=documents)
    return eqx.filter_grad(lambda m: batch_loss(m, batch, settings)[0])(model)


def assert_same_gradients(got, want, rtol=1e-5, atol=1e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def test_splash_model_tags_its_residuals():
    """Each layer tags the kernel's output and log-sum-exp; the xla path only the output, but a
    model declares both on every backend (so a preset's placements do not change with it)."""
    models, _ = llama_pair(True)
    for attention, tagged in (("splash", True), ("xla", False)):
        model = models[attention]
        x = jnp.zeros((1, 4, model.config.dim))
        _, values = record_tags(lambda m, h: m.layers.layer(0)(h), model, x)
        names = [name for name, _ in values]
        assert ATTENTION_OUT in names and (ATTENTION_LSE in names) == tagged
        assert {ATTENTION_OUT, ATTENTION_LSE} <= model.tagged_names()
        if tagged:
            lse = dict(values)[ATTENTION_LSE]
            assert lse.shape == (1, 4, model.config.num_heads) and lse.dtype == jnp.float32


def test_splash_model_equals_the_reference_model():
    models, batch = llama_pair(True)
    assert_same_gradients(loss_grad(models["splash"], batch, "save_all"), loss_grad(models["xla"], batch, "save_all"))


@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in MOE_ONLY_PRESETS and p != "save_all"])
def test_every_preset_with_splash_has_save_alls_gradients(preset):
    models, batch = llama_pair(True)
    assert_same_gradients(loss_grad(models["splash"], batch, preset), loss_grad(models["splash"], batch, "save_all"))


def test_splash_in_an_unscanned_stack_has_save_alls_gradients():
    models, batch = llama_pair(False)
    expected = loss_grad(models["splash"], batch, "save_all")
    assert_same_gradients(loss_grad(models["splash"], batch, "minimal_offloaded"), expected)


def test_deepseek_mla_and_mtp_over_packed_documents_with_splash():
    """MLA (q/k heads padded), the MTP block (seq - 1 tokens) and segment ids through the kernel:
    the offloaded gradients equal save_all's, which equal the reference attention's. One dense
    layer, then the MTP block (an MoE layer): MLA runs the kernel in both."""
    config = load_model_config("deepseek_v3_tiny", attention="splash", num_layers=1)
    model = build_model(config, jax.random.key(0))
    reference = build_model(load_model_config("deepseek_v3_tiny", attention="xla", num_layers=1), jax.random.key(0))
    documents = jax.random.randint(jax.random.key(1), (2, 3, 6), 1, config.vocab_size).at[:, :, -1].set(EOD)
    batch = jnp.concatenate([documents.reshape(2, 18), jnp.full((2, 1), 5)], axis=1)
    mask = DocumentMask(EOD)
    expected = loss_grad(model, batch, "save_all", mask)
    assert_same_gradients(loss_grad(model, batch, "minimal_offloaded", mask), expected)
    assert_same_gradients(expected, loss_grad(reference, batch, "save_all", mask), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Choosing the kernel


def call(platform, dtype="bfloat16", segmented=False, qk_dim=128, v_dim=128):
    return AttentionCall(platform, 2, 2048, 16, 8, qk_dim, v_dim, dtype, segmented)


@needs_cudnn_entry_points
def test_auto_picks_splash_on_tpu_cudnn_on_gpu_and_xla_on_cpu():
    assert isinstance(choose_attention("auto", call("tpu")).kernel, SplashAttention)
    assert not choose_attention("auto", call("tpu")).kernel.interpret
    assert isinstance(choose_attention("auto", call("gpu")).kernel, CudnnAttention)
    assert isinstance(choose_attention("auto", call("cpu")).kernel, XlaAttention)
    assert choose_attention("splash", call("cpu")).kernel.interpret  # a test's way to run it


@needs_cudnn_entry_points
@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"segmented": True}, "no segment ids"),
        ({"dtype": "float32"}, "bfloat16 or float16"),
        ({"qk_dim": 192}, "head dim"),  # no GPU in this process: JAX allows 128 at most
    ],
)
def test_auto_on_a_gpu_falls_back_to_xla_saying_why(kwargs, reason):
    choice = choose_attention("auto", call("gpu", **kwargs))
    assert isinstance(choice.kernel, XlaAttention) and reason in choice.why
    with pytest.raises(AttentionChoiceError, match=f"model.attention=cudnn cannot run here: .*{reason}"):
        choose_attention("cudnn", call("gpu", **kwargs))


def test_kernels_that_cannot_run_here_are_refused_naming_the_fix():
    with pytest.raises(AttentionChoiceError, match="splash is a TPU kernel.*use cudnn, xla or auto"):
        choose_attention("splash", call("gpu"))
    with pytest.raises(AttentionChoiceError, match="cuDNN runs on NVIDIA GPUs only; use auto or xla"):
        choose_attention("cudnn", call("cpu"))


def test_a_bad_setting_is_a_config_error():
    with pytest.raises(ConfigError, match=r"attention is 'flash'; choose one of auto, xla, splash, cudnn"):
        compose_config("model=llama_tiny", "model.attention=flash")


def test_the_platform_comes_from_the_context_then_the_mesh():
    assert lowering_platform() == "cpu"
    with attention_platform("tpu"):
        assert lowering_platform() == "tpu"
    assert lowering_platform() == "cpu"


def test_start_up_line_names_the_kernel_and_why():
    config = compose_config("model=deepseek_v3")
    line = config.model.describe_attention(4095, "bfloat16", platform="tpu")
    assert line.startswith("attention: splash (Pallas TPU kernel") and "[model.attention=auto: TPU]" in line
    assert "seq 4095 -> 4096" in line and "q/k heads 192 -> 256 (x1.33 score FLOPs)" in line
    line = compose_config("model=llama_tiny").model.describe_attention(256, "float32")
    reference = "attention: xla (query-chunked einsum softmax, the reference)"
    assert line == f"{reference} [model.attention=auto: cpu: the reference path]"


# ---------------------------------------------------------------------------------------------
# Compiled programs, deviceless: a v5e's Mosaic kernels, an H200's cuDNN custom calls


def splash_kernels(hlo: str) -> collections.Counter:
    """The splash kernels (`fwd`, `dq`, `dkv`) the compiled TPU program calls, by their op names."""
    found = collections.Counter()
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            match = re.search(r"splash_m[hq]a_(fwd|dq|dkv)", line)
            found[match.group(1) if match else "other"] += 1
    return found


@functools.cache
def compiled_step(target_name: str, preset: str, *overrides: str):
    config = compose_config("model=llama_tiny", f"offload={preset}", "train.seq_len=256", *overrides)
    target = TARGETS[target_name]
    policy = config.offload.policy(abstract_model(config.model).tagged_names())
    mesh = compile_only_mesh(target, config.mesh)
    options = GPU_FLAGS if target.platform == "gpu" else target.compile_options({})
    return compile_config_step(config, target, policy, mesh, options).compiled


V5E = ("mesh.data=4", "train.global_batch_size=8")  # the smallest v5e slice


@needs_libtpu
@pytest.mark.parametrize(
    ("preset", "forward_kernels"),
    [("save_all", 1), ("minimal", 1), ("full_remat", 2)],
)
def test_v5e_program_reruns_the_forward_kernel_only_where_its_residuals_are_recomputed(preset, forward_kernels):
    """Per scanned layer: save_all and minimal (output and log-sum-exp kept) run the forward kernel
    once, and the backward reads the saved residuals; full_remat's replay runs it again. The
    backward is one fused kernel (dq with dkv, the default), or two where that is turned off."""
    kernels = splash_kernels(compiled_step("v5e", preset, *V5E).as_text())
    assert kernels == {"fwd": forward_kernels, "dkv": 1}


@needs_libtpu
def test_v5e_programs_kernels_are_priced_in_the_jaxpr_only():
    """Splash's causal share (`ferry.xla.expected_work`) prices its kernels where auto traces the
    layer's jaxpr. The compiled TPU program's kernels carry neither that scope nor a cost estimate
    (their lines have no op name), so the plan's compiled FLOP count leaves them out, marked or
    not: nothing is discounted twice."""
    hlo = compiled_step("v5e", "full_remat", *V5E).as_text()
    kernels = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert kernels and not any("ferry_runs_" in line or "cost_estimate" in line for line in kernels)
    assert matmul_flops(hlo) == matmul_flops(hlo, bound=True)


@needs_libtpu
def test_v5e_program_with_attention_xla_has_no_kernel():
    assert splash_kernels(compiled_step("v5e", "save_all", *V5E, "model.attention=xla").as_text()) == {}


@needs_cuda_plugin
@needs_cudnn_entry_points
def test_h200_program_calls_cudnn_attention_and_needs_fewer_temporaries():
    """auto on an H200 (compiled without one, cuDNN 9.10 assumed) is cuDNN's fused attention, its
    forward and backward; at 8 x 1024 tokens the float32 scores of the xla path are gone from the
    temporaries."""
    assert DEVICELESS_CUDNN_VERSION == 91000 and "dnn_version_info { major: 9 minor: 10" in (
        TARGETS["h200"].target_config()
    )
    overrides = ("train.seq_len=1024", "train.global_batch_size=8", "model.num_heads=8", "model.num_kv_heads=4")
    cudnn = compiled_step("h200", "full_remat", *overrides)
    xla = compiled_step("h200", "full_remat", *overrides, "model.attention=xla")
    calls = collections.Counter(re.findall(r'custom_call_target="(__cudnn\$fmha[A-Za-z]*)"', cudnn.as_text()))
    assert calls["__cudnn$fmhaSoftmax"] >= 1 and calls["__cudnn$fmhaSoftmaxBackward"] >= 1
    assert "__cudnn$fmha" not in xla.as_text()
    assert cudnn.memory_analysis().temp_size_in_bytes < 0.5 * xla.memory_analysis().temp_size_in_bytes


@needs_cudnn_entry_points
def test_cudnn_kernel_lowers_for_an_h200_without_one():
    """The cuDNN kernel's forward and backward alone, lowered for a GPU mesh of compile-only
    devices (no cuDNN library here: its version is the planner's targets')."""
    pytest.importorskip("jax_cuda12_plugin")
    mesh = Mesh(np.array(TARGETS["h200"].devices(1)), ("data",))
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 256, 4, 64), (2, 256, 2, 64), (2, 256, 2, 64))]

    def loss(q, k, v):
        return jnp.sum(CudnnAttention()(q, k, v, 0.125).astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*shapes).as_text()
    assert re.search(r"__cudnn\$fmhaSoftmax\b", text) and "__cudnn$fmhaSoftmaxBackward" in text


def test_attention_benchmark_runs_on_tiny_shapes_in_interpret_mode(tmp_path, capsys):
    """benchmarks/attention_tpu.py's own entry point, off a TPU (interpret mode, tiny shapes: its
    timings mean nothing here; its gradients must still equal the reference's)."""
    from benchmarks.attention_tpu import main

    out = tmp_path / "attention.json"
    argv = ["--batch", "1", "--seq", "256", "--heads", "2", "--kv-heads", "1", "--blocks", "128"]
    argv += ["--repeats", "1", "--dtype", "float32", "--only", "jax_dpa", "splash_b128", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"xla", "jax_dpa", "splash_b128"}
    assert report["interpret"] and not report["goal_met"] and report["best_splash"] == "splash_b128"
    for result in report["results"].values():
        assert result["ms"] > 0 and result["gradient_difference"] <= 1e-5
    assert "splash_b128" in capsys.readouterr().out


SHARDED_SPLASH = """
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh
from ferry.nn.kernels.splash import SplashAttention
from ferry.sharding import MESH_AXES

kernel = SplashAttention(interpret=True, block=128)
keys = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(keys[0], (2, 128, 4, 128))
k, v = (jax.random.normal(key, (2, 128, 2, 128)) for key in keys[1:3])
d_out = jax.random.normal(keys[3], (2, 128, 512))
ids = jnp.array([[0] * 50 + [1] * 78, [0] * 100 + [1] * 28], jnp.int32)
step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(kernel(q, k, v, 0.1, ids) * d_out), argnums=(0, 1, 2)))
reference = step(q, k, v)
sizes = {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
devices = np.array(jax.devices()).reshape([sizes[a] for a in MESH_AXES])
with jax.set_mesh(Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))):
    sharded = step(q, k, v)
errors = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(sharded[1], reference[1])]
print(json.dumps({"loss": abs(float(sharded[0] - reference[0]) / float(reference[0])), "grads": errors}))
"""


def test_splash_on_a_mesh_splitting_batch_and_heads_equals_one_device():
    """A Pallas kernel has no partitioning rule: on a mesh it runs per device under shard_map
    (batch over data, heads over tensor), segment ids and all; 4 virtual CPU devices."""
    result = subprocess.run(
        [sys.executable, "-c", SHARDED_SPLASH], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert errors["loss"] <= 1e-5 and max(errors["grads"]) <= 1e-5
