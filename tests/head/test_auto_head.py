"""`train.loss_head=auto` (`ferry.head.auto`, `ferry.train.head_choice`): the head is chosen from
the three candidates' compiled programs, deviceless for a v5e and an H200 as on the CPU; a head
over the HBM left for it is refused; the facts are cached so a second choice compiles nothing; a
named head is honoured; a plan and a run build the same head; start-up says which and why."""

import jax
import jax.numpy as jnp
import pytest

from ferry.head.auto import CANDIDATES, HeadFactsCache, HeadShape, choose_head, machine_of
from ferry.head.chunked import OutputHead
from ferry.head.loss import LossHead
from ferry.plan.planner import compile_only_mesh
from ferry.run.policy_check import one_device_mesh
from ferry.sharding import MeshConfig
from ferry.train.recipe import StepRecipe
from ferry.xla.hlo_bytes import memory_traffic
from ferry.xla.targets import TARGETS
from tests.conftest import compose_config, needs_cuda_plugin, needs_libtpu

GIB = 2**30
AUTO = LossHead("auto")


def shape(rows: int, seq: int, dim: int, vocab: int) -> HeadShape:
    return HeadShape(rows, seq, dim, vocab, "bfloat16", (dim, vocab), ("embed", "vocab"), 1)


def cpu_mesh():
    return one_device_mesh(jax.devices()[0])


@needs_libtpu
def test_on_v5e_where_the_logits_fit_auto_does_not_take_the_chunked_head(tmp_path):
    """The 386M Llama shape's head at half its sequence on one v5e chip (deviceless): batch 8 x
    1,024, width 1,024, 32,768 ids. Its whole logits fit the HBM left, and the chunked head's five matmuls are the
    slowest estimate: auto takes the fused head in one chunk, by the Pallas kernel."""
    mesh = compile_only_mesh(TARGETS["v5e"], MeshConfig())
    choice = choose_head(AUTO, shape(8, 1024, 1024, 32768), mesh, 8 * GIB, HeadFactsCache(tmp_path))
    assert choice.machine.name == "v5e" and not choice.machine.nominal
    assert choice.name == "fused" and choice.head.kind == "fused", choice.why()
    assert choice.seconds("chunked") > choice.seconds("logits") > choice.seconds("fused")
    # the chunked head's matmuls: five against the others' three
    assert choice.facts["chunked"].flops == pytest.approx(5 / 3 * choice.facts["logits"].flops)
    with jax.set_mesh(mesh):  # as the run's recipe says it (`StepRecipe.head_line`)
        line = choice.head.describe(8, 1024, 32768, 1024, 2, mesh, choice.why())
    assert line.startswith("loss head: fused (train.loss_head=auto: "), line
    assert "a v5e's matmul rate and HBM bandwidth" in line and "by the Pallas kernel" in line, line
    # a budget under the one-chunk heads' temporaries leaves the chunked head
    tight = choose_head(AUTO, shape(8, 1024, 1024, 32768), mesh, GIB // 4, HeadFactsCache(tmp_path))
    assert tight.name == "chunked" and tight.compiled == 0
    assert "fused" in tight.why() and "over by" in tight.why()


@needs_cuda_plugin
def test_the_8b_head_on_an_h200_fits_its_budget(tmp_path):
    """Issue 46's head: Llama 3.1 8B (4,096 wide, 128,256 ids) at 1 x 8,192 tokens on an H200,
    deviceless, with 4.0 GiB left for it: the whole logits (7.9 GiB of temporaries with their
    gradient) are refused, and the head auto takes holds its temporaries within the 4.0 GiB."""
    mesh = compile_only_mesh(TARGETS["h200"], MeshConfig())
    choice = choose_head(AUTO, shape(1, 8192, 4096, 128256), mesh, 4 * GIB, HeadFactsCache(tmp_path))
    assert choice.machine.name == "h200"
    assert not choice.fits("logits")
    assert choice.fits(choice.name) and choice.facts[choice.name].temp_bytes <= 4 * GIB, choice.why()


def test_on_the_cpu_auto_weighs_the_same_facts_with_nominal_figures_and_caches_them(tmp_path):
    mesh = cpu_mesh()
    head_shape = shape(2, 64, 32, 1024)
    first = choose_head(AUTO, head_shape, mesh, 1 * GIB, HeadFactsCache(tmp_path))
    assert first.compiled == len(CANDIDATES) and first.machine.nominal
    assert "nominal CPU figures" in first.why()
    again = choose_head(AUTO, head_shape, mesh, 1 * GIB, HeadFactsCache(tmp_path))
    assert again.compiled == 0 and again.facts == first.facts and again.name == first.name
    # a budget only the head of the least temporaries fits; below it, that head still, said so
    least = min(CANDIDATES, key=lambda name: first.facts[name].temp_bytes)
    budget = first.facts[least].temp_bytes
    assert choose_head(AUTO, head_shape, mesh, budget, HeadFactsCache(tmp_path)).name == least
    over = choose_head(AUTO, head_shape, mesh, budget - 1, HeadFactsCache(tmp_path))
    assert over.name == least and "none of the heads fits" in over.why()


def test_a_named_head_is_honoured_and_auto_is_resolved_by_the_recipe():
    mesh = cpu_mesh()
    for kind in ("logits", "chunked", "fused"):
        recipe = StepRecipe.of(compose_config("model=llama_tiny", f"train.loss_head={kind}"), mesh)
        assert recipe.settings.head.kind == kind and recipe.head_choice is None
        assert f"(train.loss_head={kind})" in recipe.head_line()
    recipe = StepRecipe.of(compose_config("model=llama_tiny", "train.loss_head=auto"), mesh)
    assert recipe.config.train.loss_head == "auto"
    assert recipe.head_choice is not None and recipe.settings.head == recipe.head_choice.head
    assert recipe.settings.head.kind in CANDIDATES
    line = recipe.head_line()
    assert line.startswith(f"loss head: {recipe.head_choice.name} (train.loss_head=auto: "), line
    assert "est. from the compiled heads with nominal CPU figures" in line, line


@needs_libtpu
def test_a_plan_and_a_run_build_the_same_head(monkeypatch):
    """The planner's compile of a preset (`compile_config_step`) and a run's recipe on the same
    devices (a v5e chip's kind) take the same head: both resolve auto in `StepRecipe.of`."""
    from ferry.plan import planner
    from ferry.train import recipe as recipe_module

    class Built(Exception):
        pass

    seen = []

    def body(optimizer, settings, *rest):
        seen.append(settings.head)
        raise Built  # the step as built is all this asks; nothing compiles

    config = compose_config("model=llama_tiny", "offload=minimal", "train.seq_len=256")
    mesh = compile_only_mesh(TARGETS["v5e"], MeshConfig())
    run_head = StepRecipe.of(config, mesh).settings.head
    monkeypatch.setattr(recipe_module, "train_step_body", body)
    policy = config.offload.policy(frozenset())
    with pytest.raises(Built):
        planner.compile_config_step(config, TARGETS["v5e"], policy, mesh, {})
    assert seen == [run_head] and run_head.kind in CANDIDATES


def test_the_traffic_counts_loops_per_trip_and_equals_xlas_without_them():
    """XLA's `bytes accessed` counts a loop body once; `memory_traffic` once per trip. Without a
    loop (the whole logits) the two agree; the chunked head in smaller chunks moves more."""
    hidden = jax.ShapeDtypeStruct((4, 256, 64), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((64, 8192), jnp.float32)
    targets = jax.ShapeDtypeStruct((4, 256), jnp.int32)

    def program(head: LossHead):
        def loss(h, w, t):
            return head(h, OutputHead(w, ("embed", "vocab")), t)[0]

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weight, targets).compile()

    whole = program(LossHead("logits"))
    assert memory_traffic(whole.as_text()) == pytest.approx(whole.cost_analysis()["bytes accessed"], rel=1e-6)
    coarse, fine = program(LossHead("chunked", 8.0)), program(LossHead("chunked", 1.0))
    assert fine.cost_analysis()["bytes accessed"] < coarse.cost_analysis()["bytes accessed"]  # one trip counted
    assert memory_traffic(fine.as_text()) > memory_traffic(coarse.as_text())


def test_a_device_ferry_has_no_figures_for_is_refused_in_one_line():
    from types import SimpleNamespace

    import numpy as np

    from ferry.errors import ConfigError

    device = SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-40GB")
    with pytest.raises(ConfigError, match="set train.loss_head=chunked, fused or logits"):
        machine_of(SimpleNamespace(devices=np.array([device], dtype=object)))
