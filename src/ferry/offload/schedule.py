"""The transfer schedule: which residual of a layer goes where, and what that moves per step.

Found by abstract evaluation of one layer (nothing is computed), so it can be printed before a
run starts and written next to it as `schedule.json`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from rich.table import Table

from ferry.offload.engine import LAYER_INPUT, Placement, Policy, record_tags_and_axes
from ferry.precision import cast_floating
from ferry.sharding import activation_spec, attention_platform, mesh_platform, shard_shape

# When each copy is issued: inside its layer (`ferry.offload.engine.offloaded`) or one layer apart
# (`ferry.offload.scan`, a pipelined policy on a scanned stack).
_ISSUED = {
    False: ("D2H after its tag", "H2D as its layer's backward starts"),
    True: ("D2H as layer k+1 starts", "H2D as layer k+1's backward starts"),
}
_INPUT_ISSUED = {False: ("D2H as its layer starts", _ISSUED[False][1]), True: _ISSUED[True]}


@dataclasses.dataclass(frozen=True)
class Residual:
    """One tagged activation of one layer: its size on one device and where it waits."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_device: int
    placement: Placement
    forward: str  # for an offloaded one, when its copy to pinned host is issued ("D2H after its tag"), else "-"
    backward: str  # for an offloaded one, when its copy back is issued, else "-"


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """How a model describes one kind of its decoder layers to the schedule."""

    name: str
    num_layers: int
    run: Callable[[Any, jax.Array], Any]  # (model, x) -> the output of one such layer
    seq_shrink: int = 0  # its input is this much shorter than the batch (MTP depth k: k)
    # builds one such layer from a key, without the model (the gradient self-check stacks a few)
    make: Callable[[Any], Any] | None = None
    pipelined: bool = False  # a scanned stack: a pipelined policy moves its copies one layer apart

    @classmethod
    def of_stack(
        cls, name: str, stack_of: Callable[[Any], Any], model: Any, make: Callable[[Any], Any] | None = None
    ) -> LayerKind:
        """The kind of the layers of a `LayerStack` (`stack_of(model)`): its depth, its first layer
        and whether it is pipelined, read from the stack."""
        stack = stack_of(model)
        run = lambda m, x: stack_of(m).layer(0)(x)  # noqa: E731
        return cls(name, stack.num_layers, run, make=make, pipelined=stack.pipelined)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Identical layers (e.g. DeepSeek-V3's dense or MoE layers) and one layer's residuals."""

    name: str
    num_layers: int
    residuals: tuple[Residual, ...]
    pipelined: bool = False  # its copies move one layer apart (`ferry.offload.scan`)
    peeled: int = 0  # its first and its last `peeled` layers run outside its loop (`Policy.peels`)

    @property
    def link_bytes(self) -> int:
        """Offloaded bytes crossing the host link each way per micro step, per device: every
        layer's, less the last layer's in a peeled stack (it stays in HBM; an unpeeled pipelined
        stack moves a placeholder of its size instead)."""
        return (self.num_layers - bool(self.peeled)) * self._offloaded_per_layer

    def bytes(self, placement: Placement | None = None) -> int:
        """Bytes of all its layers' residuals with `placement` (all when None), per device."""
        return self.num_layers * sum(r.bytes_per_device for r in self.residuals if placement in (None, r.placement))

    @property
    def pipeline_bytes(self) -> int:
        """What pipelining costs in HBM, per device: one layer's offloaded values. The last
        layer's stay in HBM from the forward pass to the backward (they never cross the link),
        and while the stack runs a second layer's are in flight: the one being stored or
        reloaded."""
        return self._offloaded_per_layer if self.pipelined else 0

    @property
    def _offloaded_per_layer(self) -> int:
        return sum(r.bytes_per_device for r in self.residuals if r.placement == "offload")


@dataclasses.dataclass(frozen=True)
class StateCopy:
    """One stream of the update: a unit's host-resident master weights or moments, brought to
    HBM and written back once per step, a layer at a time."""

    group: str  # the layer stack ("other": the unstacked parameters, in one piece)
    tensor: str  # "master weights" or "AdamW moments"
    num_layers: int
    bytes_per_layer: int  # per device, each way


@dataclasses.dataclass(frozen=True)
class TransferSchedule:
    """Residuals per micro step (what HBM holds at once); copies per optimizer step, which runs
    `micro_steps` micro batches."""

    policy_name: str
    groups: tuple[LayerGroup, ...]
    micro_steps: int = 1
    state: tuple[StateCopy, ...] = ()  # the update's streams of a host-resident train state

    @property
    def residuals(self) -> tuple[Residual, ...]:
        """The residuals of the first group's layer (the only group of a uniform model)."""
        return self.groups[0].residuals

    def _bytes(self, placement: Placement | None = None) -> int:
        return sum(group.bytes(placement) for group in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(group.num_layers for group in self.groups)

    @property
    def device_to_host_bytes(self) -> int:
        """Bytes each device copies to pinned host in one step's forward passes."""
        return self.micro_steps * self.pinned_host_bytes

    @property
    def host_to_device_bytes(self) -> int:
        """Bytes each device copies back in one step's backward pass."""
        return self.device_to_host_bytes

    @property
    def pinned_host_bytes(self) -> int:
        """Pinned host bytes each device holds at once: one micro step's offloaded residuals."""
        return sum(group.link_bytes for group in self.groups)

    @property
    def device_bytes(self) -> int:
        """Tagged residual bytes each device keeps in HBM between forward and backward."""
        return self._bytes("device")

    @property
    def save_all_bytes(self) -> int:
        """Tagged residual bytes that `save_all` would keep in HBM."""
        return self._bytes()

    @property
    def pipeline_bytes(self) -> int:
        """Offloaded values pipelining keeps in HBM between the passes (each pipelined stack's
        last layer), per device; while a stack runs, one more layer of its own."""
        return sum(group.pipeline_bytes for group in self.groups)

    @property
    def hbm_saved_bytes(self) -> int:
        return self.save_all_bytes - self.device_bytes - self.pipeline_bytes

    def totals(self) -> dict[str, int]:
        return {
            "num_layers": self.num_layers,
            "micro_steps": self.micro_steps,
            "device_to_host_bytes_per_step": self.device_to_host_bytes,
            "host_to_device_bytes_per_step": self.host_to_device_bytes,
            "device_residual_bytes_per_step": self.device_bytes,
            "pipeline_residual_bytes_per_step": self.pipeline_bytes,
            "save_all_residual_bytes_per_step": self.save_all_bytes,
            "hbm_bytes_saved_vs_save_all": self.hbm_saved_bytes,
            "train_state_pinned_host_bytes": self.state_host_bytes,
        }

    @property
    def state_host_bytes(self) -> int:
        """Bytes of the train state each device keeps in pinned host; the update copies each to
        HBM and back once per step."""
        return sum(copy.num_layers * copy.bytes_per_layer for copy in self.state)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy_name,
            "layer_groups": [
                {
                    "name": g.name,
                    "num_layers": g.num_layers,
                    "pipelined": g.pipelined,
                    "peeled": g.peeled,
                    "pipeline_bytes": g.pipeline_bytes,
                    "residuals": [dataclasses.asdict(r) for r in g.residuals],
                }
                for g in self.groups
            ],
            "train_state": [dataclasses.asdict(copy) for copy in self.state],
            "totals_per_step": self.totals(),
        }


def layer_residuals(
    layer_fn: Callable[[Any, jax.Array], Any],
    params: Any,
    layer_input: jax.ShapeDtypeStruct,
    policy: Policy,
    mesh: Any = None,
    pipelined: bool = False,
) -> tuple[Residual, ...]:
    """The residuals of `layer_fn(params, x)` under `policy`, in the order the layer produces
    them (the layer input first), with the shape one device holds and, for offloaded ones, when
    each copy is issued (`pipelined`: in a pipelined stack). Without a mesh `layer_input`
    is one device's input; with one it is the global input, the layer is traced under the mesh
    (so the MoE takes its expert-parallel path) and each residual is split by the spec of its
    logical axes. `params` may be abstract (ShapeDtypeStructs): nothing is computed. The
    attention kernel is the one the mesh's platform runs (`model.attention=auto`: a flash kernel
    on a GPU or TPU target tags its log-sum-exp too)."""
    recorded: list[tuple[str, jax.ShapeDtypeStruct, Any]] = []

    def record(params: Any, x: jax.Array) -> Any:
        out, values, axes = record_tags_and_axes(layer_fn, params, x)
        recorded.extend((n, jax.ShapeDtypeStruct(v.shape, v.dtype), a) for (n, v), a in zip(values, axes, strict=True))
        return out

    with attention_platform(mesh_platform(mesh)):
        if mesh is None or mesh.size == 1:
            eqx.filter_eval_shape(record, params, layer_input)
        else:
            with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
                eqx.filter_eval_shape(record, params, layer_input)
    residuals = []
    for name, value, axes in [(LAYER_INPUT, layer_input, None), *recorded]:
        placement = policy.placement(name)
        forward, backward = (_INPUT_ISSUED if name == LAYER_INPUT else _ISSUED)[pipelined]
        if placement != "offload":
            forward = backward = "-"
        shape = tuple(value.shape)
        if mesh is not None and mesh.size > 1:
            shape = shard_shape(shape, activation_spec(value, axes, mesh), mesh)
        residuals.append(
            Residual(
                name=name,
                shape=shape,
                dtype=str(value.dtype),
                bytes_per_device=math.prod(shape) * value.dtype.itemsize,
                placement=placement,
                forward=forward,
                backward=backward,
            )
        )
    return tuple(residuals)


def transfer_schedule(
    layer_fn: Callable[[Any, jax.Array], Any],
    layer_params: Any,
    layer_input: jax.ShapeDtypeStruct,
    policy: Policy,
    num_layers: int,
    policy_name: str = "custom",
) -> TransferSchedule:
    """The schedule of `num_layers` identical layers `layer_fn(layer_params, x)`; the policy may
    name only tensors the layer tags."""
    residuals = layer_residuals(layer_fn, layer_params, layer_input, policy)
    policy.validate({r.name for r in residuals})
    return TransferSchedule(policy_name, (LayerGroup("layer", num_layers, residuals),))


def model_schedule(
    model: Any,
    policy: Policy,
    rows: int,
    seq_len: int,
    dtype: Any,
    policy_name: str = "custom",
    micro_steps: int = 1,
    mesh: Any = None,
) -> TransferSchedule:
    """The schedule of `model`'s decoder layers (run in `dtype`) on a micro step of [rows, seq_len]
    over all devices, one group per kind of layer (`model.layer_kinds()`), sized per device of
    `mesh` when given (the batch axes split the rows; tensor and expert parallelism change what a
    device holds). `model` may be abstract."""
    policy.validate(model.tagged_names())
    groups = []
    for group in model.layer_kinds():

        def one_layer(model: Any, x: jax.Array, run=group.run) -> Any:
            return run(cast_floating(model, dtype), x)

        shape = (rows, seq_len - group.seq_shrink, model.config.dim)
        pipelined = group.pipelined and policy.pipelined_by_ferry
        residuals = layer_residuals(one_layer, model, jax.ShapeDtypeStruct(shape, dtype), policy, mesh, pipelined)
        peeled = policy.peels(group.num_layers) if pipelined else 0
        groups.append(LayerGroup(group.name, group.num_layers, residuals, pipelined, peeled))
    return TransferSchedule(policy_name, tuple(groups), micro_steps)


def format_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def schedule_table(schedule: TransferSchedule) -> Any:
    """The schedule as a rich renderable: its table, one section per layer group, with the per-step
    totals as its caption; on a terminal too narrow for that, the same rows stacked (`ScheduleTable`)."""
    return ScheduleTable(schedule)


# the copy timings of `_ISSUED` and `_INPUT_ISSUED`, and the update's, in the stacked table's short words
_SHORT = {
    "D2H after its tag": "D2H tag",
    "D2H as its layer starts": "D2H start",
    "D2H as layer k+1 starts": "D2H k+1",
    "H2D as its layer's backward starts": "H2D bwd",
    "H2D as layer k+1's backward starts": "H2D k+1 bwd",
    "upd H2D": "upd H2D",
    "upd D2H": "upd D2H",
}
_LEGEND = (
    "copies: D2H tag = after its tag, start = as its layer starts, k+1 = as layer k+1 starts; "
    "H2D bwd = as its layer's backward starts, k+1 bwd = as layer k+1's backward starts; upd = the update's"
)


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """The schedule's table at the console's width: one row per tensor with its copy timings in
    words where it fits; else the layer groups as heading rows and the timings in short words (a
    legend in the caption), so it fits 80 columns. No tensor name is ever cut: a user types them
    (`offload.tensors.NAME=...`)."""

    schedule: TransferSchedule

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.measure import Measurement

        wide = _wide_table(self.schedule)
        if Measurement.get(console, options.update_width(10**6), wide).maximum <= options.max_width:
            yield wide
        else:
            yield _stacked_table(self.schedule)


def _group_rows(group: LayerGroup) -> list[tuple[str, ...]]:
    """(layers, tensor, shape, dtype, bytes, placement, fwd, bwd) of a group's tensors; layers on the first."""
    label = f"{group.name} x{group.num_layers}"
    return [
        (label if i == 0 else "", r.name, "x".join(map(str, r.shape)), r.dtype, format_bytes(r.bytes_per_device))
        + (r.placement, r.forward, r.backward)
        for i, r in enumerate(group.residuals)
    ]


def _state_rows(schedule: TransferSchedule) -> list[tuple[str, ...]]:
    """The train state's copies, when the update streams it: in, updated, back, a layer at a time."""
    return [
        (f"{c.group} x{c.num_layers}", c.tensor, "", "float32", format_bytes(c.bytes_per_layer), "host")
        + ("upd H2D", "upd D2H")
        for c in schedule.state
    ]


def _wide_table(schedule: TransferSchedule) -> Table:
    table = Table(title=f"offload schedule: {schedule.policy_name} (per layer, per device)")
    for column in ("layers", "tensor", "shape", "dtype", "bytes", "placement", "fwd", "bwd"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for group in schedule.groups:
        for row in _group_rows(group):
            table.add_row(*row)
        table.add_section()
    for row in _state_rows(schedule):
        table.add_row(*row)
    table.caption = _caption(schedule)
    return table


def _stacked_table(schedule: TransferSchedule) -> Table:
    from rich import box
    from rich.text import Text

    title = f"offload schedule: {schedule.policy_name} (per layer, per device)"
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    rows = [row for group in schedule.groups for row in _group_rows(group)] + _state_rows(schedule)
    names = [row[1] for row in rows]
    table.add_column("tensor", no_wrap=True, min_width=max(map(len, names), default=6))
    table.add_column("shape", overflow="fold")
    table.add_column("dtype", overflow="fold")
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("placement", no_wrap=True)
    table.add_column("copies")
    for label, name, shape, dtype, size, placement, forward, backward in rows:
        if label:
            table.add_row(Text(f"{label} layers", style="bold"))
        copies = "-" if forward == "-" else f"{_SHORT.get(forward, forward)}, {_SHORT.get(backward, backward)}"
        table.add_row(name, shape, dtype, size, placement, copies)
    table.caption = _caption(schedule) + "; " + _LEGEND
    return table


def _caption(schedule: TransferSchedule) -> str:
    """The per-step totals, and what the pipeline, peeling and the train state add."""
    t = schedule.totals()
    caption = (
        f"per step ({t['micro_steps']} micro x {t['num_layers']} layers): "
        f"D2H {format_bytes(t['device_to_host_bytes_per_step'])}, "
        f"H2D {format_bytes(t['host_to_device_bytes_per_step'])}, "
        f"kept in HBM per micro step {format_bytes(t['device_residual_bytes_per_step'])}, "
        f"HBM saved vs save_all {format_bytes(t['hbm_bytes_saved_vs_save_all'])}"
    )
    if schedule.pipeline_bytes:
        caption += (
            f"; pipelined: each stack's last layer of offloaded values stays in HBM "
            f"({format_bytes(schedule.pipeline_bytes)}), one more layer's in flight while a stack runs"
        )
    if peeled := [f"{g.name}: the first and the last {g.peeled}" for g in schedule.groups if g.peeled]:
        caption += (
            f"; peeled ({', '.join(peeled)} layers outside the loop): no placeholder crosses the link, and "
            "the copies of the layers outside the loop are not bound to one layer"
        )
    if schedule.state:
        caption += f"; train state in pinned host {format_bytes(schedule.state_host_bytes)}, each way per step"
    return caption
