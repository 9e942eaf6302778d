"""How far honest rows stand from their piece's median on a real model (a script, not a test).

    python benchmarks/outsize_spread.py --mode int8 --exchange butterfly --robust cclip [--nodes 8 ...]

Runs ``benchmarks/diloco_sweep.py`` with the given arguments (real trainers of the debug model
in one process, the exchange's exact arithmetic) and, at every butterfly exchange, weighs every
row of every piece of every owner's segment as the owners do (``net.evidence.outsized``: the
row's norm over the high median of the rows the owner may show). With no attacker every row is
honest: the figures say how far below the eviction threshold (``evidence.OUTSIZE``) honest
training keeps. Prints the sweep's own output, then one JSON line: pieces weighed, rows, rows
above the threshold, senders above it in most pieces of a segment (what an owner reports), and
the ratios' median, 99th and 99.9th percentiles and maximum.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from intellect_jax.net import butterfly, plan  # noqa: E402
from intellect_jax.net.evidence import OUTSIZE, outsized, row_norm  # noqa: E402


def main() -> None:
    stats = {"pieces": 0, "rows": 0, "over": 0, "reported": 0}
    ratios: list[float] = []
    simulate = butterfly.simulate

    def weighed(inputs, mode, block, piece_numel, how="mean", absent=frozenset()):  # noqa: ANN001, ANN202
        world, numel = len(inputs), inputs[0].shape[0]
        p = plan.butterfly_plan(numel, world, block, piece_numel)
        for c in range(world):
            over: dict[int, int] = {}
            for j in range(p.pieces):
                a, b = p.piece(c, j)
                if b <= a:
                    continue
                norms = {r: row_norm(butterfly.roundtrip(x[a:b], mode, block)) for r, x in enumerate(inputs)
                         if r != c and r not in absent}
                stats["pieces"] += 1
                for r in norms:
                    q = outsized(norms, r, world)
                    if q is None:
                        continue
                    stats["rows"] += 1
                    ratios.append(q)
                    if q > OUTSIZE:
                        stats["over"] += 1
                        over[r] = over.get(r, 0) + 1
            stats["reported"] += sum(1 for n in over.values() if 2 * n > p.pieces)
        return simulate(inputs, mode, block, piece_numel, how, absent)

    butterfly.simulate = weighed
    load = os.getloadavg()[0]
    sys.argv = ["diloco_sweep.py", *sys.argv[1:]]
    runpy.run_path(str(ROOT / "benchmarks" / "diloco_sweep.py"), run_name="__main__")
    r = np.array(ratios or [float("nan")])
    print(json.dumps({**stats, "threshold": OUTSIZE, "p50": round(float(np.median(r)), 4),
                      "p99": round(float(np.quantile(r, 0.99)), 4), "p999": round(float(np.quantile(r, 0.999)), 4),
                      "max": round(float(r.max()), 4), "loadavg": [round(load, 2), round(os.getloadavg()[0], 2)]}))


if __name__ == "__main__":
    main()
