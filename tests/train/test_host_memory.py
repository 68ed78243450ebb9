"""Host memory planned like HBM: a state on host, the update's new stacks beside it, and the
process; a run over the machine's memory is refused in one line naming the placements that fit."""

import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from ferry.config.train import StatePlacement, TrainConfig
from ferry.train import host_memory
from ferry.train.host_memory import HostPlan, check_host_fits, host_plan
from ferry.train.memory import InsufficientMemoryError
from ferry.train.optimizer import make_optimizer
from ferry.train.state_layout import state_layout
from tests.conftest import load_model_config


def layout_of(placement: StatePlacement):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return state_layout(load_model_config("llama_tiny"), make_optimizer(TrainConfig()), mesh, placement=placement)


def test_the_plan_is_the_pinned_state_and_its_stacks_again_beside_the_process():
    layout = layout_of(StatePlacement("host", "host"))
    plan = host_plan(layout, process=1_000)
    assert plan.pinned_state == layout.host_bytes()  # one device: the whole host-resident state
    assert 0 < plan.update_outputs < plan.pinned_state  # the stacks' part, not the embedding's
    assert plan.total == plan.pinned_state + plan.update_outputs + 1_000
    halved = host_plan(layout, StatePlacement("host", "host", moments_dtype="bfloat16"), process=1_000)
    assert halved.pinned_state == plan.pinned_state * 8 // 12  # 4 + 2 x 2 bytes a parameter, not 4 + 2 x 4


def test_a_run_over_the_machines_memory_is_refused_naming_the_placements_that_fit(monkeypatch):
    layout = layout_of(StatePlacement("host", "host"))
    plan = host_plan(layout, process=0)
    only_bf16 = host_plan(layout, StatePlacement("host", "host", moments_dtype="bfloat16"), process=0).total
    monkeypatch.setattr(
        host_memory.psutil, "Process", lambda: types.SimpleNamespace(memory_info=lambda: types.SimpleNamespace(rss=0))
    )
    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=only_bf16))
    with pytest.raises(InsufficientMemoryError) as refused:
        check_host_fits(layout)
    message = str(refused.value)
    assert message.startswith(f"the run's {plan.describe()} is more than")
    assert "train.adam_moments_dtype=bfloat16" in message and "offload.params=device" in message
    assert "\n" not in message
    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=plan.total))
    assert check_host_fits(layout) == plan
    assert isinstance(plan, HostPlan)
