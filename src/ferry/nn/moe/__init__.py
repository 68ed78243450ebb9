"""DeepSeekMoE as a package, one job per module: `routing` (the router and its balance loss),
`tiled` and `megablox` (grouped matmuls with their own backward passes), `dispatch` (the
expert-sorted slots, their windows and the grouped matmul over them), `experts` (the routed SwiGLU),
`parallel` (per-device routing and the expert-parallel ring) and `layer` (the module)."""

from ferry.nn.moe.dispatch import (
    Dispatch,
    capacity_per_expert,
    combine,
    combine_windows,
    dispatch,
    grouped_matmul,
    tagged_row_count,
    tagged_windows,
)
from ferry.nn.moe.experts import Experts, Matmul, expert_ffn, routed_experts
from ferry.nn.moe.layer import DeepSeekMoE, MoEStats, dropless_moe
from ferry.nn.moe.megablox import megablox_matmul
from ferry.nn.moe.parallel import expert_parallel_moe, per_device_experts, per_device_tokens
from ferry.nn.moe.routing import route, sequence_balance_loss
from ferry.nn.moe.tiled import TileLayout, gather_rows, tile_layout, tiled_matmul

__all__ = [
    "DeepSeekMoE",
    "Dispatch",
    "Experts",
    "Matmul",
    "MoEStats",
    "TileLayout",
    "capacity_per_expert",
    "combine",
    "combine_windows",
    "dispatch",
    "dropless_moe",
    "expert_ffn",
    "expert_parallel_moe",
    "gather_rows",
    "grouped_matmul",
    "megablox_matmul",
    "per_device_experts",
    "per_device_tokens",
    "route",
    "routed_experts",
    "sequence_balance_loss",
    "tagged_row_count",
    "tagged_windows",
    "tile_layout",
    "tiled_matmul",
]
