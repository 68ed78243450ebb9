"""The contract every model family keeps: an abstract config and an abstract language model.

These classes declare, with `AbstractVar`, `AbstractClassVar` and abstract methods, everything the
trainer, the planner, the FLOPs count, the Hugging Face mapping and the mesh checks read of a model,
so a family missing a piece cannot be instantiated, and nothing outside a family asks which family
it holds (no `isinstance` chains, no `getattr(config, name, default)`): a config declares its
family's name (`family`), by which the registry finds the family.

Every model class keeps Equinox's abstract/final pattern: it is abstract (named `Abstract...`, it
declares what its subclasses implement) or final (`typing.final`: never subclassed, overriding no
concrete method). One liberty: an abstract class may declare the fields its final classes share
(`AbstractDenseConfig`'s, GQA's) instead of each repeating them. Equinox 0.13 accepts `strict=True`
and checks nothing, so ferry enforces the pattern itself: mypy refuses a subclass of a final class,
the abstract classes refuse one where it is defined (`ferry.final`), and
tests/models/test_model_contract.py checks every class of `ferry.models` and the dense decoder's layers.
"""

import abc
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
from equinox import AbstractClassVar, AbstractVar
from jaxtyping import Array, Bool, Float, Int

from ferry.data.loss_weights import counted
from ferry.data.segments import DocumentMask, document_segments, loss_weights
from ferry.final import refuse_final_bases
from ferry.head.chunked import OutputHead
from ferry.head.loss import DEFAULT_HEAD, LossHead
from ferry.nn.attention import Segments
from ferry.nn.embedding import Embedding
from ferry.nn.kernels.choice import check_attention_setting, describe_attention
from ferry.nn.kernels.flash import with_declared_lse
from ferry.nn.norm import RMSNorm
from ferry.nn.stack import LayerStack
from ferry.offload.engine import SAVE_ALL, Policy, tagged_names
from ferry.offload.schedule import LayerKind

MeshDim = tuple[str, int, str]
"""(config field, its size, the mesh axis the sharding rules split it over)."""


class AbstractModelConfig(eqx.Module):
    """A model family's architecture and its model-side training settings (frozen; built from
    the Hydra `model` node by `ferry.config_schema.from_dict`)."""

    # The family's name (`family:` in configs/model/*.yaml): how the registry and the Hugging Face
    # mapping find a config's family. A class variable, so no checkpoint's identity records it.
    family: AbstractClassVar[str]
    vocab_size: AbstractVar[int]
    dim: AbstractVar[int]  # the residual stream's width: every decoder layer's input
    num_layers: AbstractVar[int]
    if TYPE_CHECKING:
        # A type checker reads an AbstractVar as a dataclass field: a family's defaulted field or
        # property would then break the field order or override a field. Read-only here.
        @property
        def mtp_depth(self) -> int: ...
        @property
        def scan_layers(self) -> bool: ...
        @property
        def attention(self) -> str: ...
    else:
        mtp_depth: AbstractVar[int]  # multi-token prediction depths (0 for a family without them)
        scan_layers: AbstractVar[bool]
        attention: AbstractVar[str]  # the attention kernel: auto, xla, splash or cudnn (`ferry.nn.kernels.choice`)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_final_bases(cls)

    def __check_init__(self) -> None:
        check_attention_setting(self.attention)

    @abc.abstractmethod
    def attention_heads(self) -> tuple[int, int, int, int]:
        """(query heads, key/value heads, q/k head width, v head width) of every attention layer."""

    def describe_attention(
        self, seq_len: int, compute_dtype: str, document_mask: bool = False, platform: str | None = None
    ) -> str:
        """One line for the start-up report: the attention kernel this config runs at `seq_len` on
        `platform` (default: this process's backend), and why."""
        heads, kv_heads, qk_dim, v_dim = self.attention_heads()
        return describe_attention(
            self.attention,
            heads=heads,
            kv_heads=kv_heads,
            qk_dim=qk_dim,
            v_dim=v_dim,
            seq=seq_len,
            dtype=compute_dtype,
            segmented=document_mask,
            platform=platform,
        )

    @abc.abstractmethod
    def mesh_dims(self) -> list[MeshDim]:
        """Every dimension the sharding rules split, so a mesh that does not divide one is
        refused before anything is built."""

    @abc.abstractmethod
    def forward_flops(self, batch: int, seq: int) -> tuple[int, float]:
        """(weight, attention) FLOPs of one forward pass over `batch` x `seq` tokens, by MaxText's
        convention (`ferry.train.step_flops`)."""

    @abc.abstractmethod
    def for_platform(self, platform: str) -> "AbstractModelConfig":
        """The config as it runs on `platform` ("cpu", "gpu", "tpu"), its choices left to the
        backend (e.g. the MoE's grouped matmul) made; the planner asks for its target's."""

    @abc.abstractmethod
    def without_mtp(self) -> "AbstractModelConfig":
        """The same model without multi-token prediction (to report its size both ways)."""

    @abc.abstractmethod
    def stack_depths(self) -> dict[str, int]:
        """Each scanned stack of decoder layers (by its `LayerKind` name) and its depth."""

    @abc.abstractmethod
    def with_stack_depths(self, depths: dict[str, int]) -> "AbstractModelConfig":
        """The same model with its stacks `depths` layers deep (the planner compiles shallow
        copies to extrapolate a deep model)."""


class AbstractLanguageModel(eqx.Module):
    """A decoder-only language model as ferry trains it: logits, the training loss with its
    statistics, the update of state kept outside the gradient, and its kinds of decoder layers
    (which the offload schedule, the planner and the policy self-check run one at a time)."""

    config: AbstractVar[AbstractModelConfig]
    embed: AbstractVar[Embedding]
    final_norm: AbstractVar[RMSNorm]  # after the last decoder layer, before the output head

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_final_bases(cls)

    @abc.abstractmethod
    def decoder_stacks(self) -> list[LayerStack]:
        """The stacks of decoder layers the embedded tokens pass, in order, before `final_norm`
        (a decode with a cache, `ferry.generate`, runs them a layer at a time)."""

    @abc.abstractmethod
    def __call__(
        self, tokens: Int[Array, "batch seq"], policy: Policy = SAVE_ALL, segments: Segments | None = None
    ) -> Float[Array, "batch seq vocab"]:
        """Logits; `segments` (packed documents' segment ids and positions) keep attention inside
        each document."""

    @abc.abstractmethod
    def final_hidden(
        self, tokens: Int[Array, "batch seq"], policy: Policy = SAVE_ALL, segments: Segments | None = None
    ) -> Float[Array, "batch seq dim"]:
        """The last layer's output after the final norm: what the output head reads."""

    @abc.abstractmethod
    def output_head(self) -> OutputHead:
        """The weight the logits read (the head, or the embedding table it is tied to)."""

    @abc.abstractmethod
    def training_loss(
        self,
        batch: Int[Array, "batch seq_plus_one"],
        policy: Policy,
        z_loss_weight: float = 0.0,
        documents: DocumentMask | None = None,
        head: LossHead = DEFAULT_HEAD,
        target_weights: Bool[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, ""], dict[str, Array]]:
        """The loss to differentiate for next-token prediction of batch[:, 1:] from batch[:, :-1],
        and the statistics to log (`loss`: the main cross-entropy); `head` says how the loss reads
        the output head (by default never making the batch's logits whole); `target_weights`: which
        targets count (data.format=chat: the replies'), the means over those (None: all)."""

    @abc.abstractmethod
    def after_step(self, stats: dict[str, Array]) -> "AbstractLanguageModel":
        """The model after an optimizer step with these statistics (state updated outside the
        gradient, such as router biases; `self` when there is none)."""

    @abc.abstractmethod
    def layer_kinds(self) -> list[LayerKind]:
        """Each kind of decoder layer: how many, how to run one, how to build one."""

    def tagged_names(self) -> frozenset[str]:
        """Every activation name a decoder layer of this model tags (found abstractly; the model
        may be abstract)."""
        example = jax.ShapeDtypeStruct((1, 2, self.config.dim), jax.numpy.float32)
        names = frozenset().union(*(tagged_names(kind.run, self, example) for kind in self.layer_kinds()))
        return with_declared_lse(names)  # attention_lse on every backend (`with_declared_lse`)


def dense_training_loss(
    model: AbstractLanguageModel,
    batch: Int[Array, "batch seq_plus_one"],
    policy: Policy,
    z_loss_weight: float = 0.0,
    documents: DocumentMask | None = None,
    head: LossHead = DEFAULT_HEAD,
    target_weights: Bool[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """`training_loss` of a model whose only loss is next-token cross-entropy of its logits
    (Llama, Qwen3): the main loss, z-loss, document masking and loss weights as every family has them."""
    inputs = batch[:, :-1]
    segments = None if documents is None else document_segments(inputs, documents.end_of_document)
    h = model.final_hidden(inputs, policy, segments)
    weights = counted(loss_weights(inputs, documents), target_weights)
    loss, cross_entropy = head(h, model.output_head(), batch[:, 1:], z_loss_weight, weights)
    return loss, {"loss": cross_entropy}
