"""intellect_jax.diloco."""
