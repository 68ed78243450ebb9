"""Bad input through the launcher: every one is refused with exit status 2 and one line naming the
key (or file) at fault, no traceback, and nothing changed in the run directory it pointed at.

The table points every command at a real, finished run (`finished_run` in conftest: its
checkpoints, metrics and lock file), so a refusal that touched it would show. The commands share one launcher
process (see `tests/launcher_cases.py`); those that need a backend of their own run as separate processes.
"""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ferry.run.lock import acquire
from tests.conftest import ROOT, SMALL_RUN, run_launcher

COMMON = SMALL_RUN

# (overrides, what the one-line message must name)
BAD_INPUTS = [
    (["train.steps=7.5"], "train.steps"),
    (["train.steps=abc"], "train.steps"),
    (["train.steps=0"], "train.steps"),
    (["train.steps=-5"], "train.steps"),
    (["train.steps=true"], "train.steps"),
    (["train.learning_rate=abc"], "train.learning_rate"),
    (["train.learning_rate=-1"], "train.learning_rate"),
    (["train.learning_rate=nan"], "train.learning_rate"),
    (["train.learning_rate=inf"], "train.learning_rate"),
    (["train.global_batch_size=0"], "train.global_batch_size"),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], "choose a global batch that is a multiple of 4"),
    (["train.seq_len=0"], "train.seq_len"),
    (["train.seq_len=1.5"], "train.seq_len"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["train.warmup_steps=-1"], "train.warmup_steps"),
    (["train.on_nonfinite=ignore"], "train.on_nonfinite"),
    (["train.compute_dtype=float16"], "train.compute_dtype"),
    (["train.adam_b1=1.5"], "train.adam_b1"),
    (["train.weight_decay=-0.1"], "train.weight_decay"),
    (["train.eval_batches=-1"], "train.eval_batches"),
    (["train.log_every=0"], "train.log_every"),
    (["train.z_loss_weight=abc"], "train.z_loss_weight"),
    (["train.grad_clip_norm=-1"], "train.grad_clip_norm"),
    (["train.stepz=5"], "train.stepz"),
    (["model=nope"], "model/nope"),
    (["model.num_layers=0"], "model.num_layers"),
    (["model.vocab_size=0"], "model.vocab_size"),
    (["model.dim=abc"], "model.dim"),
    (["model.num_heads=3"], "num_heads"),
    (["data=stdlib", "model.vocab_size=100"], "vocab_size"),
    (["offload=nope"], "offload/nope"),
    (["offload.tensors.mlpwoo=offload"], "mlpwoo"),
    (["offload.tensors.mlpwo=host"], "mlpwo"),
    (["mode=compile", "target=v5e", "offload=auto"], "offload=auto"),
    (["offload=auto", "offload.auto.steps=0"], "offload.auto.steps"),
    (["offload=auto", "offload.auto.measure=maybe"], "offload.auto.measure"),
    (["checkpoint.every=-1"], "checkpoint.every"),
    (["checkpoint.keep=0"], "checkpoint.keep"),
    (["checkpoint.keep_every=0"], "checkpoint.keep_every"),
    (["profile.start_step=0"], "profile.start_step"),
    (["mesh.fsdp=0"], "mesh.fsdp"),
    (["mesh.fsdp=2"], "mesh"),
    (["mode=banana"], "mode"),
    (["mode=plan"], "target"),
    (["mode=plan", "target=h100x"], "target"),
    (["mode=compile"], "mode=compile compiles a run's step for the TPU it will train on: add target="),
    (["mode=compile", "target=h200"], "mode=compile target=h200: it compiles for TPUs"),
    (["mode=compile", "target=v5e", "platform=cpu"], "add platform=tpu"),
    (["mode=compile", "target=v5e", "platform=tpu", "plan.presets=[save_all]"], "plan.presets is read by mode=plan"),
    (["platform.cpu_devices=0"], "platform.cpu_devices"),
    (["platform.cpu_devices=100000"], "platform.cpu_devices"),
    (["platform.scheduler_costs=measured"], "platform.scheduler_costs"),
    (["platform.scheduler_costs=ferry"], "platform.scheduler_costs=xla"),  # only XLA:GPU's scheduler takes them
    (["data.source=banana"], "data.source"),
    (["data.source=text", "data.path=/nonexistent/corpus", "train.steps=6"], "data.path"),  # after the claim
    (["data.eval_fraction=2"], "data.eval_fraction"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer"),
    (["data.eos_token=</s>"], "data.eos_token=</s> names a token of a Hugging Face tokenizer, but data.tokenizer=byte"),
    (["init.from_hf=/nonexistent/checkpoint"], "init.from_hf"),
    (["distributed.num_processes=2"], "distributed"),
    (["log.wandb=maybe"], "log.wandb"),
    (["run.resume=maybe"], "run.resume"),
    (["run.resume=false"], "run.resume"),
    (["model.dim=32"], "dim: 64 -> 32"),
    (["plan.capacity_gib=-1"], "plan.capacity_gib"),
    (["--cfg", "hydra"], "--cfg"),  # `--cfg job` prints the config (tests/run/test_launch.py)
    # Hydra's override grammar: any value, deletions, group values that are not one preset's name
    (["~model"], "~model: deleting model"),
    (["~train.steps"], "~train.steps"),
    (["model=5"], "model=5: model names a preset"),
    (["model=null"], "model=null: model names a preset, not null"),
    (["=5"], "needs a key"),
    (["model=../offload/save_all"], "no configs/model/../offload/save_all.yaml"),
    (["offload=[save_all,full_remat]"], "offload takes one preset"),
    (["offload=_base"], "offload=_base: a configs/offload/ file whose name starts with _ holds keys the presets share"),
    (["train=5"], "train=5: train holds keys"),
    (["model.rope_scaling=5"], "model.rope_scaling=5"),
    (["model=deepseek_v3_tiny", "model.yarn=null"], "model.yarn=null"),
    # values that can only diverge, named with the right words
    (["model.norm_eps=-1"], "model.norm_eps=-1.0 must be greater than 0"),
    (["model.norm_eps=0"], "model.norm_eps=0.0 must be greater than 0"),
    (["model.rope_theta=0"], "model.rope_theta=0.0 must be greater than 0"),
    (["model.rope_scaling.factor=0"], "model.rope_scaling.factor=0.0 must be greater than 0"),
    (["model.rope_scaling.high_freq_factor=1"], "model.rope_scaling.high_freq_factor"),
    (["model=qwen3_tiny", "model.norm_eps=0"], "model.norm_eps"),
    (["model=deepseek_v3_tiny", "model.yarn.factor=0"], "model.yarn.factor"),
    (["model=deepseek_v3_tiny", "model.yarn.beta_slow=-1"], "model.yarn.beta_slow"),
    (["model=deepseek_v3_tiny", "model.yarn.mscale_all_dim=-20"], "model.yarn.mscale_all_dim"),
    (["model=deepseek_v3_tiny", "model.mtp_loss_weight=-0.3"], "model.mtp_loss_weight"),
    (["model=deepseek_v3_tiny", "model.routed_scaling=0"], "model.routed_scaling"),
    (["train.adam_eps=0"], "train.adam_eps=0.0 must be greater than 0"),
    (["train.grad_clip_norm=0"], "train.grad_clip_norm=0.0 must be greater than 0"),
    (["train.learning_rate=1", "train.weight_decay=1"], "train.weight_decay"),
    (["train.seed=-1"], "train.seed=-1"),
    (["data.seed=4294967296"], "data.seed=4294967296"),
    (["model.rope_scaling.factor=nan"], "model.rope_scaling.factor=nan is not a finite number"),
    (["model.head_dim=15"], "model.head_dim=15 must be even"),
    # silent acceptances, now refused
    (["run.root=", "run.dir=null"], "run.root is empty"),
    (["data.path="], "data.path is empty"),
    (["data.pattern="], "data.pattern is empty"),
    (["plan.presets=[save_all]"], "plan.presets is read by mode=plan only"),
    (["offload.default=bogus"], "offload.default=bogus: a placement is one of"),
    (["offload.peel=9"], "offload.peel=9 peels more layers than a stack has"),
    (["offload=save_all", "offload.peel=1"], "offload.peel=1 would do nothing"),
    (["offload.optimizer=host", "offload.stream_mib=0"], "offload.stream_mib=0: it is the HBM"),
    (["target=h100"], "target=h100 is the hardware mode=plan compiles for"),
    (["profile.start_step=5"], "profile.start_step=5 is after the last step"),
    # an XLA flag XLA does not know, refused before the backend would abort the process on it
    (["platform.xla_flags.xla_bogus_ferry_flag=1"], "XLA does not know the flag(s) xla_bogus_ferry_flag"),
    # absolute patterns, addresses without a port
    (["data.pattern=/tmp/*.txt"], "data.pattern=/tmp/*.txt is a path"),
    (
        ["distributed.coordinator_address=localhost", "distributed.num_processes=1", "distributed.process_id=0"],
        "distributed.coordinator_address=localhost has no port",
    ),
    # a user's value printed as it is (rich read `:abc:` as an emoji code), no traceback on an empty list
    (
        ["distributed.coordinator_address=localhost:abc", "distributed.num_processes=1", "distributed.process_id=0"],
        "distributed.coordinator_address=localhost:abc: the port 'abc'",
    ),
    (["mode=plan", "target=v5e", "plan.presets=[]"], "plan.presets=[] names no preset"),
    # a setting that would do nothing, or run elsewhere than asked
    (["platform.env.JAX_PLATFORMS=tpu"], "platform.env.JAX_PLATFORMS=tpu asks JAX for another backend"),
]


def tree_digest(path):
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


def run_cases(cases: list[list[str]], timeout: float = 600, own_compilation_cache: bool = False) -> list[dict]:
    """Each argument list through the launcher, all in one process (tests/launcher_cases.py).
    `own_compilation_cache`: without the test session's exported JAX compilation cache, which would
    win over `platform.compilation_cache`."""
    drop = {"JAX_COMPILATION_CACHE_DIR"} if own_compilation_cache else set()
    result = subprocess.run(
        [sys.executable, "-m", "tests.launcher_cases"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k not in drop},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def run_dir_cases(root):
    """Commands whose run.dir is the problem, or is new: (name, overrides), in `root`."""
    (root / "a_file").write_text("precious\n")
    cases = {
        "held": [f"run.dir={root / 'held'}"],
        "a file": [f"run.dir={root / 'a_file'}"],
        "below a file": [f"run.dir={root / 'a_file' / 'below'}"],
        "new, then no data": ["data.source=text", "data.path=/nonexistent/corpus", f"run.dir={root / 'new'}"],
    }
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("some text\n" * 50)
    (root / "garbage.jsonl").write_bytes(bytes(range(256)) * 8)
    text = ["data.source=text", f"data.path={root / 'corpus'}"]
    cases |= {
        "cache_dir a file": [*text, f"data.cache_dir={root / 'a_file'}", f"run.dir={root / 'cache'}"],
        "prepared a file": ["data=stdlib", f"data.prepared={root / 'a_file'}", f"run.dir={root / 'prepared'}"],
        "from_hf a file": [f"init.from_hf={root / 'a_file'}", f"run.dir={root / 'from_hf'}"],
        "garbage jsonl": ["data.source=jsonl", f"data.path={root / 'garbage.jsonl'}", f"run.dir={root / 'jsonl'}"],
        "binary text": ["data.source=text", f"data.path={root / 'garbage.jsonl'}", f"run.dir={root / 'binary'}"],
    }
    cases |= prepared_cases(root)
    cases["name too long"] = [f"run.dir={root / ('a' * 300) / 'run'}"]
    if Path("/proc/self").is_dir():
        cases["under /proc"] = [f"run.dir=/proc/ferry-{os.getpid()}/run"]
    if os.geteuid() != 0:  # root writes through permission bits
        (root / "unwritable").mkdir(mode=0o500)
        cases["unwritable"] = [f"run.dir={root / 'unwritable' / 'run'}"]
    return cases


def prepared_cases(root):
    """Commands training on a prepared corpus damaged one way each: (name, overrides)."""
    from ferry.data.config import DataConfig
    from ferry.data.prepare import prepare_corpus
    from ferry.data.tokenizer import ByteTokenizer

    text = root / "prepared_source.txt"
    text.write_text("\n\n".join(f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 8) for i in range(200)))
    whole = root / "whole"
    config = DataConfig(source="text", path=str(text), separator="\\n\\n", shard_bytes=4000, workers=1)
    prepare_corpus(config, whole, ByteTokenizer())

    def damaged(name, damage):
        directory = root / name
        shutil.copytree(whole, directory)
        damage(directory)
        return ["data=stdlib", f"data.prepared={directory}", f"run.dir={root / (name + ' run')}"]

    def manifest_with(**keys):
        return lambda d: (d / "manifest.json").write_text(
            json.dumps({**json.loads((d / "manifest.json").read_text()), **keys})
        )

    def shard_sized(change):
        return lambda d: (d / "train" / "000001.bin").write_bytes(change((d / "train" / "000001.bin").read_bytes()))

    def wide_ids(directory):  # shards written again as uint16 (as a converter would), one id past 255
        for shard in directory.glob("*/*.bin"):
            shard.write_bytes(np.fromfile(shard, np.uint8).astype("<u2").tobytes())
        manifest_with(dtype="uint16")(directory)
        ids = np.fromfile(directory / "train" / "000001.bin", "<u2")
        ids[40] = 300
        ids.tofile(directory / "train" / "000001.bin")

    return {
        "ids outside the vocabulary": damaged("ids", wide_ids),
        "dtype int8": damaged("int8", manifest_with(dtype="int8")),
        "dtype banana": damaged("banana", manifest_with(dtype="banana")),
        "shard cut short": damaged("cut", shard_sized(lambda data: data[:-7])),
        "shard grown": damaged("grown", shard_sized(lambda data: data + b"more")),
    }


@pytest.fixture(scope="module")
def refused(finished_run, tmp_path_factory):
    """The table's commands against the finished run and the run-directory commands, in one
    launcher process; the finished run's digest before them."""
    before = tree_digest(finished_run)
    root = tmp_path_factory.mktemp("run_dirs")
    by_dir = run_dir_cases(root)
    cases = [[*COMMON, *overrides, f"run.dir={finished_run}"] for overrides, _ in BAD_INPUTS]
    cases += [[*COMMON, *overrides] for overrides in by_dir.values()]
    held = acquire(root / "held")  # this process is the first run there
    try:
        results = run_cases(cases)
    finally:
        held.release()
    table = dict(zip((tuple(o) for o, _ in BAD_INPUTS), results[: len(BAD_INPUTS)], strict=True))
    return before, table, dict(zip(by_dir, results[len(BAD_INPUTS) :], strict=True)), root


def test_the_table_is_large():
    assert len(BAD_INPUTS) >= 80


def assert_refused(result, key):
    output = result["stdout"] + result["stderr"]
    assert result["code"] == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in result["stdout"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert key in errors[0], errors[0]


@pytest.mark.parametrize("overrides, key", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_is_refused_in_one_line_naming_the_key(refused, overrides, key):
    assert_refused(refused[1][tuple(overrides)], key)


def test_refusals_leave_the_run_directory_as_it_was(refused, finished_run):
    assert tree_digest(finished_run) == refused[0]


def test_a_run_dir_that_is_a_file_or_below_one_is_refused(refused):
    _, _, by_dir, root = refused
    assert_refused(by_dir["a file"], "is a file, not a directory")
    assert_refused(by_dir["below a file"], "a part of its path is a file")
    assert (root / "a_file").read_text() == "precious\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_an_unwritable_run_dir_is_refused(refused):
    assert_refused(refused[2]["unwritable"], "permission denied")


def test_a_second_launch_into_a_run_dir_in_use_is_refused_naming_the_holder(refused):
    _, _, by_dir, root = refused
    assert_refused(by_dir["held"], f"in use by another ferry run (pid {os.getpid()} on host {socket.gethostname()}")
    assert not (root / "held").exists()  # the holder made it and never started: it is gone with the lock


def test_a_refusal_after_claiming_a_new_directory_takes_it_away(refused):
    """The data is missing, found once the directory was claimed: the directory made for the
    run and its lock file are gone again."""
    _, _, by_dir, root = refused
    assert_refused(by_dir["new, then no data"], "data.path")
    assert not (root / "new").exists()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_a_platform_this_machine_lacks_is_refused(tmp_path, platform):
    """Its own process: starting a GPU or TPU backend is a one-way door."""
    result = run_launcher(*COMMON, f"platform={platform}", f"run.dir={tmp_path / 'run'}", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert f"platform={platform}" in error and "platform=cpu" in error
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


# --- the kinds of paths, the data's files -----------------------------------------------------


def test_a_file_where_a_directory_belongs_is_refused_naming_the_key(refused):
    _, _, by_dir, root = refused
    assert_refused(by_dir["cache_dir a file"], f"data.cache_dir={root / 'a_file'} is a file, not a directory")
    assert_refused(by_dir["prepared a file"], f"data.prepared={root / 'a_file'} is a file, not a directory")
    assert_refused(by_dir["from_hf a file"], f"init.from_hf={root / 'a_file'} is a file, not a directory")
    for name in ("cache", "prepared", "from_hf"):
        assert not (root / name).exists()
    assert (root / "a_file").read_text() == "precious\n"


def test_a_run_dir_whose_name_is_too_long_is_refused(refused):
    """`Path.exists` raises for a name over the file system's limit (255 bytes on most)."""
    assert_refused(refused[2]["name too long"], "is longer than the file system allows")
    assert "300 bytes" in refused[2]["name too long"]["stdout"]


def test_a_run_dir_on_a_kernel_filesystem_is_refused(refused):
    if "under /proc" not in refused[2]:
        pytest.skip("no /proc here")
    assert_refused(refused[2]["under /proc"], "run.dir=/proc/")
    assert "takes no new directories" in refused[2]["under /proc"]["stdout"]


def test_a_jsonl_file_of_garbage_is_refused_naming_the_file(refused):
    _, _, by_dir, root = refused
    assert_refused(by_dir["garbage jsonl"], f"data.source=jsonl: {root / 'garbage.jsonl'} is not text: NUL bytes")


def test_a_binary_file_as_a_text_source_is_refused_naming_it(refused):
    _, _, by_dir, root = refused
    assert_refused(by_dir["binary text"], f"data.source=text: {root / 'garbage.jsonl'} is not text: NUL bytes")
    assert not (root / "binary").exists()


def test_a_prepared_corpus_that_its_manifest_does_not_describe_is_refused(refused):
    """A manifest's dtype edited (to a signed type, to no type) or a shard cut short or grown:
    refused before the run directory is made."""
    _, _, by_dir, root = refused
    manifest = '"dtype": "{}"'
    assert_refused(by_dir["dtype int8"], f"{root / 'int8' / 'manifest.json'}: {manifest.format('int8')} is signed")
    assert_refused(by_dir["dtype banana"], f"{root / 'banana' / 'manifest.json'}: {manifest.format('banana')} is not")
    for case, name, how in (("shard cut short", "cut", "cut short"), ("shard grown", "grown", "grown")):
        assert_refused(by_dir[case], f"{root / name / 'train' / '000001.bin'} holds")
        assert f"({how}): the shards do not match" in by_dir[case]["stdout"]
    for name in ("int8", "banana", "cut", "grown"):
        assert not (root / f"{name} run").exists()


def test_a_prepared_corpus_with_ids_outside_the_vocabulary_is_refused_naming_the_shard(refused):
    _, _, by_dir, root = refused
    shard = root / "ids" / "train" / "000001.bin"
    assert_refused(by_dir["ids outside the vocabulary"], f"{shard} token 40 is id 300, outside model llama_tiny's")
    assert not (root / "ids run").exists()


def test_a_parquet_file_of_garbage_is_refused_naming_it(tmp_path):
    pytest.importorskip("pyarrow")
    from ferry.data.sources import DataSourceError, parquet_documents

    garbage = tmp_path / "a.parquet"
    garbage.write_bytes(b"PAR1" + bytes(range(256)) * 4)
    with pytest.raises(DataSourceError, match=f"{garbage} is not a Parquet file"):
        list(parquet_documents([garbage], tmp_path, "text"))


def test_directory_checks(tmp_path):
    from ferry.config.paths import check_directory_to_write, check_existing_directory, check_existing_file
    from ferry.errors import ConfigError

    (tmp_path / "file").write_text("x")
    check_directory_to_write("k", str(tmp_path / "new" / "deeper"))  # makes nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    with pytest.raises(ConfigError, match="k=.* cannot be made: a part of its path is a file"):
        check_directory_to_write("k", str(tmp_path / "file" / "below"))
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_existing_directory("k", str(tmp_path / "file"), "a directory")
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        check_existing_file("k", str(tmp_path), "a file")
    check_existing_directory("k", str(tmp_path / "missing"), "a directory")  # absence: the reader's to explain


# --- the override grammar, Unicode, XLA's flags ----------------------------------------------


def test_unicode_values_and_reserved_characters_need_no_quotes(tmp_path):
    from ferry.config.overrides import compose_node, quote_non_ascii
    from ferry.errors import ConfigError

    run_dir = str(tmp_path / "ünïcødé" / "rün")
    assert quote_non_ascii(f"run.dir={run_dir}") == f"run.dir='{run_dir}'"
    assert quote_non_ascii("train.steps=5") == "train.steps=5"
    node = compose_node("train", [f"run.dir={run_dir}", "data.eos_token=<|ënd|>"], ROOT / "configs")
    assert node["run"]["dir"] == run_dir and node["data"]["eos_token"] == "<|ënd|>"
    node = compose_node("train", ["data.eos_token=<|endoftext|>", "run.dir=/tmp/a run"], ROOT / "configs")
    assert node["data"]["eos_token"] == "<|endoftext|>" and node["run"]["dir"] == "/tmp/a run"
    with pytest.raises(ConfigError, match=r"plan.presets=\[a,b: not an override Hydra can read .*goes in quotes"):
        compose_node("train", ["plan.presets=[a,b"], ROOT / "configs")


def test_open_mappings_take_new_entries_and_deletions():
    from ferry.config.overrides import compose_node

    node = compose_node(
        "train",
        ["platform.xla_flags.xla_cpu_enable_fast_math=false", "offload=minimal_offloaded"]
        + ["~offload.tensors.decoder_layer_input"],
        ROOT / "configs",
    )
    assert node["platform"]["xla_flags"] == {"xla_cpu_enable_fast_math": False}
    assert "decoder_layer_input" not in node["offload"]["tensors"]


def test_xla_flags_are_looked_up_in_xla_and_unknown_ones_confirmed_by_xla(tmp_path):
    from ferry.xla.flags import XlaFlagError, check_xla_flags, flag_libraries, flag_names, unmentioned

    assert flag_names("--a=1  --b --c=x=y") == ["a", "b", "c"]
    libraries = flag_libraries()
    assert libraries, "jaxlib's library holding XLA's flags was not found"
    assert unmentioned(
        ["xla_force_host_platform_device_count", "xla_dump_to", "xla_no_such_flag_ferry"], libraries
    ) == ["xla_no_such_flag_ferry"]

    def never(flags):
        raise AssertionError("a flag found in the library needs no child process")

    check_xla_flags("XLA_FLAGS", "--xla_dump_to=/tmp/x", libraries, confirm=never)
    check_xla_flags("LIBTPU_INIT_ARGS", "--anything", libraries, confirm=never)  # libtpu's own flags
    check_xla_flags("XLA_FLAGS", "--xla_missed_by_search=1", libraries, confirm=lambda flags: None)  # XLA takes it
    with pytest.raises(XlaFlagError, match="XLA does not know the flag.s. xla_bogus_ferry .XLA_FLAGS: Unknown flag"):
        check_xla_flags(
            "XLA_FLAGS", "--xla_bogus_ferry=1", libraries, confirm=lambda flags: "Unknown flag in XLA_FLAGS"
        )


def test_xla_itself_refuses_an_unknown_flag_in_a_child_process():
    from ferry.xla.flags import xla_refusal

    reason = xla_refusal("--xla_bogus_ferry_flag=1")
    assert reason is not None and "xla_bogus_ferry_flag" in reason, reason
    assert xla_refusal("--xla_force_host_platform_device_count=2") is None


def test_prepare_data_takes_its_own_keys_only(tmp_path, capsys):
    from tests.launcher_cases import load_script

    prepare_data = load_script("prepare_data.py")
    cases = {
        "train.steps=5": "train.steps is not a key of this command; it takes data keys only; training keys go to",
        "data=5": "data=5: data names a preset",
        f"data.prepared={tmp_path}/f": "",  # made below: a file
    }
    (tmp_path / "f").write_text("x")
    cases[f"data.prepared={tmp_path}/f"] = "is a file, not a directory"
    for argument, message in cases.items():
        assert prepare_data.main(["data.source=text", f"data.path={tmp_path}", argument]) == 2
        out = capsys.readouterr().out
        assert len(out.strip().splitlines()) == 1 and message in out, out


def test_a_refusal_keeps_its_brackets(capsys):
    from ferry.errors import ConfigError
    from tests.launcher_cases import load_launcher

    assert load_launcher().refuse(ConfigError('pip install -e ".[parquet]"')) == 2
    assert 'pip install -e ".[parquet]"' in capsys.readouterr().out


def test_ctrl_c_during_the_imports_is_one_line_and_130(tmp_path):
    """SIGINT while `launch/run.py` is still importing JAX (well before any backend)."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "run.py"), *COMMON, f"run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.6)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stdout + stderr
    assert "Traceback" not in stderr and len(stdout.strip().splitlines()) == 1, stdout + stderr
    assert "interrupted" in stdout and not (tmp_path / "run").exists()


# --- the likely causes of a non-finite loss, non-finite weights, a cycling evaluation ----------


def test_the_nonfinite_stop_names_this_runs_likely_causes():
    from ferry.run.nonfinite import likely_causes, nonfinite_error
    from tests.conftest import compose_config

    risky = likely_causes(compose_config("train.warmup_steps=0", "train.learning_rate=0.05", "train.adam_eps=1e-20"))
    assert any("train.warmup_steps=0" in c for c in risky)
    assert any("train.learning_rate=0.05" in c for c in risky)
    assert any("train.adam_eps=1e-20" in c for c in risky)
    assert any(
        "train.z_loss_weight=1e+30 outweighs" in c for c in likely_causes(compose_config("train.z_loss_weight=1e30"))
    )
    calm = likely_causes(compose_config("train.learning_rate=1e-4", "train.compute_dtype=float32"))
    assert not any("learning_rate=0.0001 is high" in c for c in calm) and len(calm) == 1
    message = str(nonfinite_error(7, "/runs/x/checkpoints", risky))
    assert "not finite at step 7" in message and "(1) no warmup" in message and "(2) train.learning_rate" in message


def test_a_checkpoint_weight_holding_nan_is_refused_naming_the_tensor(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    from ferry.hf.safetensors_io import CheckpointError, CheckpointReader

    weight = np.ones((4, 4), np.float32)
    weight[2, 3] = np.nan
    save_file(
        {"model.norm.weight": np.ones(4, np.float32), "lm_head.weight": weight}, str(tmp_path / "model.safetensors")
    )
    reader = CheckpointReader(tmp_path)
    assert reader.read("model.norm.weight").sum() == 4
    with pytest.raises(CheckpointError, match=r"tensor lm_head.weight holds 1 non-finite value.*first at \[2, 3\]"):
        reader.read("lm_head.weight")


def test_an_evaluation_longer_than_the_held_out_split_is_noted():
    from ferry.config.train import TrainConfig
    from ferry.run.training import held_out_note

    train = TrainConfig(global_batch_size=4, seq_len=32, eval_batches=3)
    assert held_out_note(train, held_out_windows=12) is None
    note = held_out_note(train, held_out_windows=9)
    assert "train.eval_batches=3 but the held-out split holds 2 whole batch(es)" in note


def test_a_profile_past_the_runs_end_is_noted():
    from tests.conftest import compose_config

    run = ("train.steps=6", "train.warmup_steps=1")
    notes = compose_config(*run, "profile.start_step=5", "profile.steps=4").notes
    assert notes == (
        "profile.steps=4 from profile.start_step=5 runs past train.steps=6: the trace holds steps 5 to 6 (2 step(s))",
    )
    assert compose_config(*run, "profile.start_step=4", "profile.steps=3").notes == ()


def test_data_keys_the_source_does_not_read_are_noted():
    from tests.conftest import compose_config

    notes = compose_config("data=synthetic", "data.path=/corpus", "data.field=body").notes
    assert notes == (
        "data.path=/corpus is not read: data.source=synthetic makes random tokens",
        "data.field=body is not read: data.source=synthetic makes random tokens",
    )
    prepared = compose_config("data=stdlib", "data.prepared=/shards", "data.eval_fraction=0.2").notes
    assert prepared == (
        "data.eval_fraction=0.2 is not read: a run reads the shards in data.prepared=/shards as written",
    )
    assert compose_config("data=stdlib").notes == compose_config("data=synthetic").notes == ()
