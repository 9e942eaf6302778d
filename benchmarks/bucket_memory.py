"""Host memory of reducing a tree of several buckets (a script, not a test).

    python benchmarks/bucket_memory.py [--leaves 128 --leaf 65536 --bucket 1048576]

``comm.reduce_tree`` either reduces one bucket after another (``reduce_flat``: the ring and the
all-gather; a bucket of several leaves is gathered into one array) or every bucket in one call
(``reduce_all``: the butterfly, whose every bucket's pieces go out before any aggregate; buckets
are views of the leaves, ``tree.Flat``, and results go straight into ``out``). Both run here with
a stand-in reducer that reads and writes piece by piece, as the butterfly does, with and without
``out``; prints the peak of Python's allocations (tracemalloc) for each, in MiB, beside the
tree's size. The exchange's own buffers (pieces, rows, aggregates) are not counted: see
docs/net.md for what a butterfly call holds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from intellect_jax.net import RingConfig  # noqa: E402
from intellect_jax.net.comm import reduce_tree  # noqa: E402
from intellect_jax.net.tree import Flat  # noqa: E402

PIECE = 1 << 14


def _per_bucket(x: np.ndarray, _: int, o: np.ndarray | None, __: object) -> np.ndarray:
    o = np.empty(x.shape[0], np.float32) if o is None else o
    for a in range(0, x.shape[0], PIECE):
        o[a:a + PIECE] = x[a:a + PIECE]
    return o


def _all(xs: list, _: list[int], outs: list) -> list:
    res = []
    for x, o in zip(xs, outs):
        o = np.empty(x.shape[0], np.float32) if o is None else o
        for a in range(0, x.shape[0], PIECE):
            piece = x[a:a + PIECE]
            if isinstance(o, Flat):
                o.put(a, piece)
            else:
                o[a:a + piece.shape[0]] = piece
        res.append(o)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leaves", type=int, default=128)
    ap.add_argument("--leaf", type=int, default=1 << 16, help="values per leaf")
    ap.add_argument("--bucket", type=int, default=1 << 20, help="bucket_numel")
    a = ap.parse_args()
    importlib.import_module("jax")  # (flattening a dict imports it: here, before the count)

    tree = {f"l{i:04d}": np.ones(a.leaf, np.float32) for i in range(a.leaves)}
    cfg = RingConfig(exchange="butterfly", bucket_numel=a.bucket)
    report = {"tree_mib": round(a.leaves * a.leaf * 4 / 2**20, 1), "buckets": -(-a.leaves * a.leaf // a.bucket)}
    for name, kw in (("one_bucket_at_a_time", {"reduce_flat": _per_bucket}),
                     ("every_bucket_at_once", {"reduce_flat": None, "reduce_all": _all})):
        for with_out in (False, True):
            out = {k: np.empty_like(v) for k, v in tree.items()} if with_out else None
            tracemalloc.start()
            reduce_tree(tree, cfg, out=out, **kw)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            report[f"{name}_{'out' if with_out else 'no_out'}_peak_mib"] = round(peak / 2**20, 1)
            print(f"{name:22s} {'with out' if with_out else 'no out  '}: peak {peak / 2**20:7.1f} MiB")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
