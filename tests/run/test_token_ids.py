"""Token ids outside the model's vocabulary (issue 64): refused at start-up from a sample of the
training split and all that evaluation reads, before anything is written; and, for a batch the
sample missed, refused at that batch by the device's lagged check, naming the shard and offset,
with no checkpoint of the state it reached."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from ferry.data.config import DataConfig
from ferry.data.pipeline import PackedWindows, window_batches
from ferry.data.prepare import prepare_corpus
from ferry.data.shards import MANIFEST, ShardedTokens, read_manifest
from ferry.data.token_range import SAMPLE_TOKENS, TokenIdError, check_corpus_ids
from ferry.data.tokenizer import ByteTokenizer
from ferry.run.checkpoint import checkpoint_steps
from ferry.run.id_watch import BadBatch, TokenIdWatch
from tests.conftest import SMALL_RUN
from tests.launcher_cases import load_launcher, run_case

SEQ_LEN, BATCH, SEED = 32, 4, 0  # SMALL_RUN's batch, data.seed's default
DOCUMENTS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 8) for i in range(300)]


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def hand_written(tmp_path):
    """A corpus prepared with the byte tokenizer, its shards written again as uint16 (as a
    converter from another tool's format would write them): ids up to 65,535 fit."""
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(DOCUMENTS) + "\n")
    directory = tmp_path / "prepared"
    config = DataConfig(source="text", path=str(text), separator="\\n\\n", shard_bytes=4000, workers=1)
    prepare_corpus(config, directory, ByteTokenizer())
    for shard in directory.glob("*/*.bin"):
        shard.write_bytes(np.fromfile(shard, np.uint8).astype("<u2").tobytes())
    manifest = json.loads((directory / MANIFEST).read_text())
    (directory / MANIFEST).write_text(json.dumps({**manifest, "dtype": "uint16"}))
    return directory


def poison(path, offset, value=300):
    tokens = np.fromfile(path, "<u2")
    tokens[offset] = value
    tokens.tofile(path)


def split_tokens(directory, split):
    return ShardedTokens.of(directory, read_manifest(directory), split)


def test_start_up_samples_the_training_split_and_reads_all_evaluation_reads(hand_written):
    train, held_out = split_tokens(hand_written, "train"), split_tokens(hand_written, "eval")
    check_corpus_ids(train, held_out, len(held_out), 256, "llama_tiny")
    shard = hand_written / "train" / "000003.bin"
    poison(shard, 17)
    with pytest.raises(
        TokenIdError,
        match=rf"^{shard} token 17 is id 300, outside model llama_tiny's vocabulary \(model.vocab_size=256\)",
    ):
        check_corpus_ids(train, held_out, 0, 256, "llama_tiny")
    poison(shard, 17, value=5)
    poison(shard, SAMPLE_TOKENS + 1)  # past the sample: left to the batch check
    check_corpus_ids(train, held_out, 0, 256, "llama_tiny")
    first = hand_written / "eval" / sorted(p.name for p in (hand_written / "eval").iterdir())[0]
    poison(first, 3, value=1000)
    with pytest.raises(TokenIdError, match=rf"^{first} token 3 is id 1,000"):
        check_corpus_ids(train, held_out, 4, 256, "llama_tiny")
    check_corpus_ids(train, held_out, 3, 256, "llama_tiny")  # evaluation reads only the first 3 tokens


def test_the_batch_check_reads_each_batch_a_step_late():
    watch = TokenIdWatch(256)
    watch.issued(1, jnp.full((2, 5), 255, jnp.int32))
    watch.issued(2, jnp.full((2, 5), 256, jnp.int32))
    assert watch.bad is None  # step 2's batch is not read while it may be in flight
    watch.issued(3, jnp.zeros((2, 5), jnp.int32))
    assert watch.bad == BadBatch(2, 256, 256)
    watch = TokenIdWatch(256)
    watch.issued(1, jnp.full((2, 5), -1, jnp.int32))  # a uint32 id past 2**31 reads as negative in int32
    watch.settle()
    assert watch.bad == BadBatch(1, -1, -1)


def poisoned_batch_place(directory, batch_index):
    """A token of training batch `batch_index`, in no earlier batch and past the start-up sample:
    (its shard, its offset in it, the batch's row holding it)."""
    train = split_tokens(directory, "train")
    windows = PackedWindows(train, SEQ_LEN)
    batches = window_batches(windows, BATCH, SEED)
    earlier = {int(w) for index in range(batch_index) for w in batches[index]}
    for row, window in enumerate(int(w) for w in batches[batch_index]):
        position = window * SEQ_LEN + SEQ_LEN // 2  # inside this window alone
        path, offset = train.locate(position)
        if window not in earlier and offset >= SAMPLE_TOKENS:
            return path, offset, row
    raise AssertionError("no window of that batch lies past the sample")


def test_a_batch_the_sample_missed_stops_the_run_naming_the_shard_and_offset(hand_written, tmp_path):
    path, offset, row = poisoned_batch_place(hand_written, 2)  # step 3's batch
    poison(path, offset)
    run_dir = tmp_path / "run"
    argv = [*SMALL_RUN, "data=stdlib", f"data.prepared={hand_written}", "checkpoint.every=1", f"run.dir={run_dir}"]
    result = run_case(load_launcher(), argv)
    output = result["stdout"] + result["stderr"]
    assert result["code"] == 2, output
    assert "Traceback" not in output and "not finite" not in output, output
    (error,) = [line for line in result["stdout"].splitlines() if line.startswith("error:")]
    assert (
        f"step 3's batch (batch 2 of the training stream, row {row}): {path} token {offset:,} is id 300, outside "
        "model llama_tiny's vocabulary (model.vocab_size=256)"
    ) in error, error
    assert f"the checkpoints in {run_dir / 'checkpoints'} are of earlier steps" in error
    assert checkpoint_steps(run_dir / "checkpoints") == [1, 2]  # none of step 3's state, nor after it
