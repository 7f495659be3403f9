"""Training: loss, optimizer, sharded state, step, checkpoints, metrics, loop."""
