"""intellect_jax.model: the Llama-3 model (NNX), its typed config, sharding rules and Hugging Face interop."""
