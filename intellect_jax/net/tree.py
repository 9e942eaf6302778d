"""Pytrees of float32 arrays <-> flat buckets for the ring.

Leaves are grouped, in order, into buckets of at most ``bucket_numel`` elements (a
larger leaf is a bucket of its own and is used without a copy); each bucket is one flat
ring all-reduce. jax is imported only when the input is not a plain numpy array.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np


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
