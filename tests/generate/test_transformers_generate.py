"""Greedy generation equals `transformers`' own: a tiny random model of each family exported with
`save_pretrained`, loaded by `AutoModelForCausalLM` (eager attention, float32), and its
`generate(do_sample=False)` continuing the same prompts, with and without a stop token."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity tests need torch: bash setup.sh hf")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers")

from ferry.generate import GREEDY, generate, new_tokens  # noqa: E402
from ferry.hf import save_pretrained  # noqa: E402
from tests.generate.test_decode import randomised  # noqa: E402

NEW_TOKENS = 12


def hf_greedy(directory, prompt: np.ndarray, stop: int | None) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt, dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=stop if stop is not None else 0,
        )
    return out[:, prompt.shape[1] :].numpy()


@pytest.mark.parametrize("name", ["llama_tiny", "qwen3_tiny", "deepseek_v3_tiny"])
def test_greedy_generation_equals_transformers_generate(name, tmp_path):
    model = randomised(name, seed=5, **({"mtp_depth": 0} if name.startswith("deepseek") else {}))
    save_pretrained(model, tmp_path / "hf")
    prompt = np.random.default_rng(6).integers(0, 256, (2, 6)).astype(np.int32)
    run = eqx.filter_jit(generate)

    ours = run(model, jnp.asarray(prompt), jax.random.key(0), NEW_TOKENS, GREEDY, None)
    theirs = hf_greedy(tmp_path / "hf", prompt, None)
    np.testing.assert_array_equal(np.asarray(ours.tokens), theirs)
    assert len(set(theirs.reshape(-1).tolist())) > 3  # continuations, not one token repeated

    stop = int(theirs[0, 4])  # the first row stops at its fifth token (or before, where it comes earlier)
    ours = run(model, jnp.asarray(prompt), jax.random.key(0), NEW_TOKENS, GREEDY, stop)
    theirs = hf_greedy(tmp_path / "hf", prompt, stop)
    for row in range(2):
        expected = theirs[row].tolist()
        expected = expected[: expected.index(stop)] if stop in expected else expected
        assert new_tokens(ours, row, stop_token=stop) == expected
