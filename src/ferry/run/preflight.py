"""Preparing a run: every check that can refuse it, cheapest first (the model's checkpoint and
mesh, its memory, the offload policy, the data), then the run directory, locked. Nothing is
allocated or written before all have been accepted."""

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from rich.console import Console

from ferry.config.root import FerryConfig, check_mesh_shape
from ferry.config.train import TrainConfig
from ferry.data.corpus import Corpus, check_vocab, load_corpus, open_prepared
from ferry.data.pipeline import PackedWindows, window_batches
from ferry.data.token_range import check_corpus_ids
from ferry.data.tokenizer import Tokenizer, load_tokenizer
from ferry.errors import DataError, FerryError, JsonFileError
from ferry.hf import CheckpointError as HFCheckpointError
from ferry.hf import check_checkpoint
from ferry.models.registry import abstract_model, count_parameters, family_of, size_summary
from ferry.offload.engine import Policy
from ferry.offload.schedule import TransferSchedule, format_bytes, model_schedule
from ferry.run.checkpoint import model_identity
from ferry.run.data_identity import data_identity
from ferry.run.directory import RunDirectory, run_directory
from ferry.run.disk_space import check_checkpoint_space, state_bytes
from ferry.run.loggers import check_wandb
from ferry.run.policy_check import check_before_training
from ferry.run.settings_change import settings_identity
from ferry.run.startup import detail
from ferry.sharding import make_mesh, parameters_per_device
from ferry.train.host_memory import HostPlan, check_host_fits
from ferry.train.memory import StateBytes, check_fits
from ferry.train.recipe import StepRecipe
from ferry.train.state_layout import StateLayout
from ferry.train.state_memory import state_copies, stream_line


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A run whose config, memory estimate, mesh, data, offload policy and run directory have all
    been accepted; `resume_step` is the checkpoint it continues from (None: a new run)."""

    config: FerryConfig
    corpus: Corpus | None  # None for a run that is already complete
    schedule: TransferSchedule
    directory: RunDirectory  # locked by process 0 until `release`
    identity: dict[str, Any]
    recipe: StepRecipe  # the step: its policy, the state's layout (traced once), the loss settings

    @property
    def mesh(self) -> Mesh:
        return self.recipe.mesh

    @property
    def policy(self) -> Policy:
        return self.recipe.policy

    @property
    def layout(self) -> StateLayout:
        return self.recipe.layout

    @property
    def run_dir(self) -> Path:
        return self.directory.path

    @property
    def resume_step(self) -> int | None:
        return self.directory.resume_step

    @property
    def complete(self) -> bool:
        """The run's latest checkpoint is already its last step."""
        return self.resume_step is not None and self.resume_step >= self.config.train.steps

    def release(self) -> None:
        """Give up the run directory's lock (idempotent; `train` does it when it returns)."""
        self.directory.release()


def prepare(config: FerryConfig, console: Console) -> PreparedRun:
    """Every check that can refuse the run, cheapest first; allocates no model, writes nothing."""
    model = abstract_model(config.model)  # traced once, shapes only
    num_parameters = count_parameters(model)
    attention = describe_run_attention(config)  # refuses a kernel this backend cannot run
    check_pretrained(config, console)
    check_mesh_shape(config)
    mesh = make_mesh(config.mesh)  # the devices
    check_model_fits(config, model, num_parameters, mesh)
    policy = config.offload.policy(model.tagged_names())
    schedule = transfer_schedule(config, model, policy, mesh)
    check_wandb(config.log)
    tokenizer = checked_tokenizer(config)
    check_before_training(config, policy, console)  # train.check_policy: the policy's gradients on this machine
    recipe = StepRecipe.of(config, mesh, policy=policy)
    layout = recipe.layout
    schedule = dataclasses.replace(schedule, state=state_copies(layout.model, layout.placement, layout.sharding.model))
    host = check_host_fits(layout) if layout.placement.streams else None  # before anything is written or allocated
    identity = model_identity(config.model_name, config.model, layout.shapes)
    identity["data"] = data_identity(config, tokenizer)
    identity["train"] = settings_identity(config)
    check_checkpoint_space(Path(config.run.dir or config.run.root), state_bytes(layout.shapes))
    directory = locked_directory(config, identity, console)  # locked from here: release on any refusal
    prepared = PreparedRun(config, None, schedule, directory, identity, recipe)
    if prepared.complete:
        return prepared  # `train` says so
    try:
        corpus = checked_corpus(config, tokenizer, console)
    except BaseException:
        directory.release()
        raise
    announce(config, num_parameters, corpus, console)
    detail(console, attention)
    announce_state(layout, host, console)
    detail(console, recipe.head_line())  # train.loss_head, or auto's choice and why
    return dataclasses.replace(prepared, corpus=corpus)


def describe_run_attention(config: FerryConfig) -> str:
    """The start-up line naming the attention kernel `model.attention` picks for this run's
    backend, sequence, compute dtype and document mask, and why (an AttentionChoiceError where
    the setting names one that cannot run here)."""
    return config.model.describe_attention(
        config.train.seq_len, config.train.compute_dtype, document_mask=config.data.document_mask
    )


def check_pretrained(config: FerryConfig, console: Console) -> None:
    """init.from_hf's config.json and the tensors' headers match the model: nothing is read yet.
    A sequence longer than the checkpoint's positions is said in one line (context extension is
    a choice, but not one to make unknowingly)."""
    if config.init.from_hf is None:
        return
    try:
        checked = check_checkpoint(config.init.from_hf, config.model)
    except (HFCheckpointError, JsonFileError) as error:
        raise HFCheckpointError(f"init.from_hf={config.init.from_hf}: {error}") from error
    positions = checked.checkpoint.hf_config.get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool) and config.train.seq_len > positions:
        console.print(
            f"note: train.seq_len={config.train.seq_len} is longer than init.from_hf={config.init.from_hf}'s "
            f"max_position_embeddings={positions}: the checkpoint was not trained on positions past {positions} "
            "(extending its context is then this run's work); set train.seq_len at most that to stay within it",
            highlight=False,
        )


def check_model_fits(config: FerryConfig, model: eqx.Module, num_parameters: int, mesh: Mesh) -> None:
    """The parameters' share of each device fits its memory (and their axes divide their
    dimensions)."""
    check_fits(
        config.model_name,
        parameters_per_device(model, mesh),  # also refuses any parameter dimension its axes do not divide
        size_summary(config.model, num_parameters),
        f"Use model={family_of(config.model).tiny_model} on this machine, or shard it (mesh.fsdp) over devices "
        "whose memory holds it.",
        StateBytes.of(config.state_placement),
    )


def transfer_schedule(config: FerryConfig, model: eqx.Module, policy: Policy, mesh: Mesh) -> TransferSchedule:
    """What the policy moves to and from host memory per device and step."""
    data_parallel = config.mesh.data_parallel
    return model_schedule(
        model,
        policy,
        config.train.rows_per_micro_step(data_parallel),
        config.train.seq_len,
        jnp.dtype(config.train.compute_dtype),
        config.offload.name,
        micro_steps=config.train.micro_steps(data_parallel),
        mesh=mesh,
    )


def checked_tokenizer(config: FerryConfig) -> Tokenizer:
    """The tokenizer, and the prepared data's manifest and shards or the vocabulary it must fit,
    before anything compiles."""
    with data_refusals():
        tokenizer = load_tokenizer(config.data.tokenizer, config.data.eos_token)
        if config.data.prepared is not None:
            open_prepared(
                Path(config.data.prepared).expanduser(),
                tokenizer,
                config.data.tokenizer,
                config.model.vocab_size,
                config.model_name,
            )
        elif config.data.source != "synthetic":
            check_vocab(tokenizer, config.model.vocab_size, config.model_name)
    return tokenizer


def locked_directory(config: FerryConfig, identity: dict[str, Any], console: Console) -> RunDirectory:
    """The run directory, locked, saying what its resume goes on with on purpose (an unrecorded or
    foreign step, other data or settings) and when its lock was taken over from a dead holder."""
    directory = run_directory(config, identity)
    for note in directory.notes:
        console.print(f"note: {note}", highlight=False)
    if directory.data_change:
        console.print(
            f"run.allow_data_change=true: resuming step {directory.resume_step} on other data "
            f"({'; '.join(directory.data_change)}); its data position (the count of batches read) now counts "
            "batches of this data, so some examples may repeat or be skipped",
            highlight=False,
        )
    if directory.lock is not None and directory.lock.stale_holder is not None:
        console.print(
            f"run.dir={directory.path}: took over the lock of {directory.lock.stale_holder}, "
            "which is no longer running",
            highlight=False,
        )
    return directory


def checked_corpus(config: FerryConfig, tokenizer: Tokenizer, console: Console) -> Corpus:
    """The corpus, whose train and held-out splits each hold a whole global batch of windows, and
    whose ids lie in the model's vocabulary: a sample of the training split, and every token
    evaluation reads (each training batch is checked again on the device, `ferry.run.id_watch`)."""
    with data_refusals():
        corpus = load_corpus(config.data, tokenizer, config.model.vocab_size, console, config.model_name)
        for split, tokens in (("train", corpus.train), ("held-out", corpus.eval)):
            window_batches(PackedWindows(tokens, config.train.seq_len), config.train.global_batch_size, 0, where=split)
        held_out = held_out_read(config.train, PackedWindows(corpus.eval, config.train.seq_len))
        check_corpus_ids(corpus.train, corpus.eval, held_out, config.model.vocab_size, config.model_name)
    return corpus


def held_out_read(train: TrainConfig, held_out: PackedWindows) -> int:
    """How many of the held-out split's first tokens evaluation reads: `train.eval_batches` batches
    of its windows in order (fewer when they cycle)."""
    windows = min(held_out.num_windows, train.eval_batches * train.global_batch_size)
    return windows * train.seq_len + 1 if windows else 0


def announce(config: FerryConfig, num_parameters: int, corpus: Corpus, console: Console) -> None:
    """The model, the corpus and the mesh the run was prepared with (a quiet terminal gets the
    model and the tokens in one short line)."""
    tokens = f"{len(corpus.train):,} train / {len(corpus.eval):,} held-out tokens"
    detail(
        console,
        f"model {config.model_name}: {num_parameters:,} parameters; corpus: {corpus.description}, {tokens}",
        brief=f"model {config.model_name}: {num_parameters:,} parameters; {tokens}",
    )
    detail(
        console,
        f"mesh {config.mesh.describe()} over {jax.device_count()} {jax.devices()[0].platform} devices "
        f"in {jax.process_count()} process(es); micro steps per step: "
        f"{config.micro_steps}",
    )


def announce_state(layout: StateLayout, host: HostPlan | None, console: Console) -> None:
    """Where the train state lives, and the host memory the run will hold, when part of it is on host."""
    if layout.placement.streams:
        stream = stream_line(layout.model, layout.placement, layout.sharding.model)
        detail(
            console,
            f"train state: {layout.placement.describe()}: {format_bytes(layout.host_bytes())} in pinned host, {stream}",
        )
    if host is not None:
        console.print(host.describe(), highlight=False)


@contextlib.contextmanager
def data_refusals() -> Iterator[None]:
    """The data stage's `ValueError`s and missing files are refusals of the data the run was
    pointed at (`ferry.data` raises them with the file and the fix in the message)."""
    try:
        yield
    except FerryError:
        raise
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as error:
        raise DataError(str(error)) from error
