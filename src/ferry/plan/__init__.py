"""Planning a run for hardware this machine does not have: compile the real train step for a
GPU target with XLA's compile-only devices and read its memory."""
