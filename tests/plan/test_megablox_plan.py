"""DeepSeek-V3's routed experts as JAX's Pallas megablox kernels (`model.moe_matmul=megablox`, what
`auto` picks on a TPU) through the planner: a kernel whose grid is dynamic (megablox's row tiles, as
many as the routing visits) is priced by the replay, and `mode=plan` for a TPU v5p plans every
offload preset of configs/offload/ and MaxText's custom placement of the DeepSeek-V3 recipe
(the layer input and the first two expert products offloaded), where its replay crashed on
`int * DynamicGridDim`."""

import io

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console

from ferry.config.overrides import compose_node
from ferry.config.root import FerryConfig, load_config
from ferry.models.registry import abstract_model
from ferry.nn.moe.megablox import megablox_matmul
from ferry.plan import replay
from ferry.plan.copy_match import DEAD
from ferry.plan.planner import for_target, layer_group_traces, plan_memory
from ferry.plan.report import run_plan
from ferry.xla.targets import TARGETS
from tests.conftest import CONFIGS, PRESETS, load_platform, load_preset, needs_libtpu

V5P = TARGETS["v5p"]
# MaxText's custom placement of the NVIDIA DeepSeek-V3 recipe, as the probe planned it
MAXTEXT_CUSTOM = (
    "offload=decoder_input_offload",
    "offload.tensors.moe_mlpwi_0=offload",
    "offload.tensors.moe_mlpwi_1=offload",
)
# deepseek_v3_tiny on the smallest v5p slice (2x2x1), one row of 32 tokens per device
ON_V5P = ("model=deepseek_v3_tiny", "model.moe_matmul=megablox", "mesh.data=4", "train.global_batch_size=4")


def compose(*overrides: str) -> FerryConfig:
    """The config `python launch/run.py OVERRIDES...` runs (a tensor a preset does not list, too)."""
    return load_config(compose_node("train", list(overrides), CONFIGS))


def pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for inner in replay._inner_jaxprs(eqn):
            yield from pallas_calls(inner)


def test_a_dynamic_grid_is_priced_as_the_kernels_cost_estimate():
    """megablox's grid holds a `DynamicGridDim` where its row tiles go (how many the routing visits
    is known when it runs): the forward, input-gradient and weight-gradient kernels are each priced
    at their cost estimate, 2 x rows x d_in x d_out, the count of the compiled program's custom call."""
    rows, d_in, d_out, experts = 2048, 64, 32, 4
    x = jax.ShapeDtypeStruct((rows, d_in), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((experts, d_in, d_out), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)

    def gradients(x, w, sizes):
        return jax.grad(lambda x, w: megablox_matmul(x, w, sizes).sum(), argnums=(0, 1))(x, w)

    jaxpr = jax.make_jaxpr(gradients)(x, w, sizes).jaxpr
    kernels = list(pallas_calls(jaxpr))
    assert len(kernels) == 3 and all(
        any(not isinstance(d, int) for d in k.params["grid_mapping"].grid) for k in kernels
    )
    product = 2.0 * rows * d_in * d_out
    assert [replay.kernel_flops(k) for k in kernels] == [product] * 3
    assert replay.kernel_flops(kernels[0], share=0.5) == product / 2
    # the ragged_dot reference beside them (what runs off a TPU) adds nothing: the replay counts
    # `dot_general`s and kernels
    assert replay.total_dot_flops(jaxpr) == 3 * product


def test_saving_an_expert_product_spares_its_kernel():
    """With the kernels counted as the compiled program counts them (one custom call each), saving
    `moe_mlpwi_0` or `moe_mlpwi_1` spares the forward kernel's rerun: neither is blamed as a tag
    whose producer runs again (the planner refused `minimal` naming both)."""
    config = compose(*ON_V5P, "train.seq_len=32")
    model_config = for_target(config.model, V5P)
    layers, groups = abstract_model(model_config), layer_group_traces(config, model_config)
    policy = load_preset("minimal").policy(layers.tagged_names())
    tagged = sorted(replay.record_names(layers, groups["moe"]))
    assert {"moe_mlpwi_0", "moe_mlpwi_1"} <= set(tagged)
    assert replay.recomputed_producers(layers, groups["moe"], policy, tagged) == []
    costs = replay.recompute_flops(layers, groups["moe"], frozenset(tagged))
    assert costs["moe_mlpwi_0"] > 0 and costs["moe_mlpwi_1"] > 0


@needs_libtpu
def test_maxtexts_custom_placement_plans_on_v5p():
    """The probe's command in small: its copies verified, asking the replay which offloaded
    tensors the backward pass reads."""
    config = compose(*ON_V5P, *MAXTEXT_CUSTOM, "train.seq_len=32")
    policy = config.offload.policy(abstract_model(config.model).tagged_names())
    plan = plan_memory(config, V5P, policy, "maxtext_custom")
    copies = plan.verification.copies
    assert {c.tensor for c in copies if c.status == "copied"} >= {"decoder_layer_input"}
    assert {c.status for c in copies} <= {"copied", DEAD} and plan.host_bytes > 0


@needs_libtpu
@pytest.mark.slow  # eight compiles of ~1 min; the two tests above cover the replay's part of each
def test_every_offload_preset_plans_on_v5p():
    """`mode=plan target=v5p` of every preset in configs/offload/ beside MaxText's custom placement,
    with its recompute check. `auto` is left out: it is no placement but a search that compiles its
    candidates (a dozen compiles more at this size), and the placements it chooses from are these."""
    presets = f"plan.presets=[{','.join(PRESETS)}]"
    config = compose(*ON_V5P, *MAXTEXT_CUSTOM, "train.seq_len=32", "mode=plan", "target=v5p", presets)
    plans, _, _ = run_plan(config, load_preset, load_platform, Console(file=io.StringIO(), width=200))
    assert sorted(p.policy for p in plans) == sorted(PRESETS) and all(p.fits for p in plans)
    checks = [p.verification.recompute for p in plans if p.verification and p.verification.recompute]
    assert checks and all(c.untagged_matmuls is not None or c.equal for c in checks)
