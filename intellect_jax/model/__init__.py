"""intellect_jax.model."""
