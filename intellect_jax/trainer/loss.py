"""Next-token cross-entropy with INTELLECT-1's max-z-loss auxiliary term."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lm_loss(
    logits_BxLxV: jax.Array, targets_BxL: jax.Array, z_weight: float = 0.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy + z_weight x mean(max logit ** 2), all in float32.

    Returns (total, {"ce": ..., "z": ...}) where z is the unweighted mean squared max logit.
    """
    logits = logits_BxLxV.astype(jnp.float32)
    lse_BxL = jax.nn.logsumexp(logits, axis=-1)
    tgt_BxL = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
    ce = jnp.mean(lse_BxL - tgt_BxL)
    z = jnp.mean(jnp.square(jnp.max(logits, axis=-1)))
    return ce + z_weight * z, {"ce": ce, "z": z}
