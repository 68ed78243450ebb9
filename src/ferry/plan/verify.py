"""The verifier of a compiled train step: does the program XLA built do what the plan says?

Three checks, per tensor and per layer group (a model's kinds of layer: `decoder`; `dense`,
`moe`, `mtp_1`...):

- **copies**: every tensor the policy offloads has its copies to host and back in the program,
  as many per step as the transfer schedule lists and of its bytes. A copy XLA removed because
  the backward pass never reads the value (a layer's last product joining the residual stream) is
  reported as dead, proven on the layer's jaxpr (`ferry.plan.replay`), not counted as missing.
- **walks**: every dynamic slice of a pinned-host buffer inside a loop walks the way its index
  goes. XLA:GPU precomputes such a slice's addresses (`dynamic_slice_config`); openxla/xla
  #46231 annotated the backward pass's reads of layer `n-1-i` as a forward walk, which reads
  other layers' residuals and gives silently wrong gradients.
- **recompute**: with nothing rematerialised (`replay.all_saved`) the program runs as many
  matmuls as `save_all`: no producer of a saved value runs again (a tag on a nonlinear output
  keeps its producer alive). It needs a second compile, so `mode=plan` runs it once per plan
  (`verify_recompute`), not `offload=auto`'s search.

How a copy is named: the engine issues each copy under the name scope
`ferry_offload/<layer group>/<tensor>/<to_host|to_device>`; where that scope survives into the
copy's `op_name` metadata, the copy is named by it. Measured with jax 0.12.0.1 it survives
nowhere: XLA's host-offloading passes rebuild a scanned layer's copies as slices of the stacked
residual, whose `op_name` is the scan's; the `copy-start`s of unscanned copies (DeepSeek's dense
layer and MTP block on an H200) carry no `op_name`; and libtpu's copies carry no metadata. So a
copy is named by its bytes per device and its group by how often it runs: tensors of one size
are told apart only by count (the ones the backward pass reads served first), and a copy's name
lists every tensor of its group with its size ("query_proj/attention_out/out_proj").
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ferry.offload.engine import Policy
from ferry.offload.schedule import TransferSchedule, format_bytes
from ferry.plan.copy_match import SCOPE, CopyCheck, check_copies
from ferry.plan.memory_plan import MemoryPlan, PlanError
from ferry.plan.replay import LayerGroupTrace, all_saved, recomputed_producers, record_names, untagged_matmuls
from ferry.train.state_memory import StateWrite
from ferry.xla.hlo_slice_walks import host_slice_walks


class CompiledProgramError(PlanError):
    """A check of the compiled program failed: the message names the tensor, its layer group and
    what the program does instead."""


class MissingCopyError(CompiledProgramError):
    """An offloaded tensor the backward pass reads has no (or too few) host copies."""


class WrongWalkError(CompiledProgramError):
    """A host-memory slice in a loop walks against its index (the openxla/xla #46231 class)."""


class RecomputedProducerError(CompiledProgramError):
    """Saving a tagged value spares no matmul: its producer runs again in the backward pass."""


@dataclasses.dataclass(frozen=True)
class WalkCheck:
    """One host-memory slice in a loop: the walk of its index against XLA's descriptor."""

    group: str
    tensor: str
    kind: str  # "host read" or "host write"
    loop: str  # the loop body computation
    instruction: str
    buffer_shape: str
    index: str  # the walked index at the first two iterations, "?" where not resolved
    expected: tuple[int, int | None] | None  # (byte offset, byte stride) the index gives
    descriptor: tuple[int, int | None] | None  # what XLA's dynamic_slice_config says
    status: str  # "right", "wrong", "no descriptor" (TPU: slices addressed by index) or "index unresolved"


@dataclasses.dataclass(frozen=True)
class RecomputeExplanation:
    """Why a program with nothing rematerialised may run more matmuls than `save_all`, found on
    the layers' jaxprs: tags whose producer runs again (refused), and the matmuls the replay
    recomputes between saved values because nobody tags their output (an attention's scores)."""

    culprits: tuple[tuple[str, str], ...]  # (group, tensor)
    untagged_matmuls: float  # per step


@dataclasses.dataclass(frozen=True)
class RecomputeCheck:
    """Matmuls of the policy with nothing rematerialised against `save_all`'s, per step, and the
    matmuls untagged intermediates explain (None where the counts are equal: nothing to explain)."""

    policy: str
    matmuls: int
    flops: float
    save_all_matmuls: int
    save_all_flops: float
    untagged_matmuls: float | None = None

    @property
    def equal(self) -> bool:
        return self.matmuls == self.save_all_matmuls and abs(self.flops - self.save_all_flops) <= 1e-9 * max(
            self.flops, self.save_all_flops, 1.0
        )


@dataclasses.dataclass(frozen=True)
class Verification:
    """What the verifier found in one compiled program."""

    copies: tuple[CopyCheck, ...] = ()
    walks: tuple[WalkCheck, ...] = ()
    unmatched: tuple[str, ...] = ()  # host copies of no offloaded tensor's size: "<direction> <shape> x<n>"
    recompute: RecomputeCheck | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "copies": [dataclasses.asdict(c) for c in self.copies],
            "walks": [dataclasses.asdict(w) for w in self.walks],
            "unmatched_copies": list(self.unmatched),
            "recompute": None
            if self.recompute is None
            else dataclasses.asdict(self.recompute) | {"equal": self.recompute.equal},
        }


def check_walks(hlo_text: str, moved: dict[tuple[str, str], tuple[str, str]]) -> tuple[WalkCheck, ...]:
    """Every host-memory slice in a loop body (`ferry.xla.hlo_slice_walks.host_slice_walks`), named by the copy
    it runs (`check_copies`) or its copy scope."""
    checks = []
    for walk in host_slice_walks(hlo_text):
        scope = SCOPE.search(walk.op_name)
        named = (scope["group"], scope["tensor"]) if scope else ("?", "?")
        group, tensor = moved.get((walk.computation, walk.instruction), named)
        if walk.descriptor_offset is None or walk.descriptor_stride is None:
            status = "no descriptor"
        elif walk.expected_offset is None or walk.expected_stride is None:
            status = "index unresolved"
        else:
            status = "right" if walk.agrees else "wrong"
        resolved = walk.index_start is not None and walk.index_next is not None
        checks.append(
            WalkCheck(
                group=group,
                tensor=tensor,
                kind=walk.kind,
                loop=walk.computation,
                instruction=walk.instruction,
                buffer_shape=walk.buffer_shape,
                index=f"{walk.index_start}, {walk.index_next}, ..." if resolved else "?",
                expected=None if walk.expected_offset is None else (walk.expected_offset, walk.expected_stride),
                descriptor=None if walk.descriptor_offset is None else (walk.descriptor_offset, walk.descriptor_stride),
                status=status,
            )
        )
    return tuple(checks)


def verify_program(
    hlo_text: str,
    schedule: TransferSchedule,
    micro_steps: int,
    read_by_backward: Callable[[str, str], bool],
    where: str,
    state: Mapping[str, StateWrite] = MappingProxyType({}),
) -> Verification:
    """Check a compiled program's copies and host walks against `schedule`; refuse it (a
    `CompiledProgramError` naming the tensor, its group and what the program does instead) when
    a check fails. `where` names the program ("policy P compiled for T"); `state`, the train
    state's write-backs to pinned host (`check_copies`)."""
    copies, unmatched, moved = check_copies(hlo_text, schedule, micro_steps, read_by_backward, state)
    missing = [c for c in copies if c.status == "missing"]
    if missing:
        raise MissingCopyError(f"{where}: {_missing_copies(missing)}")
    walks = check_walks(hlo_text, moved)
    wrong = [w for w in walks if w.status == "wrong"]
    if wrong:
        raise WrongWalkError(
            f"{where}: "
            + "; ".join(
                f"the {w.kind} of {w.tensor} ({w.group} layers, host buffer {w.buffer_shape}, `{w.instruction}` in "
                f"loop {w.loop}) takes index {w.index}, byte offset {w.expected[0]} then steps of {w.expected[1]}, "
                f"but XLA's descriptor walks from byte {w.descriptor[0]} in steps of {w.descriptor[1]}: each "
                "iteration moves another layer's slice"
                for w in wrong
                if w.expected is not None and w.descriptor is not None
            )
            + ". This is the openxla/xla #46231 miscompile (silently wrong gradients); use a jax release with "
            "its fix (ferry needs jax>=0.12) or keep these tensors on device"
        )
    return Verification(copies, walks, unmatched)


def _missing_copies(missing: list[CopyCheck]) -> str:
    """Per layer group, the tensors short of copies: found / listed per step, each way."""
    tensors: dict[str, dict[str, dict[str, CopyCheck]]] = {}
    for c in missing:
        tensors.setdefault(c.group, {}).setdefault(c.tensor, {})[c.direction] = c
    groups = []
    for group, named in tensors.items():
        listed = []
        for tensor, ways in named.items():
            size = format_bytes(next(iter(ways.values())).bytes)
            found = ", ".join(f"{c.found}/{c.expected} {direction}" for direction, c in ways.items())
            listed.append(f"{tensor} ({size} per layer per device) {found}")
        groups.append(f"{group} layers: " + "; ".join(listed))
    return (
        "the backward pass reads these offloaded tensors, but the program has fewer copies per step than the "
        "schedule lists (found/listed): "
        + ". ".join(groups)
        + ". Where none crosses the host link the value stays in HBM: the compiler dropped the offload, and "
        "the plan would understate HBM"
    )


def verify_recompute(check: RecomputeCheck, explain: Callable[[], RecomputeExplanation], where: str) -> RecomputeCheck:
    """Refuse a program whose all-saved matmuls exceed `save_all`'s because a saved value's
    producer runs again, naming the tags to blame, or by more than the untagged intermediates
    between saved values explain (XLA recomputing on its own). `explain()` traces the layers,
    only when the counts differ."""
    if check.equal:
        return check
    explanation = explain()
    extra = check.matmuls - check.save_all_matmuls
    counts = (
        f"{where}: with nothing rematerialised ({check.policy}) the compiled program runs {check.matmuls} matmuls "
        f"({check.flops / 1e9:.4f} GFLOP) per step against save_all's {check.save_all_matmuls} "
        f"({check.save_all_flops / 1e9:.4f} GFLOP)"
    )
    if explanation.culprits:
        raise RecomputedProducerError(
            f"{counts}: "
            + "; ".join(
                f"tag {tensor!r} of the {group} layers: saving it spares no matmul, its producer runs again in the "
                "backward pass"
                for group, tensor in explanation.culprits
            )
            + ". Tag a matmul's output (whose tangent needs no recomputed matmul), not a nonlinear function of it"
        )
    if extra > explanation.untagged_matmuls:
        raise RecomputedProducerError(
            f"{counts}: the layers' untagged intermediates explain {explanation.untagged_matmuls:.0f} more, so the "
            f"compiler recomputes {extra - explanation.untagged_matmuls:.0f} matmuls of saved values on its own"
        )
    return dataclasses.replace(check, untagged_matmuls=explanation.untagged_matmuls)


def explain_recompute(
    model: Any, groups: dict[str, LayerGroupTrace], layers: dict[str, int], policy: Policy
) -> RecomputeExplanation:
    """Trace one layer of each group (`layers`: how many run per step): the tags whose producing
    matmul runs again however they are placed (`replay.recomputed_producers`), and the matmuls
    its replay with nothing rematerialised needs beyond `save_all`'s (`replay.untagged_matmuls`)."""
    culprits, untagged = [], 0.0
    for name, group in groups.items():
        tagged = sorted(record_names(model, group))
        culprits += [(name, tensor) for tensor in recomputed_producers(model, group, policy, tagged)]
        untagged += layers[name] * untagged_matmuls(model, group, policy, tagged)
    return RecomputeExplanation(tuple(culprits), untagged)


class RecomputeNotChecked(Exception):
    """The recompute check has no reference to compare with: the programs it compares run out of
    HBM, where XLA's own rematerialisation (if on) changes their matmuls, and where the check is
    not proven (at the DeepSeek-V3 reference plan, with that pass off, `minimal` runs small matmuls
    more than `save_all` that the untagged intermediates do not explain: docs/results/reference-plans.md,
    "What offload=auto's rules rest on")."""


def _check_fits(plans: list[MemoryPlan]) -> None:
    over = [plan.policy for plan in plans if not plan.fits]
    if over:
        raise RecomputeNotChecked(
            f"{', '.join(over)} {'exceeds' if len(over) == 1 else 'exceed'} HBM: the check compares programs that "
            "fit (over HBM, XLA's own rematerialisation, where it is on, recomputes in them)"
        )


def recompute_checked(
    plans: list[MemoryPlan],
    policies: list[Policy],
    tagged: frozenset[str],
    compile_policy: Callable[[Policy, str], MemoryPlan],
    explain: Callable[[Policy], RecomputeExplanation],
    where: str,
) -> list[MemoryPlan]:
    """`mode=plan`'s recompute check of `plans` (compiled from `policies`): the matmuls of a plan
    that rematerialises nothing against `save_all`'s. Reuses the plans already compiled where it
    can; otherwise compiles `save_all` and the first policy with nothing rematerialised (one or
    two compiles more), the reference first: where it exceeds HBM the check stops there (at the
    DeepSeek-V3 seed that saves two probe compiles). Every plan that places tags gets the check in
    its verification."""
    placing = [(plan, policy) for plan, policy in zip(plans, policies, strict=True) if not policy.keep_all]
    if not placing:
        return plans
    reference = next((plan for plan, policy in zip(plans, policies, strict=True) if policy.keep_all), None)
    if reference is None:
        reference = compile_policy(Policy.save_all(), "save_all")
    _check_fits([reference])  # before compiling more: a save_all over HBM is no reference whatever else fits
    saved = [(plan, policy) for plan, policy in placing if all(policy.placement(n) != "remat" for n in tagged)]
    if not saved:
        first, policy = placing[0]
        policy = all_saved(policy, tagged)
        saved = [(compile_policy(policy, f"{first.policy}, nothing rematerialised"), policy)]
    _check_fits([plan for plan, _ in saved])
    checks = {}
    for plan, policy in saved:
        check = RecomputeCheck(plan.policy, plan.matmuls, plan.flops, reference.matmuls, reference.flops)
        checks[plan.policy] = verify_recompute(check, functools.partial(explain, policy), where)
    first_check = next(iter(checks.values()))

    def with_check(plan: MemoryPlan) -> MemoryPlan:
        if plan.verification is None or all(plan is not p for p, _ in placing):
            return plan
        check = checks.get(plan.policy, first_check)
        return dataclasses.replace(plan, verification=dataclasses.replace(plan.verification, recompute=check))

    return [with_check(plan) for plan in plans]
