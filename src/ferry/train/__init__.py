"""The train step and its state: the configs of the `train` and `offload` groups, the optimizer,
where the state lives (`state_memory`), the one jitted step and its FLOPs. A run's lifecycle
around the step (checks, run directory, checkpoints, the loop) is `ferry.run`."""
