"""Inner optimizer: AdamW + global-norm clipping, with WSD-sqrt / cosine / linear schedules, and
the envelope of the states an honest one can hold (:func:`adam_envelope`)."""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat


class OptimConfig(BaseModel):
    """AdamW hyperparameters (INTELLECT-1 defaults) and the learning-rate schedule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: PositiveFloat = 7.5e-5
    schedule: Literal["wsd-sqrt", "cosine", "linear", "constant"] = "wsd-sqrt"
    warmup_steps: NonNegativeInt = 1000
    decay_steps: NonNegativeInt | None = None  # wsd-sqrt cooldown length; default 10% of total
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)  # floor of cosine/linear/wsd decay
    b1: float = Field(0.9, ge=0.0, lt=1.0)
    b2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.1
    clip_norm: NonNegativeFloat = 1.0  # 0 disables clipping
    z_loss_weight: NonNegativeFloat = 2e-4


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """lr(step). WSD-sqrt: linear warmup, flat, then lr x (1 - sqrt(progress)) over the cooldown."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warm = min(cfg.warmup_steps, total_steps)

    def warmup(step):
        return peak * jnp.minimum(1.0, (step + 1) / jnp.maximum(warm, 1))

    if cfg.schedule == "constant":
        return lambda step: jnp.where(step < warm, warmup(step), peak)

    if cfg.schedule == "wsd-sqrt":
        decay = cfg.decay_steps if cfg.decay_steps is not None else max(1, total_steps // 10)
        decay = max(1, min(decay, total_steps - warm))
        start = total_steps - decay

        def wsd(step):
            frac = jnp.clip((step - start) / decay, 0.0, 1.0)
            after = floor + (peak - floor) * (1.0 - jnp.sqrt(frac))
            return jnp.where(step < warm, warmup(step), jnp.where(step < start, peak, after))

        return wsd

    span = max(1, total_steps - warm)

    def decayed(step):
        frac = jnp.clip((step - warm) / span, 0.0, 1.0)
        if cfg.schedule == "cosine":
            shape = 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        else:
            shape = 1.0 - frac
        return jnp.where(step < warm, warmup(step), floor + (peak - floor) * shape)

    return decayed


def _decay_mask(params):
    """Weight decay on matrices only (not on RMSNorm scales)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_tx(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW's update *direction* (clipping, Adam moments, decoupled weight decay), before the
    learning rate: the train step scales it by ``-lr(step)`` of the train state's own step. So
    the schedule follows the step a state carries (a resumed node's, a joiner's whose optimizer
    state was taken some steps later, a node that re-registers with an older outer state), not
    a counter hidden in the optimizer state. Adam's bias-correction count stays with its moments."""
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts += [optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
              optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask)]
    return optax.chain(*parts)


CHUNK = 1 << 22  # elements per slice of a leaf that adam_envelope checks at once


def adam_envelope(opt_state: Any, cfg: OptimConfig, slack: float = 0.01) -> str | None:
    """Why an inner optimizer state of :func:`make_tx` (received from a peer: a joiner's donor)
    is none that an honest AdamW of ``cfg`` can hold; None if it could be.

    Honest Adam moments obey, whatever the gradients were (``c``: the state's step count):
    ``nu >= 0``; ``|mu| <= K(c) sqrt(nu)`` elementwise with
    ``K(c) = (1 - b1) sqrt(sum_{j<c} (b1^2/b2)^j / (1 - b2))`` (Cauchy-Schwarz over the two
    moving averages); and with global-norm clipping at ``C``, ``sum(nu) <= C^2`` and
    ``||mu|| <= C`` (averages of gradients of norm at most ``C``). Within them, the next update
    ``mu_hat / (sqrt(nu_hat) + eps)`` is no larger per element than an honest one can be, so a
    donor's moments steer a joiner's first inner steps no further than its own honest training
    might. ``slack`` (relative) covers rounding; every value must be finite.
    """
    for path, x in jax.tree_util.tree_leaves_with_path(opt_state):
        a = np.asarray(x)
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return f"non-finite values in the inner optimizer state at {jax.tree_util.keystr(path)}"
    adams = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    if len(adams) != 1:
        return f"{len(adams)} Adam states in the inner optimizer state, not 1"
    (adam,) = adams
    c = int(np.asarray(adam.count))
    if not 0 <= c < 2**31 - 1:
        return f"an Adam step count of {c}"
    r = cfg.b1**2 / cfg.b2
    try:
        terms = float(c) if r == 1 else (1 - r**c) / (1 - r)
    except OverflowError:
        terms = math.inf
    k = (1 - cfg.b1) * math.sqrt(terms / (1 - cfg.b2)) * (1 + slack)
    tiny = 1e-6 * cfg.eps  # moments of gradients so small that nu underflows (their update is ~0)
    sum_nu = sum_mu2 = 0.0
    for (path, mu), nu in zip(jax.tree_util.tree_leaves_with_path(adam.mu), jax.tree.leaves(adam.nu), strict=True):
        where, m_all, v_all = jax.tree_util.keystr(path), np.asarray(mu).reshape(-1), np.asarray(nu).reshape(-1)
        for i in range(0, m_all.size, CHUNK):  # bounded temporaries, whatever the leaf's size
            m, v = m_all[i : i + CHUNK].astype(np.float32), v_all[i : i + CHUNK].astype(np.float32)
            if (v < 0).any():
                return f"negative Adam second moments at {where}"
            if k < math.inf and (np.abs(m) > k * np.sqrt(v) + tiny).any():
                return f"Adam first moments at {where} beyond {k:.3g} x sqrt(second moment) (step count {c})"
            sum_nu += float(v.sum(dtype=np.float64))
            sum_mu2 += float(np.dot(m.astype(np.float64), m.astype(np.float64)))
    bound = cfg.clip_norm * (1 + slack)
    if cfg.clip_norm > 0 and (sum_nu > bound**2 or math.sqrt(sum_mu2) > bound):
        return (f"Adam moments of gradients beyond the clip norm {cfg.clip_norm} (sum of second moments "
                f"{sum_nu:.3g}, norm of first moments {math.sqrt(sum_mu2):.3g})")
    return None
