"""intellect_jax.data."""
