"""Robust aggregation of one segment's contributions: what a segment's owner sends back.

In a butterfly exchange each segment of the pseudo-gradient has an owner that receives every
member's own piece of it (rows in rank order) and returns one aggregate. The plain mean lets a
single member steer it anywhere (send ``-(N-1)`` times its honest piece and the honest part
cancels; two such members reverse it); these aggregators bound each member's influence by this
round's rows alone, so no bound can be ratcheted up over rounds:

=========  ==================================================================================
mean       the plain mean (what the ring computes today)
clip       each row scaled down to at most ``factor`` x the (lower) median row norm of this
           round, then the mean
trim<k>    coordinate-wise trimmed mean: the ``k`` largest and ``k`` smallest values of each
           coordinate dropped (the median when fewer than ``2k + 1`` rows are left)
cclip      a variant of CenteredClip (Karimireddy, He & Jaggi 2021; the aggregator of hivemind's
           BTARD): ``iters`` steps (three: one step, 2.6x cheaper and within 0.01 of three on
           every cosine of ``benchmarks/robust_aggregation.py``, let two sign flippers of 8
           cost the real debug model 2.3% where three steps cost 1.7%) of ``v +=
           mean(clip(x_i - v, tau))`` from the coordinate-wise median (not from the previous round's aggregate, as
           the paper's momentum does: it sees one round), ``tau`` = ``factor`` x the (lower)
           median distance to ``v``
=========  ==================================================================================

A row that is not the segment's length, or has a value that is not finite (as float32), is
dropped by every aggregator (its sender's signed piece is the evidence against it). Each
aggregator is deterministic given the rows in rank order: float32 elementwise arithmetic in a
fixed order, row norms as float32 pairwise sums of squares (numpy's order, fixed whatever the
CPU; a row whose squares overflow has an infinite norm and weight 0), medians of
sorted values whose zeros are made +0 (a sort may place -0 and +0 either way), so a verifier
that recomputes an owner's aggregate from the same rows gets the same bits. The medians are
lower medians: with an even number of rows, half of them large cannot lift a bound.
:func:`aggregate` also reports each row's weight: 0 if dropped; for ``clip`` and ``cclip`` the
scale it got (the last step's for ``cclip``; with ``factor`` 1 about half the honest rows are
scaled a little every round, so a weight below 1 is no evidence against anyone); 1 otherwise.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from intellect_jax.net import quant

Scratch = Callable[..., np.ndarray]  # (name, n, dtype=float32) -> a reused array of >= n elements (Workspace.scratch)
DEFAULT_FACTOR = 1.0  # clip / cclip: the bound in units of this round's median (row norm or distance)
CCLIP_ITERS = 3


@dataclass(frozen=True)
class Aggregated:
    """The aggregate (float32) and each row's weight in it (rank order; 0: dropped)."""

    value: np.ndarray
    weights: tuple[float, ...]


_local = threading.local()


def _own_scratch(name: str, n: int, dtype: type = np.float32) -> np.ndarray:
    """The calling thread's scratch arrays (kept for its next aggregation)."""
    bufs: dict[str, np.ndarray] = _local.__dict__.setdefault("bufs", {})
    a = bufs.get(name)
    if a is None or a.shape[0] < n or a.dtype != dtype:
        a = bufs[name] = np.empty(n, dtype)
    return a


def _row(scratch: Scratch, name: str, n: int, dtype: type = np.float32) -> np.ndarray:
    return scratch(f"robust.{name}", n, dtype)[:n]


def norm(x: np.ndarray) -> float:
    """L2 norm as a float64 pairwise sum (the same bits on any CPU; inf if not finite): for
    checks outside the aggregators, which take :func:`_norm32`."""
    a64 = np.asarray(x, np.float32).astype(np.float64)
    return math.sqrt(float(np.add.reduce(np.square(a64, out=a64))))


def _norm32(x: np.ndarray, scratch: Scratch) -> float:
    """A flat float32 row's L2 norm as the aggregators take it: its squares summed pairwise in
    float32 (half the passes of :func:`norm`'s float64 copy; inf if they overflow)."""
    sq = _row(scratch, "square", x.shape[0])
    with np.errstate(over="ignore"):
        np.square(x, out=sq)
        return math.sqrt(float(np.add.reduce(sq)))


def _ordered_sum(rows: Sequence[np.ndarray], coefs: Sequence[float] | None, scratch: Scratch) -> np.ndarray:
    """sum_i c_i x_i in float32, in the rows' order (elementwise: exact per operation), into a
    scratch row. Every step writes in place: a fresh array per step costs more than its
    arithmetic here (its pages are new each time: page faults)."""
    n = rows[0].shape[0]
    acc, tmp = _row(scratch, "acc", n), _row(scratch, "tmp", n)
    acc[...] = 0
    for i, x in enumerate(rows):
        if coefs is None or coefs[i] == 1.0:
            acc += x
        elif coefs[i] != 0.0:
            acc += np.multiply(x, np.float32(coefs[i]), out=tmp)
    return acc


def _scale(n: float, bound: float) -> float:
    return 1.0 if n <= bound else (bound / n if n > 0 else 1.0)


def _median(values: Sequence[float]) -> float:
    """The lower median (attackers with large values cannot lift it while most rows are honest)."""
    return sorted(values)[(len(values) - 1) // 2]


def mean(rows: Sequence[np.ndarray], scratch: Scratch) -> np.ndarray:
    acc = _ordered_sum(rows, None, scratch)
    return np.divide(acc, np.float32(len(rows)), out=acc)


def clip(rows: Sequence[np.ndarray], factor: float, scratch: Scratch) -> tuple[np.ndarray, list[float]]:
    norms = [_norm32(x, scratch) for x in rows]
    bound = factor * _median(norms)
    w = [_scale(n, bound) for n in norms]
    acc = _ordered_sum(rows, w, scratch)
    return np.divide(acc, np.float32(len(rows)), out=acc), w


@functools.lru_cache(maxsize=64)
def _network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort for ``n`` wires: the comparators (i < j) of the network for
    the next power of two, less those touching a wire >= n (as if padded with +inf rows, which
    no comparator moves)."""
    m, pairs, p = 1 << max(0, (n - 1).bit_length()), [], 1
    while p < m:
        k = p
        while k >= 1:
            for j in range(k % p, m - k, 2 * k):
                for i in range(min(k, m - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def _sorted(rows: Sequence[np.ndarray], scratch: Scratch) -> list[np.ndarray]:
    """The rows sorted coordinate-wise (finite float32 rows) in scratch rows: a sorting network
    of elementwise min and max, many times faster than sorting each coordinate's few values on
    its own."""
    n = rows[0].shape[0]
    s = [_row(scratch, f"sort{i}", n) for i in range(len(rows))]
    for d, x in zip(s, rows):
        np.copyto(d, x)
    tmp = _row(scratch, "sort", n)
    for i, j in _network(len(s)):
        lo = np.minimum(s[i], s[j], out=tmp)
        np.maximum(s[i], s[j], out=s[j])
        tmp, s[i] = s[i], lo
    for x in s:
        x += np.float32(0)  # -0 becomes +0: which of -0 and +0 a comparator keeps is not defined
    return s


def _middle(s: Sequence[np.ndarray], scratch: Scratch) -> np.ndarray:
    """The coordinate-wise median of rows sorted along axis 0 (float32; np.median is 4x slower),
    in a scratch row."""
    n, half = len(s), np.float32(0.5)
    v = _row(scratch, "middle", s[0].shape[0])
    if n % 2:
        np.copyto(v, s[n // 2])
    else:  # (s[a] * half + s[b] * half, in place)
        np.multiply(s[n // 2 - 1], half, out=v)
        v += np.multiply(s[n // 2], half, out=_row(scratch, "tmp", v.shape[0]))
    return v


def trimmed_mean(rows: Sequence[np.ndarray], k: int, scratch: Scratch) -> np.ndarray:
    n = len(rows)
    s = _sorted(rows, scratch)
    if n - 2 * k < 1:
        return _middle(s, scratch)
    acc = _ordered_sum(s[k:n - k], None, scratch)
    return np.divide(acc, np.float32(n - 2 * k), out=acc)


def centered_clip(rows: Sequence[np.ndarray], factor: float, scratch: Scratch,
                  iters: int = CCLIP_ITERS) -> tuple[np.ndarray, list[float]]:
    s = _sorted(rows, scratch)
    v = _middle(s, scratch)
    diffs = s  # (the sorted rows' scratch, free once v is)
    w = [1.0] * len(rows)
    for _ in range(iters):
        for x, d in zip(rows, diffs):
            np.subtract(x, v, out=d)
        dists = [_norm32(d, scratch) for d in diffs]
        tau = factor * _median(dists)
        w = [_scale(d, tau) for d in dists]
        step = _ordered_sum(diffs, w, scratch)
        v += np.divide(step, np.float32(len(rows)), out=step)
    return v, w


MODES = ("mean", "clip", "trim<k>", "cclip")


def check_mode(mode: str) -> None:
    if mode in ("mean", "clip", "cclip") or re.fullmatch(r"trim[1-9][0-9]?", mode):
        return
    raise ValueError(f"aggregator {mode!r} is not one of mean, clip, trim<k> (k = 1..99), cclip")


def aggregate(rows: Sequence[np.ndarray], mode: str, numel: int, factor: float = DEFAULT_FACTOR,
              scratch: Scratch | None = None) -> Aggregated:
    """One segment's aggregate of ``rows`` (each member's own piece of the segment's ``numel``
    values, rank order, cast to float32). ``scratch`` (e.g. ``Workspace.scratch``): where its
    work rows come from, reused across calls; the value is one of them then, valid until the
    next call with the same scratch (without it: the thread's own, and the value a copy)."""
    if scratch is None:
        got = aggregate(rows, mode, numel, factor, _own_scratch)
        return Aggregated(got.value.copy(), got.weights)
    check_mode(mode)
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"the clipping factor must be finite and > 0, not {factor}")
    if not rows:
        raise ValueError("no rows to aggregate")
    with np.errstate(over="ignore"):  # (a float64 value beyond float32's range becomes inf: dropped)
        cast = [np.asarray(x, np.float32) for x in rows]
    good = [x.shape == (numel,) and bool(np.isfinite(x, out=_row(scratch, "finite", numel, np.bool_)).all())
            for x in cast]
    kept = [x for x, ok in zip(cast, good) if ok]
    if not kept:
        raise ValueError(f"no row has {numel} finite values")
    if mode == "mean":
        value, w = mean(kept, scratch), [1.0] * len(kept)
    elif mode == "clip":
        value, w = clip(kept, factor, scratch)
    elif mode == "cclip":
        value, w = centered_clip(kept, factor, scratch)
    else:
        value, w = trimmed_mean(kept, int(mode[4:]), scratch), [1.0] * len(kept)
    it = iter(w)
    return Aggregated(value, tuple(next(it) if ok else 0.0 for ok in good))


def aggregate_piece(rows: Sequence[np.ndarray], n: int, mode: str, block: int, how: str,
                    out: np.ndarray | None = None, absent: frozenset[int] = frozenset(),
                    scratch: Scratch | None = None) -> np.ndarray:
    """The owner's wire bytes for one piece from its decoded ``rows`` (rank order): the
    aggregate of the rows of the ranks not ``absent`` (sitting the round out), encoded once
    (zeros when no row is usable), into ``out`` if given (``scratch``: see :func:`aggregate`)."""
    try:
        value = aggregate([r for i, r in enumerate(rows) if i not in absent], how, n, scratch=scratch).value
    except ValueError:  # no row, or every row non-finite: nothing to apply
        value = np.zeros(n, np.float32)
    value = np.ascontiguousarray(value, np.float32)
    if mode == "fp32":
        out = np.empty(4 * n, np.uint8) if out is None else out
        np.copyto(out.view(np.float32), value)
        return out
    return quant.encode(value, mode, block, out)
