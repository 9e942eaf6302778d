"""Checks that keep a broken or poisoned pseudo-gradient out of the outer state.

Three lines of defence, all cheap next to the all-reduce:

* **Own check** (:class:`OwnGuard`): before contributing, a node checks its own
  pseudo-gradient: every value finite, its norm within ``factor`` x the median of its recent
  accepted norms. If it fails (a bf16 overflow, a bad host), the node contributes zeros and
  says so at the barrier; every member then divides the ring's sum by the number of nodes that
  did contribute, so the round's average is that of the healthy nodes.
* **Average check** (:func:`check_average`): before the outer step every node checks the
  average the same way against the norms of recent averages, which travel in the
  ``DilocoState`` (so a joiner decides like everyone else). Every node holds the same bits,
  so every node reaches the same verdict; a failing round is skipped (outer params and
  momentum unchanged), never applied.
* **Blame** (``net.evidence``): in a ring, a rank's first messages to its successor are its own
  contribution, unsummed and signed; the successor judges each against the outer params' RMS
  (non-finite, or above 10x) and reports a bad one, signed piece and all, with its next
  barrier. The coordinator re-checks the evidence and evicts a node found guilty in rounds
  whose average failed (see ``docs/security.md``).

Norms are summed in a fixed order (numpy's pairwise sum, not BLAS's CPU-dependent dot) and
rounded to 6 significant digits before they are compared or stored: they enter the state hash,
so every node must reach the same bits.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True)
class GuardConfig:
    factor: float = 10.0  # a norm above factor x the recent median fails
    history: int = 8  # recent norms kept
    min_history: int = 3  # no magnitude check before this many norms are known


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def tree_norm(tree: Any) -> float:
    """L2 norm over every leaf (float64 sums), rounded to 6 significant digits; inf if any value
    is not finite. The sums are numpy's pairwise ones, whose order is fixed (BLAS's dot picks
    its kernel, and so its order, by CPU): nodes on different CPUs get the same bits."""
    total = 0.0
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf, dtype=np.float32).reshape(-1)
        if not np.isfinite(a).all():
            return math.inf
        a64 = a.astype(np.float64)
        total += float(np.add.reduce(np.square(a64, out=a64)))
    return _round(math.sqrt(total))


def judge(norm: float, history: tuple[float, ...] | list[float], cfg: GuardConfig,
          scale: float | None = None) -> str | None:
    """Why a pseudo-gradient (or an average) of this norm must not be used (None: fine). Until
    ``min_history`` norms are known, the bound is ``factor`` x ``scale`` (the outer params' own
    norm: no sane outer step moves the weights by many times their whole size)."""
    if not math.isfinite(norm):
        return "non-finite values"
    if len(history) >= cfg.min_history:
        med = statistics.median(history)
        if med > 0 and norm > cfg.factor * med:
            return f"norm {norm:.4g} is {norm / med:.0f}x the recent median {med:.4g}"
    elif scale is not None and norm > cfg.factor * scale:
        return f"norm {norm:.4g} is {norm / scale:.0f}x the outer params' own norm {scale:.4g}"
    return None


def remember(history: tuple[float, ...], norm: float, cfg: GuardConfig) -> tuple[float, ...]:
    return (*history, norm)[-cfg.history:]


class OwnGuard:
    """A node's check of its own pseudo-gradients (its history stays local)."""

    def __init__(self, cfg: GuardConfig | None = None) -> None:
        self.cfg = cfg or GuardConfig()
        self.history: tuple[float, ...] = ()

    def check(self, pg: Any, scale: float | None = None) -> tuple[float, str | None]:
        """(norm, why it fails or None) of a host tree, or of anything with a ``norm()`` (a
        contribution held on the devices, :class:`~.device_codec.DeviceContribution`)."""
        from intellect_jax.diloco.device_codec import DeviceContribution

        norm = pg.norm() if isinstance(pg, DeviceContribution) else tree_norm(pg)
        why = judge(norm, self.history, self.cfg, scale)
        if why is None:
            self.history = remember(self.history, norm, self.cfg)
        return norm, why


def check_average(avg: Any, history: tuple[float, ...], cfg: GuardConfig,
                  scale: float | None = None) -> tuple[float, str | None]:
    norm = tree_norm(avg)
    return norm, judge(norm, history, cfg, scale)
