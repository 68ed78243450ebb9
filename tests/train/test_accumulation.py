"""Gradient accumulation: 4 micro batches of 2 give the same training as 1 batch of 8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.config.train import TrainConfig
from ferry.data.segments import DocumentMask
from ferry.models.registry import build_model
from ferry.train.compiled_step import compile_from_layout, layout_of
from ferry.train.optimizer import learning_rate_schedule, make_optimizer
from ferry.train.step import LossSettings, train_step_body
from ferry.train.train_state import init_state
from tests.conftest import load_model_config, preset_policy


def losses(model_name: str, micro_batch_size: int | None, steps: int, documents=None, eod_every=0) -> list[float]:
    """Each step's loss; `eod_every`: every how many tokens of the random batches is an end of
    document (0: none)."""
    config = load_model_config(model_name)
    train = TrainConfig(steps=steps, warmup_steps=1, global_batch_size=8, micro_batch_size=micro_batch_size, seq_len=16)
    optimizer = make_optimizer(train)
    model = build_model(config, jax.random.key(0))
    settings = LossSettings(preset_policy("minimal_offloaded", model), "float32", documents=documents)
    body = train_step_body(optimizer, settings, learning_rate_schedule(train), train.micro_steps())
    state = init_state(model, optimizer)
    step = compile_from_layout(body, layout_of(state), jax.ShapeDtypeStruct((8, 17), jnp.int32)).run
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        batch = rng.integers(1, config.vocab_size, (8, 17), dtype=np.int32)
        if eod_every:  # documents of uneven lengths: the micro batches count unequal numbers of targets
            batch[rng.random((8, 17)) < 1 / eod_every] = 0
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return out


@pytest.mark.parametrize(
    "model_name, steps",
    [
        ("llama_tiny", 10),
        # DeepSeek's accumulation (its expert-load statistics and router-bias update included) is
        # covered in CI by tests/run/test_mesh.py, which accumulates micro steps on a mesh.
        pytest.param("deepseek_v3_tiny", 3, marks=pytest.mark.slow),
    ],
)
def test_four_micro_batches_of_two_equal_one_batch_of_eight(model_name, steps):
    np.testing.assert_allclose(losses(model_name, 2, steps), losses(model_name, None, steps), rtol=1e-5)


def test_micro_batches_counting_unequal_targets_give_the_whole_batchs_mean():
    """With no loss across documents each micro batch counts a different number of targets: it
    weighs by its share of them, so the loss and the training equal one batch of eight's."""
    documents = DocumentMask(end_of_document=0, loss_across_documents=False)
    micro = losses("llama_tiny", 2, 5, documents, eod_every=3)
    whole = losses("llama_tiny", None, 5, documents, eod_every=3)
    np.testing.assert_allclose(micro, whole, rtol=1e-5)


def test_micro_batch_x_data_parallel_must_divide_the_global_batch():
    message = r"global_batch_size 24 is not a multiple of train.micro_batch_size 4 x data-parallel size 4 \(data x"
    with pytest.raises(ValueError, match=message):
        TrainConfig(global_batch_size=24, micro_batch_size=4).check_batch(4, "data=2 x fsdp=2 x tensor=1 x expert=1")
    with pytest.raises(ValueError, match="global_batch_size 6 is not a multiple of the data-parallel size 4"):
        TrainConfig(global_batch_size=6).check_batch(4, "data=4")
    train = TrainConfig(global_batch_size=1024, micro_batch_size=8)
    assert train.micro_steps(128) == 1  # micro 8 on 128 devices: no accumulation
    assert train.micro_steps(8) == 16
    assert train.micro_steps() == 128 and train.rows_per_micro_step(8) == 64
