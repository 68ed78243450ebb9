"""The offload engine: tag activations by name, and place each tagged residual of a decoder layer
in HBM, in pinned host memory or nowhere (recomputed), by a `Policy` a user can read and change.

- `tags`: `tag(x, name)` and the trace-time context that records or injects tagged values;
- `policy`: `Policy`, the name -> placement table, and its errors;
- `engine`: `offloaded(fn, policy)`, the custom VJP around one layer that moves the residuals;
- `scan`: `offloaded_scan`, the same for a stack of layers in one `lax.scan`, its copies pipelined;
- `schedule`: the transfer schedule a model and a policy give, printed before a run starts.
"""

from ferry.offload.engine import offloaded
from ferry.offload.policy import LAYER_INPUT, PLACEMENTS, SAVE_ALL, Placement, Policy, PolicyError
from ferry.offload.scan import offloaded_scan
from ferry.offload.schedule import TransferSchedule, model_schedule, schedule_table, transfer_schedule
from ferry.offload.tags import tag, tagged_names

__all__ = [
    "LAYER_INPUT",
    "PLACEMENTS",
    "SAVE_ALL",
    "Placement",
    "Policy",
    "PolicyError",
    "TransferSchedule",
    "model_schedule",
    "offloaded",
    "offloaded_scan",
    "schedule_table",
    "tag",
    "tagged_names",
    "transfer_schedule",
]
