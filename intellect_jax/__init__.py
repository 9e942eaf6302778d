"""intellect_jax: decentralized, fault-tolerant DiLoCo training of Llama-3 models in JAX/Flax."""

__version__ = "0.1.0"
