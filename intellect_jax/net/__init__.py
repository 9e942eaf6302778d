"""intellect_jax.net."""
