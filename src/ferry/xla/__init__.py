"""The XLA floor: compile targets and hardware facts, the HLO a compile emits read back (FLOPs,
collectives, host copies), the scheduler's cost model and its profile hand-off, XLA flags, and
the compile-time OOM. It imports nothing from `ferry.plan` or `ferry.train`."""
