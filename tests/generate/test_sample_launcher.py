"""`launch/sample.py`: text from a trained run's checkpoint, end to end (a run `launch/run.py`
made in the test, and copies of the session's finished run), with its tokenizer, its chosen step,
greedy or seeded sampling; bad input is one line, exit status 2, before the checkpoint is read."""

import math
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ferry.data.tokenizer import ByteTokenizer, load_tokenizer
from ferry.generate import GREEDY, generate, new_tokens
from ferry.generate.prompt import new_token_budget
from ferry.run.saved_run import restored_model, run_config
from tests.conftest import ROOT, SMALL_RUN, start_launcher
from tests.launcher_cases import load_script

SCRIPT = ROOT / "launch" / "sample.py"


def sample_module():
    return load_script("sample.py")


def test_the_users_loop_train_then_sample(tmp_path):
    """`launch/run.py` trains a tiny run; `launch/sample.py` continues a prompt from it, printing
    the prompt and its continuation on stdout and the tokens/s on stderr."""
    run_dir = tmp_path / "run"
    overrides = [o for o in SMALL_RUN if not o.startswith("train.steps")]
    code, out, err = start_launcher(*overrides, "train.steps=2", f"run.dir={run_dir}", log_dir=tmp_path / "logs").wait()
    assert code == 0, err[-2000:]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(run_dir), "--prompt", "def f(", "--max-new-tokens", "10"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def f(") and len(done.stdout) > len("def f(\n")
    (line,) = [line for line in done.stderr.splitlines() if "tokens/s" in line]
    assert "after a prompt of 6 in" in line and "on cpu" in line and "checkpoint step 2 of" in line
    assert 1 <= int(line.split()[0]) <= 10


def test_greedy_text_is_the_checkpoints_greedy_continuation(trained_run):
    """The launcher's greedy text is what `ferry.generate` makes from the chosen checkpoint for the
    prompt's bytes, decoded: the latest step by default, --step's otherwise (they differ)."""
    sample = sample_module()
    config = run_config(trained_run)
    prompt = "import os\n"
    ids = jnp.asarray([list(prompt.encode())], jnp.int32)
    made = {}
    for step in (2, 4):
        expected = eqx.filter_jit(generate)(
            restored_model(config, trained_run, step), ids, jax.random.key(0), 12, GREEDY, 0
        )
        made[step] = sample.sample(trained_run, prompt, max_new_tokens=12, step=step if step == 2 else None)
        assert made[step].step == step and made[step].prompt_length == len(prompt)
        assert made[step].ids == new_tokens(expected, stop_token=0)
        assert made[step].text == ByteTokenizer().decode(np.asarray(made[step].ids))
        assert made[step].seconds > 0 and math.isfinite(made[step].tokens_per_second)
    assert made[2].ids != made[4].ids


def test_sampling_is_seeded(trained_run):
    sample = sample_module()
    draw = lambda seed: sample.sample(trained_run, "x = ", max_new_tokens=20, temperature=1.0, top_p=0.9, seed=seed).ids
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    assert sample.sample(trained_run, "x = ", max_new_tokens=20, dtype="bfloat16").ids  # decodes in bfloat16 too


def test_an_empty_prompt_starts_a_document_and_the_default_fills_the_context(trained_run):
    """'' is the end-of-document id alone; without --max-new-tokens the new tokens fill what is
    left of the context (train.seq_len=32)."""
    sample = sample_module()
    made = sample.sample(trained_run, "", temperature=1.0, seed=3)
    assert made.prompt_length == 1 and 1 <= len(made.ids) <= 31
    assert new_token_budget(20, None, 32) == 12 and new_token_budget(5, None, 1000) == 256
    assert new_token_budget(20, 12, 32) == 12


def test_the_runs_tokenizer_json_encodes_the_prompt_and_decodes_the_text(tokenizer_run):
    sample = sample_module()
    tokenizer = load_tokenizer(run_config(tokenizer_run).data.tokenizer)
    prompt = "the quick brown fox"
    made = sample.sample(tokenizer_run, prompt, max_new_tokens=8, temperature=1.0)
    (encoded,) = tokenizer.encode_documents([prompt.encode()])
    assert made.prompt_length == len(encoded) - 1 < len(prompt)  # BPE merges: fewer ids than bytes
    assert all(i < 200 for i in made.ids)  # the model's padded ids past the tokenizer's are never drawn
    assert made.text == tokenizer.decode(np.asarray(made.ids))


def bad_inputs(trained_run, tmp_path):
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text((trained_run / "config.yaml").read_text())
    lost_tokenizer = tmp_path / "lost_tokenizer"
    lost_tokenizer.mkdir()
    text = (trained_run / "config.yaml").read_text().replace("tokenizer: byte", f"tokenizer: {tmp_path}/gone.json")
    (lost_tokenizer / "config.yaml").write_text(text)
    (lost_tokenizer / "checkpoints").symlink_to(trained_run / "checkpoints")
    run = str(trained_run)
    return [
        ([str(tmp_path / "missing"), "--prompt", "a"], "is not a directory"),
        ([str(tmp_path), "--prompt", "a"], "has no config.yaml"),
        ([str(empty_run), "--prompt", "a"], "holds no checkpoint"),
        ([run, "--prompt", "a", "--step", "3"], "no checkpoint of step 3; its checkpoints are steps [2, 4]"),
        ([run, "--prompt", "x" * 40], "the prompt is 40 tokens and the run's context (train.seq_len) is 32"),
        ([run, "--prompt", "x" * 32], "no room for a new token"),
        ([run, "--prompt", "x" * 30, "--max-new-tokens", "5"], "ask for at most 2"),
        ([run, "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
        ([run, "--prompt", "a", "--temperature", "-1"], "temperature -1.0 must be a finite number >= 0"),
        ([run, "--prompt", "a", "--temperature", "nan"], "temperature nan"),
        ([run, "--prompt", "a", "--top-p", "0"], "top-p 0.0 must be in (0, 1]"),
        ([run, "--prompt", "a", "--top-p", "1.5"], "top-p 1.5"),
        ([run, "--prompt", "a", "--dtype", "int8"], "--dtype int8"),
        ([str(lost_tokenizer), "--prompt", "a"], "the run's tokenizer cannot be loaded"),
    ]


def test_bad_input_is_one_line_exit_2(trained_run, tmp_path, capsys):
    sample = sample_module()
    for argv, expected in bad_inputs(trained_run, tmp_path):
        assert sample.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and expected in captured.err, (argv, captured)
        assert captured.err.startswith("error: ")


@pytest.mark.parametrize("argv", [[], ["RUN"], ["RUN", "--prompt", "a", "--temperature", "hot"]], ids=" ".join)
def test_bad_arguments_are_argparses_refusal(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        sample_module().main(argv)
    assert exit_.value.code == 2 and "usage:" in capsys.readouterr().err
