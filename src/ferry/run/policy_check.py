"""The gradient self-check: before training, on the user's own JAX, XLA and hardware, the offload
policy is compiled on a few real layers and its gradients compared with `save_all`'s.

Compilers have given silently wrong gradients for offloaded scan residuals (openxla/xla #46231: a
backward loop reading host memory in the wrong direction). Tests on the CPU backend cannot see
such a bug, so the run checks the program it is about to use: for each kind of decoder layer
(Llama's decoder; DeepSeek-V3's dense, MoE and MTP blocks) a `LayerStack` of three freshly
initialised layers (so the layer scan is a real loop, whatever the model's own count) runs on one
row in float32, once with the run's policy and once with `save_all`, and the outputs and the
gradients of every parameter and of the input must agree to float32 rounding.

What it costs is compiles, not arithmetic (one row of at most 64 tokens): one program makes the
layers, the input and the cotangents (made op by op instead, each op would be a compile of its
own, which a TPU pays for in seconds); the policy's program and save_all's are traced here, then
compiled side by side, a core each; the arrays are compared on the device, so only two numbers
per array come back (not the stacks' gradients, copied to the host and compared in float64).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh
from jaxtyping import Array, Float, PRNGKeyArray
from omegaconf import OmegaConf
from rich.console import Console

from ferry.config.root import FerryConfig
from ferry.models.registry import abstract_model, family_of, model_config
from ferry.nn.stack import LayerStack
from ferry.offload.engine import Policy, PolicyError
from ferry.offload.schedule import LayerKind
from ferry.run.startup import detail
from ferry.sharding import MESH_AXES

CHECK_LAYERS = 3
"""Layers per checked stack: the backward loop then reads its residuals at three different steps."""


def check_layers(policy: Policy) -> int:
    """Layers per checked stack under `policy`: a peeled one (`Policy.peel`) gets its first layer,
    a loop of two and its `peel` last layers, so that the program checked is a deep stack's."""
    return policy.peel + 3 if policy.peeled else CHECK_LAYERS


CHECK_SEQ = 64
"""Longest sequence checked (one row): enough for every code path of a layer but the chunked
attention of sequences over 512, and cheap."""
UNIT_ROUNDOFF = 2.0**-24
"""float32's unit roundoff."""
TOLERANCE = 1024 * UNIT_ROUNDOFF
"""Largest difference allowed between a policy's result and save_all's, relative to the largest
magnitude of the compared array (about 6.1e-5). Both compute the same float32 values; recompute
and another fusion can only reorder sums, which moves a sum of n terms by at most about n x the
roundoff of its terms (1,024 terms at worst; the usual random-walk error of a million). A wrong
residual (another layer's, a stale or zeroed buffer) moves gradients by a fraction of their scale."""
BUDGET_BYTES = 16 * 1024**2
"""Parameters of one checked stack, in float32, above which the check narrows the layers to its
family's tiny widths (see `check_model_config`). What the check costs is compiling, and libtpu's
compile time grows with the arrays' sizes, not only with the program: at the 386M Llama's full
widths nearly all of the check's time on the v5e chip was compiling (docs/results/tpu-v5e.md, "The
gradient self-check"). What the check is for is the program's structure, which narrowing keeps:
which buffer the backward loop reads (#46231 read host slices walking the wrong way), a restore's
value, the names placed and the compiler flags. Every tiny model (at most 2.7 MB) keeps its widths."""
_KEPT_SIZES = frozenset({"num_layers", "num_dense_layers", "mtp_depth", "moe_tile_rows"})
"""Integer fields that shape the program rather than the width: kept when narrowing."""
_CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "model"


class PolicyCheckError(PolicyError):
    """The compiled program of the offload policy gives other values than save_all's on this
    machine: a compiler (or engine) bug that would train the model on wrong gradients."""


@dataclasses.dataclass(frozen=True)
class Difference:
    """The largest difference between a policy's array and save_all's."""

    what: str  # "output", "input gradient", "gradient of .attention.query.weight"...
    max_abs: float
    scale: float  # the largest magnitude of save_all's array

    @property
    def relative(self) -> float:
        if self.max_abs == 0:
            return 0.0
        return self.max_abs / self.scale if self.scale > 0 else math.inf

    @property
    def ok(self) -> bool:
        return self.relative <= TOLERANCE  # False for NaN too


@dataclasses.dataclass(frozen=True)
class GroupCheck:
    """One kind of layer checked: the kinds sharing its layer (DeepSeek's MTP block is a MoE
    layer), the worst of its compared arrays, the seconds the whole check of it took and the
    seconds of those spent compiling (the policy's and save_all's programs, side by side)."""

    groups: tuple[str, ...]
    worst: Difference
    seconds: float
    narrowed: bool
    compile_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.worst.ok

    def describe(self) -> str:
        width = "tiny widths" if self.narrowed else "the model's widths"
        verdict = "ok" if self.ok else "MISMATCH"
        return (
            f"{'/'.join(self.groups)}: {verdict}, largest difference {self.worst.relative:.1e} of scale "
            f"({self.worst.what}; float32 allows {TOLERANCE:.1e}), {width}, {self.seconds:.1f} s "
            f"({self.compile_seconds:.1f} s of it compiling the two programs)"
        )


def check_before_training(config: FerryConfig, policy: Policy, console: Console) -> list[GroupCheck]:
    """`train.check_policy` (null: on for platform=gpu and tpu, whose compilers place offloaded
    values in host memory; the CPU backend's offload is an identity): check the run's policy on
    this process's first device, print one line per layer group, refuse the run on a mismatch."""
    if not check_enabled(config) or policy.keep_all:
        return []
    start = time.perf_counter()
    results = check_policy(
        config.model, policy, seq_len=config.train.seq_len, policy_name=config.offload.name, seed=config.train.seed
    )
    compiling = sum(r.compile_seconds for r in results)
    seconds = time.perf_counter() - start
    detail(
        console,
        f"gradient self-check of offload={config.offload.name} against save_all ({check_layers(policy)} layers of each "
        f"kind, one row, float32) passed in {seconds:.1f} s ({compiling:.1f} s compiling; "
        "train.check_policy=false skips it): " + "; ".join(r.describe() for r in results),
        brief=f"gradient self-check of offload={config.offload.name} against save_all passed in {seconds:.1f} s",
    )
    return results


def check_enabled(config: FerryConfig) -> bool:
    """`train.check_policy`, with null resolved from the platform: on for gpu and tpu."""
    enabled = config.train.check_policy
    return config.platform.name in ("gpu", "tpu") if enabled is None else enabled


def check_model_config(config: Any, budget_bytes: int = BUDGET_BYTES) -> tuple[Any, bool]:
    """The model config whose layers the check builds, and whether it was narrowed. A model whose
    stack of `CHECK_LAYERS` layers of some kind exceeds `budget_bytes` of parameters is checked
    at its family's tiny widths, keeping every setting that shapes the program (layer counts per
    kind, MTP depth, MoE dispatch and tiling, `scan_layers`...): the compiled loop, the offloaded
    names and the compiler flags are the run's, the matmul sizes (which only make it compile
    longer: `BUDGET_BYTES`) are not."""
    model = abstract_model(config)
    largest = max(_stack_bytes(_maker(kind)) for kind in model.layer_kinds())
    if largest <= budget_bytes:
        return config, False
    node = OmegaConf.to_container(OmegaConf.load(_CONFIGS / f"{family_of(config).tiny_model}.yaml"))
    tiny = model_config(cast(dict[str, Any], node))
    sizes = {
        f.name: getattr(tiny, f.name)
        for f in dataclasses.fields(config)
        if f.name not in _KEPT_SIZES and type(getattr(config, f.name)) is int  # widths, counts; not flags
    }
    return dataclasses.replace(config, **sizes), True


def _maker(kind: LayerKind) -> Callable[[PRNGKeyArray], eqx.Module]:
    """The builder of one layer of `kind`; every family gives one for each kind it lists."""
    if kind.make is None:
        raise AssertionError(f"layer kind {kind.name} gives no builder for the gradient self-check")
    return kind.make


def _stack_bytes(make: Callable[[PRNGKeyArray], eqx.Module]) -> int:
    stack = eqx.filter_eval_shape(lambda: LayerStack(make, CHECK_LAYERS, key=jax.random.key(0)))
    return sum(4 * math.prod(leaf.shape) for leaf in jax.tree.leaves(stack) if hasattr(leaf, "shape"))


def one_device_mesh(device: jax.Device) -> Mesh:
    """A mesh of one device with the run's axis names (all of size 1)."""
    return jax.make_mesh(
        (1,) * len(MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=[device]
    )


def check_policy(
    model_config_: Any,
    policy: Policy,
    *,
    seq_len: int = CHECK_SEQ,
    policy_name: str = "custom",
    device: jax.Device | None = None,
    budget_bytes: int = BUDGET_BYTES,
    seed: int = 0,
) -> list[GroupCheck]:
    """Check `policy` against save_all on every kind of layer of the model `model_config_`
    describes, on one row of `min(seq_len, CHECK_SEQ)` tokens on `device` (default: this
    process's first); raise PolicyCheckError naming the layer group and the largest difference
    when they disagree beyond float32 rounding, else return what was checked."""
    if policy.keep_all:
        return []  # save_all is the reference itself
    device = device or jax.local_devices()[0]
    config, narrowed = check_model_config(model_config_, budget_bytes)
    model = abstract_model(config)
    policy.validate(model.tagged_names())
    seq = min(seq_len, CHECK_SEQ)
    results: list[GroupCheck] = []
    seen: dict[Any, int] = {}  # layer structure -> index in results (MTP shares the MoE layer)
    mesh = one_device_mesh(device)
    with jax.default_device(device), jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        for kind in model.layer_kinds():
            structure = _structure(_maker(kind))
            if structure in seen:
                index = seen[structure]
                results[index] = dataclasses.replace(results[index], groups=(*results[index].groups, kind.name))
                continue
            start = time.perf_counter()
            worst, compiling = compare_group(_maker(kind), config.dim, seq, policy, seed, len(seen))
            seen[structure] = len(results)
            results.append(GroupCheck((kind.name,), worst, time.perf_counter() - start, narrowed, compiling))
    failed = [r for r in results if not r.ok]
    if failed:
        raise PolicyCheckError(_refusal(failed, policy_name, device, check_layers(policy)))
    return results


def _structure(make: Callable[[PRNGKeyArray], eqx.Module]) -> Any:
    stack = eqx.filter_eval_shape(lambda: LayerStack(make, CHECK_LAYERS, key=jax.random.key(0)))
    leaves, treedef = jax.tree.flatten(stack)
    return treedef, tuple((leaf.shape, str(leaf.dtype)) if hasattr(leaf, "shape") else leaf for leaf in leaves)


def _refusal(failed: list[GroupCheck], policy_name: str, device: jax.Device, layers: int) -> str:
    worst = failed[0]
    lines = [
        f"the gradient self-check failed: offload policy {policy_name!r} compiled by jax {jax.__version__} for "
        f"{device.device_kind} ({device.platform}) gives other values than save_all on "
        f"{layers} stacked {'/'.join(worst.groups)} layers (one row, float32): "
        f"{worst.worst.what} differs by {worst.worst.max_abs:.3g}, {worst.worst.relative:.2e} of its largest "
        f"magnitude {worst.worst.scale:.3g} (float32 rounding allows {TOLERANCE:.1e})"
    ]
    lines += [f"  also {r.describe()}" for r in failed[1:]]
    lines.append(
        "Training with it would follow wrong gradients. Choose another offload= preset (offload=full_remat "
        "offloads nothing), try another jax release, or report the compiler bug; train.check_policy=false "
        "skips this check"
    )
    return "\n".join(lines)


def compare_group(
    make: Callable[[PRNGKeyArray], eqx.Module],
    dim: int,
    seq: int,
    policy: Policy,
    seed: int,
    index: int,
) -> tuple[Difference, float]:
    """The largest difference, relative to scale, between `policy`'s and save_all's outputs and
    gradients (every parameter's and the input's) of a `check_layers(policy)`-layer stack of
    `make` (its weights, input and cotangents drawn from `seed` and the group's `index`), and the
    seconds spent compiling the two programs."""
    layers = check_layers(policy)
    abstract = eqx.filter_eval_shape(lambda: LayerStack(make, layers, key=jax.random.key(0)))
    x_spec = jax.ShapeDtypeStruct((1, seq, dim), jnp.float32)
    # the policy of the names this layer tags: the model's other layers' names mean nothing here
    own = abstract.tagged_names(x_spec)
    policy = dataclasses.replace(policy, placements={name: policy.placement(name) for name in policy if name in own})
    shapes = eqx.filter_eval_shape(_outputs, abstract, x_spec, policy)

    @eqx.filter_jit
    def inputs(seed: int, index: int) -> tuple[LayerStack, jax.Array, tuple[jax.Array, ...]]:  # static ints
        k_layers, k_x, k_cotangent = jax.random.split(jax.random.fold_in(jax.random.key(seed), index), 3)
        x = jax.random.normal(k_x, (1, seq, dim), jnp.float32)
        keys = jax.random.split(k_cotangent, len(shapes))
        cotangents = tuple(jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, shapes, strict=True))
        return LayerStack(make, layers, key=k_layers), x, cotangents

    stack, x, cotangents = inputs(seed, index)  # one program, not one per op
    params, static = eqx.partition(stack, eqx.is_inexact_array)
    lowered = [_program(static, p).lower(params, x, cotangents) for p in (policy, Policy.save_all())]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(lowered)) as pool:  # XLA compiles each on a core of its own
        got_program, expected_program = pool.map(lambda program: program.compile(), lowered)
    compiling = time.perf_counter() - start
    got = got_program(params, x, cotangents)
    expected = expected_program(params, x, cotangents)
    differences = _differences(jax.device_get(_reduced(got, expected)))
    return max(differences, key=lambda d: (not d.ok, d.relative)), compiling


def _outputs(stack: LayerStack, x: Float[Array, "1 seq dim"], policy: Policy) -> tuple[jax.Array, ...]:
    """The floating-point outputs of the stack (its last output and every layer's statistics)."""
    out = stack(x, policy)
    return tuple(leaf for leaf in jax.tree.leaves(out) if jnp.issubdtype(leaf.dtype, jnp.inexact))


def _program(static: Any, policy: Policy) -> Any:
    """The jitted step under check: outputs, and the vector-Jacobian product of the cotangents
    with respect to every parameter of the stack and to its input, by name."""

    def outputs_and_grads(
        params: Any, x: Float[Array, "1 seq dim"], cotangents: tuple[jax.Array, ...]
    ) -> dict[str, jax.Array]:
        outputs, vjp = jax.vjp(lambda p, h: _outputs(eqx.combine(p, static), h, policy), params, x)
        param_grads, input_grad = vjp(cotangents)
        named = {f"output {i}" if len(outputs) > 1 else "output": o for i, o in enumerate(outputs)}
        named["input gradient"] = input_grad
        for path, grad in jax.tree_util.tree_leaves_with_path(param_grads):
            named[f"gradient of {jax.tree_util.keystr(path)}"] = grad
        return named

    return jax.jit(outputs_and_grads)


@jax.jit
def _reduced(got: dict[str, jax.Array], expected: dict[str, jax.Array]) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Per array, on the device: the largest difference (NaN where either side is not finite)
    and the largest magnitude of save_all's. float32 suffices: two values within a factor of two
    subtract exactly, and a worse pair differs by far more than the tolerance."""
    reduced = {}
    for what, reference in expected.items():
        a, b = got[what].astype(jnp.float32), reference.astype(jnp.float32)
        if not b.size:
            reduced[what] = (jnp.float32(0), jnp.float32(0))
            continue
        finite = jnp.all(jnp.isfinite(a)) & jnp.all(jnp.isfinite(b))
        reduced[what] = (jnp.where(finite, jnp.max(jnp.abs(a - b)), jnp.nan), jnp.max(jnp.abs(b)))
    return reduced


def _differences(reduced: dict[str, tuple[Any, Any]]) -> list[Difference]:
    return [Difference(what, float(max_abs), float(scale)) for what, (max_abs, scale) in reduced.items()]
