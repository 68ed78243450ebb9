"""Chat data (`data.format=chat`, `ferry.data.chat`): conversations rendered with the tokenizer's
own template (as transformers renders it), each token's loss weight (prompt 0, reply 1) kept
through preparation and packing into the batch, the loss a mean over the counted targets, a text
batch's loss unchanged, the refusals, and a short fine-tune that lowers the replies' loss."""

import dataclasses
import io
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from rich.console import Console

from ferry.data.chat import ChatDataError, ChatEncoder, chat_template_of, parse_record
from ferry.data.config import DataConfig
from ferry.data.corpus import load_corpus
from ferry.data.loss_weights import joined_rows, split_rows
from ferry.data.tokenizer import load_tokenizer
from ferry.errors import FerryError
from ferry.head.loss import LossHead
from ferry.models.registry import build_model
from ferry.train.step import LossSettings, batch_loss, compute_copy
from tests.conftest import ROOT, compose_config, load_model_config, run_launcher

FIXTURE = ROOT / "tests" / "data" / "chat"  # written by make_fixture.py beside it
CHAT = FIXTURE / "chat.jsonl"
VOCAB = 320  # the fixture tokenizer's ids


def encoder() -> ChatEncoder:
    tokenizer = load_tokenizer(str(FIXTURE))
    return ChatEncoder(tokenizer.tokenizer, tokenizer.end_of_document, chat_template_of(str(FIXTURE)))


def records(count: int) -> list[bytes]:
    return CHAT.read_bytes().splitlines()[:count]


def test_prompt_tokens_weigh_0_and_reply_tokens_1():
    """The counted tokens decode to each reply and the template's end of turn; the rest (system,
    user, markup, the end-of-document id) to the prompt."""
    chat = encoder()
    lines = records(6)
    for line, (ids, weights) in zip(lines, chat.encode_records(lines, [str(i) for i in range(6)]), strict=True):
        messages = parse_record(line, "test")
        decode = lambda part: chat.tokenizer.decode(part.tolist(), skip_special_tokens=False)
        assert decode(ids[weights == 1]) == messages[-1]["content"] + "<|im_end|>\n"
        prompt = chat.template.render(messages[:-1], add_generation_prompt=True)
        assert decode(ids[weights == 0]) == prompt + "<|endoftext|>"
        assert ids[-1] == chat.end_of_document and weights[-1] == 0
        assert set(weights[: np.flatnonzero(weights)[0]]) == {0}  # every prompt token before the reply


def test_the_template_renders_as_transformers_renders_it():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(FIXTURE))
    template = chat_template_of(str(FIXTURE))
    for line in records(9):
        messages = parse_record(line, "test")
        for prompt in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert template.render(messages, prompt) == expected


def chat_config(tmp_path, **keys) -> DataConfig:
    defaults = dict(source="jsonl", path=str(CHAT), format="chat", tokenizer=str(FIXTURE), cache_dir=str(tmp_path))
    return DataConfig(**{**defaults, "workers": 1, **keys})


def test_weights_survive_preparation_and_packing_across_example_boundaries(tmp_path):
    """A window cut anywhere in the packed stream (most hold the end of one conversation and the
    start of the next) carries each token's own weight: the same as encoding the split's
    conversations alone and joining them."""
    config = chat_config(tmp_path)
    corpus = load_corpus(config, load_tokenizer(str(FIXTURE)), VOCAB)
    chat = encoder()
    lines = [(f"chat.jsonl:{n}", line) for n, line in enumerate(CHAT.read_bytes().splitlines(), start=1)]
    from ferry.data.prepare import is_held_out

    train = [(key, line) for key, line in lines if not is_held_out(key, config.eval_fraction)]
    examples = chat.encode_records([line for _, line in train], [key for key, _ in train])
    ids = np.concatenate([i for i, _ in examples])
    weights = np.concatenate([w for _, w in examples])
    np.testing.assert_array_equal(np.asarray(corpus.train), ids)
    np.testing.assert_array_equal(np.asarray(corpus.train_weights), weights)

    windows = corpus.windows("train", 24)
    picked = np.array([0, 1, 7, windows.num_windows - 1])
    rows = windows.rows(picked)
    assert rows.shape == (4, 2 * 25)
    tokens, counted = split_rows(jnp.asarray(rows))
    ends = 0
    for row, window in enumerate(picked):
        start = window * 24
        np.testing.assert_array_equal(tokens[row], ids[start : start + 25])
        np.testing.assert_array_equal(counted[row], weights[start + 1 : start + 25] == 1)
        ends += int(np.sum(ids[start : start + 25] == chat.end_of_document))
    assert ends >= 3  # the windows do cross conversations


def model_and_batch():
    model = build_model(load_model_config("llama_tiny", vocab_size=VOCAB), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, VOCAB)
    weights = jax.random.bernoulli(jax.random.key(2), 0.4, (2, 17))
    return model, tokens, weights


@pytest.mark.parametrize("head", ["chunked", "fused", "logits"])
def test_the_loss_is_the_mean_over_counted_targets(head):
    """A weighted batch's loss equals the cross-entropy of the whole logits averaged by hand over
    the targets whose weight is 1, for every loss head."""
    model, tokens, weights = model_and_batch()
    batch = jnp.asarray(joined_rows(np.asarray(tokens), np.asarray(weights)))
    settings = LossSettings(head=LossHead(kind=head), weighted=True)
    _, stats = eqx.filter_jit(batch_loss)(model, batch, settings)
    logits = eqx.filter_jit(lambda m, t: m(t))(model, tokens[:, :-1]).astype(jnp.float32)
    per_token = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))
    counted = np.asarray(weights[:, 1:])
    assert 0 < counted.sum() < counted.size
    assert float(stats["loss"]) == pytest.approx(per_token[counted].sum() / counted.sum(), rel=2e-5)


def test_a_text_batch_loses_as_before_weights_existed():
    """Text batches take the path they took before: their loss is, bit for bit, the model's
    training loss with no weights (what every text run computed), and the same as a weighted
    batch's whose every target counts."""
    model, tokens, _ = model_and_batch()
    settings = LossSettings()
    text = eqx.filter_jit(batch_loss)(model, tokens, settings)[1]["loss"]
    compute = compute_copy(model, jnp.dtype(settings.compute_dtype), settings.head)
    before = eqx.filter_jit(lambda m, b: m.training_loss(b, settings.policy)[1]["loss"])
    assert np.asarray(text).tobytes() == np.asarray(before(compute, tokens)).tobytes()
    all_counted = jnp.asarray(joined_rows(np.asarray(tokens), np.ones(tokens.shape, np.int32)))
    weighted = eqx.filter_jit(batch_loss)(model, all_counted, LossSettings(weighted=True))[1]["loss"]
    assert float(weighted) == pytest.approx(float(text), rel=1e-6)


def test_refusals_are_one_line(tmp_path):
    without = tmp_path / "no-template"
    without.mkdir()
    shutil.copy(FIXTURE / "tokenizer.json", without / "tokenizer.json")
    with pytest.raises(FerryError, match="needs a chat template, and the tokenizer .* has none"):
        load_corpus(chat_config(tmp_path, tokenizer=str(without)), load_tokenizer(str(without)), VOCAB)
    bad = tmp_path / "bad.jsonl"
    for line, problem in [
        ({"text": "hello"}, "holds neither messages .* nor string prompt and completion"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
        ({"messages": [{"role": "user"}]}, "message 0 is not an object with a string role and a string content"),
    ]:
        bad.write_text(json.dumps(line) + "\n")
        with pytest.raises(ChatDataError, match=f"{bad}:1.*{problem}"):
            load_corpus(chat_config(tmp_path, path=str(bad)), load_tokenizer(str(FIXTURE)), VOCAB)
    with pytest.raises(ValueError, match="data.tokenizer=byte has none"):
        DataConfig(source="jsonl", path=str(CHAT), format="chat")
    with pytest.raises(ValueError, match="data.format=chat reads conversations from JSONL records"):
        DataConfig(source="text", path=str(CHAT), format="chat", tokenizer=str(FIXTURE))


def test_a_chat_corpus_is_refused_as_text_and_a_text_corpus_as_chat(tmp_path):
    prepared = tmp_path / "prepared"
    config = chat_config(tmp_path, prepared=str(prepared))
    from ferry.data.prepare import prepare_corpus

    prepare_corpus(config, prepared, load_tokenizer(str(FIXTURE)))
    text = dataclasses.replace(config, format="text")
    with pytest.raises(FerryError, match="is a chat corpus .* set data.format=chat"):
        load_corpus(text, load_tokenizer(str(FIXTURE)), VOCAB)
    (prepared / "train" / "000000.weights").write_bytes(b"\1")  # cut short
    with pytest.raises(FerryError, match=r"000000.weights holds 1 bytes, the manifest says .* loss weight a token"):
        load_corpus(config, load_tokenizer(str(FIXTURE)), VOCAB)


CHAT_RUN = (
    f"model.vocab_size={VOCAB}",
    "data.source=jsonl",
    f"data.path={CHAT}",
    "data.format=chat",
    f"data.tokenizer={FIXTURE}",
    "data.eval_fraction=0.1",
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.steps=20",
    "train.warmup_steps=2",
    "train.log_every=10",
    "train.eval_every=20",
    "train.eval_batches=2",
    "checkpoint.every=0",
    "log.tensorboard=false",
)


def test_a_short_chat_fine_tune_lowers_the_replies_loss(tmp_path):
    """20 steps of llama_tiny on the fixture's conversations: the held-out replies' loss falls
    well below the untrained model's (about ln 320 = 5.8 nats)."""
    from ferry.run.preflight import prepare
    from ferry.run.training import train

    console = Console(file=io.StringIO(), width=200)
    config = compose_config(*CHAT_RUN, f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}")
    run_dir = train(prepare(config, console), "config: test\n", console)
    evals = [
        r["eval_loss"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "eval_loss" in r
    ]
    assert evals[0] > 5.0 and evals[-1] < evals[0] - 1.5, evals


def test_the_launcher_refuses_a_chat_run_whose_tokenizer_has_no_template(tmp_path):
    without = tmp_path / "no-template"
    without.mkdir()
    shutil.copy(FIXTURE / "tokenizer.json", without / "tokenizer.json")
    done = run_launcher(*CHAT_RUN, f"data.tokenizer={without}", f"run.dir={tmp_path / 'run'}", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    (error,) = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert "needs a chat template" in error and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
