"""The planned step is the trained step (issue 61): a run (`prepare`, then `compile_checked`)
and the planner (`compile_config_step`) build their step from one recipe,
`ferry.train.recipe.StepRecipe`, so they compile the same program, with every setting a run has:
the document mask, the non-finite guard, micro batches and the train state on host.

Before the recipe, the planner compiled `train_step_body` without the document mask or
`on_nonfinite`; on a GPU it then planned cuDNN attention for a run whose segment ids cuDNN
refuses, and which trains with another kernel."""

import dataclasses
import re

import jax
import pytest
from rich.console import Console

from ferry.models.registry import abstract_model
from ferry.nn.kernels.cudnn import cudnn_unavailable_reason
from ferry.plan.planner import compile_config_step, compile_only_mesh
from ferry.run.preflight import prepare
from ferry.run.training import compile_checked
from ferry.train.recipe import StepRecipe
from ferry.xla.targets import TARGETS
from tests.conftest import GPU_FLAGS, compose_config, needs_cuda_plugin

TINY = ("model=llama_tiny", "train.seq_len=64", "train.global_batch_size=4", "train.steps=2")
CASES = {
    "document mask": ("data.document_mask=true",),
    "skip non-finite steps": ("train.on_nonfinite=skip",),
    "micro batches": ("train.micro_batch_size=2",),
    "state on host": ("offload.optimizer=host", "offload.params=host"),
    "all of them": (
        "data.document_mask=true",
        "train.on_nonfinite=skip",
        "train.micro_batch_size=2",
        "offload.optimizer=host",
        "offload.params=host",
    ),
}
CUDNN_ATTENTION = re.compile(r'custom_call_target="__cudnn\$fmha')
SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def program(compiled) -> str:
    """A compiled program's HLO without its source locations (which name the function that asked
    for the compile, the run's or the planner's) and without op metadata."""
    blocks = compiled.as_text().split("\n\n")
    kept = [block for block in blocks if block.split("\n", 1)[0].strip() not in SOURCE_TABLES]
    return re.sub(r", metadata=\{[^}]*\}", "", "\n\n".join(kept))


def _text_corpus(directory):
    """A few documents of text, each its own file: a corpus the byte tokenizer reads in a moment."""
    directory.mkdir()
    for number in range(40):
        (directory / f"doc{number}.txt").write_text(f"document {number}: " + "the quick brown fox. " * 40)
    return directory


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_runs_step_and_its_plan_compile_the_same_program(case, tmp_path):
    corpus = _text_corpus(tmp_path / "corpus")
    config = compose_config(
        *TINY,
        "offload=minimal",
        "data.source=text",
        f"data.path={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"run.dir={tmp_path / 'run'}",
        *CASES[case],
    )
    prepared = prepare(config, Console(quiet=True))
    try:
        with jax.set_mesh(prepared.mesh):
            trained, _ = compile_checked(prepared)
    finally:
        prepared.release()
    planned = compile_config_step(config, None, prepared.policy, prepared.mesh, {})
    assert program(trained.compiled) == program(planned.step.compiled)
    if "document_mask" in " ".join(CASES[case]):
        assert prepared.recipe.settings.documents is not None


@needs_cuda_plugin
@pytest.mark.skipif(cudnn_unavailable_reason() is not None, reason=f"cuDNN attention: {cudnn_unavailable_reason()}")
def test_an_h200_plan_with_packed_documents_compiles_the_kernel_the_run_trains_with(tmp_path):
    """cuDNN refuses segment ids: with data.document_mask=true the plan for an H200 compiles
    another attention kernel, as the run does, and the recipe a run on that GPU builds compiles
    the same program. Without the mask the same plan calls cuDNN (so the check can fail)."""
    target = TARGETS["h200"]
    corpus = _text_corpus(tmp_path / "corpus")
    data = (
        "data.source=text",
        f"data.path={corpus}",
        "train.seq_len=1024",
        "model.num_heads=8",
        "model.num_kv_heads=4",
    )
    programs = {}
    for mask in ("true", "false"):
        config = compose_config(*TINY, "offload=full_remat", *data, f"data.document_mask={mask}")
        policy = config.offload.policy(abstract_model(config.model).tagged_names())
        mesh = compile_only_mesh(target, config.mesh)
        planned = program(compile_config_step(config, target, policy, mesh, GPU_FLAGS).step.compiled)
        if mask == "true":
            run_config = dataclasses.replace(config, model=config.model.for_platform("gpu"))  # as it runs there
            trained = program(StepRecipe.of(run_config, mesh).compile(options=GPU_FLAGS).compiled)
            assert trained == planned
        programs[mask] = planned
    assert not CUDNN_ATTENTION.search(programs["true"])
    assert CUDNN_ATTENTION.search(programs["false"])
