"""Pytrees of float32 arrays <-> flat buckets for the ring.

Leaves are grouped, in order, into buckets of at most ``bucket_numel`` elements (a
larger leaf is a bucket of its own and is used without a copy); each bucket is one flat
ring all-reduce. jax is imported only when the input is not a plain numpy array.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Any, Callable

import numpy as np
from numpy.lib.array_utils import byte_bounds


def flatten(tree: Any) -> tuple[list[np.ndarray], Callable[[list[np.ndarray]], Any], str]:
    """Leaves as float32 numpy arrays, a rebuild function, and a structure signature."""
    if isinstance(tree, np.ndarray):
        leaves, rebuild, structure = [tree], (lambda ls: ls[0]), "array"
    else:
        from jax import tree_util

        raw, treedef = tree_util.tree_flatten(tree)
        leaves = [np.asarray(leaf) for leaf in raw]
        rebuild, structure = (lambda ls: tree_util.tree_unflatten(treedef, ls)), str(treedef)
    for i, leaf in enumerate(leaves):
        if leaf.dtype != np.float32:
            raise TypeError(f"all_reduce_mean takes float32 leaves; leaf {i} has dtype {leaf.dtype}")
    shapes = ";".join(",".join(map(str, leaf.shape)) for leaf in leaves)
    sig = hashlib.sha256(f"{structure}|{shapes}".encode()).hexdigest()[:16]
    return leaves, rebuild, sig


def make_buckets(sizes: list[int], bucket_numel: int) -> list[list[int]]:
    """Group consecutive leaf indices into buckets of at most ``bucket_numel`` elements."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if cur and total + n > bucket_numel:
            buckets.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        buckets.append(cur)
    return buckets


def gather(leaves: list[np.ndarray], idx: list[int]) -> np.ndarray:
    """One flat float32 vector of the given leaves (a view when possible)."""
    if len(idx) == 1:
        return np.ascontiguousarray(leaves[idx[0]]).reshape(-1)
    return np.concatenate([leaves[i].reshape(-1) for i in idx])


def scatter(flat: np.ndarray, leaves: list[np.ndarray], idx: list[int]) -> list[np.ndarray]:
    """Split a reduced bucket back into arrays shaped like the given leaves (views)."""
    out, off = [], 0
    for i in idx:
        n = leaves[i].size
        out.append(flat[off : off + n].reshape(leaves[i].shape))
        off += n
    return out


class Flat:
    """Several flat float32 arrays seen as one vector, without a copy: ``shape``, ``x[a:b]`` (a
    view when the range lies in one array, else a copy of it) and ``put(a, values)`` (written
    through to the arrays). A butterfly call holds every bucket at once, and a bucket of several
    leaves gathered into one array would copy the whole model (:func:`view`)."""

    ndim, dtype = 1, np.dtype(np.float32)

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.starts = [0]
        for x in parts:
            self.starts.append(self.starts[-1] + x.shape[0])
        self.shape = (self.starts[-1],)

    def _spans(self, a: int, b: int):  # noqa: ANN202 - (array, its start, its stop) for each part [a, b) touches
        i = bisect.bisect_right(self.starts, a) - 1
        while a < b:
            x, s = self.parts[i], self.starts[i]
            e = min(b, s + x.shape[0])
            if e > a:
                yield x, a - s, e - s
            a, i = max(a, e), i + 1

    def __getitem__(self, key: slice) -> np.ndarray:
        a, b, step = key.indices(self.shape[0])
        if step != 1:
            raise ValueError("a Flat is sliced in ranges, without a step")
        spans = list(self._spans(a, b))
        if len(spans) == 1:
            x, s, e = spans[0]
            return x[s:e]
        return np.concatenate([x[s:e] for x, s, e in spans]) if spans else np.empty(0, np.float32)

    def put(self, a: int, values: np.ndarray) -> None:
        if not 0 <= a <= a + values.shape[0] <= self.shape[0]:
            raise ValueError(f"{values.shape[0]} values at {a} do not fit in {self.shape[0]}")
        off = 0
        for x, s, e in self._spans(a, a + values.shape[0]):
            x[s:e] = values[off:off + e - s]
            off += e - s


def view(leaves: list[np.ndarray], idx: list[int]) -> np.ndarray | Flat:
    """The given leaves as one flat vector without a copy: the leaf itself (flat) if it is one,
    else a :class:`Flat` over them (C-contiguous leaves)."""
    flat = [np.ascontiguousarray(leaves[i]).reshape(-1) for i in idx]
    return flat[0] if len(flat) == 1 else Flat(flat)


def overlaps(a: list[np.ndarray | Flat], b: list[np.ndarray | Flat]) -> bool:
    """Whether any vector of ``a`` may share memory with any of ``b`` (arrays or :class:`Flat`;
    their byte bounds, as ``np.may_share_memory`` takes them), in one sweep over them sorted."""
    spans = sorted((*byte_bounds(x), side) for side, vs in enumerate((a, b)) for v in vs
                   for x in getattr(v, "parts", [v]) if x.size)
    reach = [-1, -1]  # the furthest end of each side's spans so far
    for lo, hi, side in spans:
        if lo < reach[1 - side]:
            return True
        reach[side] = max(reach[side], hi)
    return False
