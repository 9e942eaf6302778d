"""A node spanning several host processes: JAX's own runtime (`jax.distributed`)."""

from __future__ import annotations

import jax

from intellect_jax.config import DistConfig, RunConfig


MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def setup_runtime(run: RunConfig, dist: DistConfig) -> None:
    """Process-wide JAX setup, before any computation: GPU allocator share, compilation cache,
    multi-host runtime."""
    set_mem_fraction(run.gpu_mem_fraction)
    if run.compile_cache and not jax.config.jax_compilation_cache_dir:
        import os

        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(run.compile_cache))
    maybe_initialize(dist)


def maybe_initialize(cfg: DistConfig) -> None:
    """Join the node's processes into one runtime (one global mesh over all their devices)."""
    if cfg.num_processes == 1:
        return
    if not cfg.coordinator_address:
        raise ValueError("dist.coordinator_address is required when dist.num_processes > 1")
    if cfg.process_id >= cfg.num_processes:
        raise ValueError(f"dist.process_id ({cfg.process_id}) must be < dist.num_processes ({cfg.num_processes})")
    jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id, heartbeat_timeout_seconds=cfg.heartbeat_timeout)


def set_mem_fraction(fraction: float) -> float:
    """The share of each GPU's memory JAX's allocator takes when the GPU backend starts (it reads
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` then, so this must come before the first computation). A
    value already in the environment wins (the operator's); returns the share in effect."""
    import os

    os.environ.setdefault(MEM_FRACTION_ENV, f"{fraction:g}")
    return mem_fraction(fraction)


def mem_fraction(default: float) -> float:
    """The share in effect: the environment's, else ``default``; no side effect. Above 1 is the
    operator's to choose (unified memory, ``TF_FORCE_UNIFIED_MEMORY``); 0 or less, or not a
    number, is a one-line error."""
    import os

    from intellect_jax.model.config import ConfigError

    raw = os.environ.get(MEM_FRACTION_ENV)
    try:
        f = default if raw is None else float(raw)
    except ValueError:
        raise ConfigError(f"{MEM_FRACTION_ENV}={raw!r} is not a number") from None
    if not f > 0:
        raise ConfigError(f"{MEM_FRACTION_ENV}={raw!r}: a share above 0")
    return f
