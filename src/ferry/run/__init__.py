"""A training run's lifecycle around the step (`ferry.train`): its checks before start
(`preflight`), run directory, lock and checkpoints, the step loop, loggers and meter, preemption
and the process's exit. `training.train` runs one."""
