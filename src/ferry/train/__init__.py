"""Training: config, optimizer, loss, the one jitted step, and the loop."""
