"""Compiling for GPUs this machine does not have: JAX's compile-only topologies (the ``[aot]`` extra)."""
