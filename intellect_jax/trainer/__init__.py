"""intellect_jax.trainer: the single-node inner loop (step, optimizer, checkpoints, metrics)."""
