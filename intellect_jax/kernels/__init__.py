"""intellect_jax.kernels."""
