"""Inner optimizer: AdamW + global-norm clipping, with WSD-sqrt / cosine / linear schedules."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
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
