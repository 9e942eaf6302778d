"""intellect_jax.kernels: GPU kernels (Triton, through jax-triton; optional, guarded imports)."""
