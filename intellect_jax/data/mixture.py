"""Weighted mixture of infinite sources as a stateless, random-access grain selection map.

The global window stream is cut into periods of ``T = sum(counts)`` (about
``MIX_RESOLUTION``) slots; every period holds exactly ``counts[s]`` slots of source ``s``,
placed by a permutation seeded with ``(seed, period)``. Source ``s``'s slots take its
elements in order (its k-th slot overall is its element k), so each source's own stream
(e.g. shuffled epochs) is consumed sequentially. The mixture matches the weights to within
``1/T`` at every period boundary, looks random within a period, and position
``g -> (source, index within source)`` is O(1) (no state: exact resume is trivial).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence

import grain
import numpy as np

from .errors import DataError

MIX_RESOLUTION = 1000


def mixture_counts(
    weights: Sequence[float], names: Sequence[str] | None = None, resolution: int = MIX_RESOLUTION
) -> tuple[int, ...]:
    """Integer per-period counts proportional to ``weights`` (each >= 1)."""
    names = list(names) if names is not None else [f"#{i}" for i in range(len(weights))]
    if not weights:
        raise DataError("mixture has no sources")
    for w, n in zip(weights, names):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
            raise DataError(
                f"mixture weight of source {n!r} must be a finite number > 0, got {w!r}"
            )
    total = float(sum(weights))
    return tuple(max(1, round(resolution * w / total)) for w in weights)


@functools.lru_cache(maxsize=8)
def _period_slots(seed: int, counts: tuple[int, ...], q: int) -> tuple[np.ndarray, np.ndarray]:
    """Period ``q``'s slot -> source and slot -> rank among that source's slots."""
    rng = np.random.default_rng([seed, q, 0x6D6978])
    source = rng.permutation(np.repeat(np.arange(len(counts)), counts))
    order = np.argsort(source, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(len(source), np.int64)
    rank[order] = np.arange(len(source)) - starts[source[order]]
    return source, rank


class MixtureMap(grain.transforms.DatasetSelectionMap):
    """Infinite selection map ``g -> (source, k)``: the k-th element of source's stream."""

    def __init__(self, counts: Sequence[int], seed: int):
        self.counts = tuple(int(c) for c in counts)
        self.period = sum(self.counts)
        self.seed = int(seed)

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> tuple[int, int]:
        q, r = divmod(int(index), self.period)
        source, rank = _period_slots(self.seed, self.counts, q)
        s = int(source[r])
        return s, q * self.counts[s] + int(rank[r])

    def __repr__(self) -> str:
        return f"MixtureMap(counts={self.counts}, seed={self.seed})"


def mix(
    datasets: Sequence[grain.MapDataset],
    weights: Sequence[float],
    seed: int,
    names: Sequence[str] | None = None,
) -> grain.MapDataset:
    """Mix infinite ``MapDataset``s by weight (a single dataset is returned unchanged)."""
    counts = mixture_counts(weights, names)
    if len(datasets) == 1:
        return datasets[0]
    return grain.MapDataset.select_from_datasets(list(datasets), MixtureMap(counts, seed))
