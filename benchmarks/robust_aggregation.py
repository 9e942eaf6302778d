"""Which robust aggregator: each one's cosine with the honest nodes' mean, clean and attacked.

Synthetic rounds: N members, each honest one sends ``m + noise`` (``m`` the round's shared
direction: half of it the same every round, as training keeps a direction; the noise
``--noise`` times as large, so two honest pseudo-gradients have cosine ``1 / (1 + noise^2)``),
and the attackers one of the issue's attacks. The vector is cut into N segments, as the
butterfly exchange cuts it (segment j's owner aggregates every member's piece of segment j,
:mod:`intellect_jax.net.robust`; the exchange aggregates each segment piece by piece, at least
4,096 values at a time, which moved no cell here by more than 0.001); the aggregates are put back together and compared with the
mean of the honest contributions (for the NaN attack, of every contribution: the attacker's
other values are honest). Prints, per aggregator and attack, the lowest cosine over the rounds,
the cosine of the rounds' sum (what a steady push in one direction accumulates), and the
aggregate's norm over the honest mean's (a clipped clean round comes out shorter), for 1
attacker among 4, 8 and 16 and 2 among 8.

    python benchmarks/robust_aggregation.py [--dim 65536] [--rounds 20] [--noise 1.0]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from intellect_jax.net.robust import aggregate, norm

Attack = Callable[[np.random.Generator, list[np.ndarray], np.ndarray, int, dict], np.ndarray]


def _flip(rng, honest, own, n, st):  # noqa: ANN001 - the attacks share one signature
    return (-(n - 1) * own).astype(np.float32)


def _push(rng, honest, own, n, st):  # noqa: ANN001
    if "u" not in st:
        u = rng.standard_normal(own.size).astype(np.float32)
        st["u"] = u / np.float32(norm(u))
        st["k"] = float(rng.uniform(5, 9))
    return (st["k"] * np.mean([norm(h) for h in honest]) * st["u"]).astype(np.float32)


def _ratchet(rng, honest, own, n, st):  # noqa: ANN001
    """Just under a clip bound of the median honest norm, in a fixed direction: no bound of
    this round's rows lets it grow from one round to the next."""
    if "u" not in st:
        u = rng.standard_normal(own.size).astype(np.float32)
        st["u"] = u / np.float32(norm(u))
    return (0.99 * float(np.median([norm(h) for h in honest])) * st["u"]).astype(np.float32)


def _nan(rng, honest, own, n, st):  # noqa: ANN001
    bad = own.copy()
    bad[own.size // 2 + int(rng.integers(0, own.size // 2))] = np.nan  # outside the first piece
    return bad


def _huge(rng, honest, own, n, st):  # noqa: ANN001
    return (1000 * own).astype(np.float32)


ATTACKS: dict[str, Attack | None] = {"clean": None, "sign flip x(N-1)": _flip, "push 5-9x, fixed direction": _push,
                                     "ratchet (0.99 x median, fixed direction)": _ratchet,
                                     "NaN outside the first piece": _nan, "x1000": _huge}
AGGREGATORS = ("mean", "clip", "trim1", "trim2", "cclip")


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.astype(np.float64), b) / (norm(a) * norm(b)))


def one_round(rng: np.random.Generator, n: int, bad: int, dim: int, noise: float, attack: Attack | None,
              state: dict, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(the aggregate, the honest mean) of one round."""
    if "p" not in state:  # the direction training keeps, round after round
        state["p"] = rng.standard_normal(dim).astype(np.float32)
    m = np.float32(0.5 ** 0.5) * (state["p"] + rng.standard_normal(dim).astype(np.float32))
    rows = [m + np.float32(noise) * rng.standard_normal(dim).astype(np.float32) for _ in range(n)]
    honest = rows if attack is _nan else rows[bad:]
    want = np.mean(np.stack(honest), axis=0)
    if attack is not None:
        for i in range(bad):
            rows[i] = attack(rng, rows[bad:], rows[i], n, state)
    cuts = np.linspace(0, dim, n + 1).astype(int)
    got = np.concatenate([aggregate([r[a:b] for r in rows], mode, b - a).value for a, b in zip(cuts[:-1], cuts[1:])])
    return got, want


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1 << 16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--noise", type=float, default=1.0, help="honest noise over the shared direction's norm")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"dim {args.dim}, {args.rounds} rounds, noise {args.noise} (honest pairs at cosine "
          f"{1 / (1 + args.noise ** 2):.2f}); each cell: lowest cosine with the honest mean in a round / "
          "cosine of the rounds' sums / mean norm ratio")
    setups = [(4, 1), (8, 1), (16, 1), (8, 2)]
    for name, attack in ATTACKS.items():
        print(f"\n{name}")
        print("  aggregator  " + "  ".join(f"{f'{b} of {n}':>22}" for n, b in setups))
        for mode in AGGREGATORS:
            cells = []
            for n, bad in setups:
                rng, state = np.random.default_rng([args.seed, n, bad]), {}
                res = [one_round(rng, n, bad if attack else 0, args.dim, args.noise, attack, state, mode)
                       for _ in range(args.rounds)]
                if not all(np.isfinite(g).all() for g, _ in res):
                    cells.append("not finite")
                    continue
                low = min(_cos(g, w) for g, w in res)
                total = _cos(np.sum([g for g, _ in res], axis=0), np.sum([w for _, w in res], axis=0))
                ratio = np.mean([norm(g) / norm(w) for g, w in res])
                cells.append(f"{low:+.3f} / {total:+.3f} / {ratio:5.2f}")
            print(f"  {mode:<10}  " + "  ".join(f"{c:>22}" for c in cells))
    rows = [np.random.default_rng(i).standard_normal(1 << 20).astype(np.float32) for i in range(8)]
    times = {}
    for mode in AGGREGATORS:  # the best of 3, side by side
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            aggregate(rows, mode, rows[0].size)
            runs.append(time.perf_counter() - t0)
        times[mode] = min(runs)
    print("\ntime to aggregate 8 rows of 2^20 values (best of 3): "
          + ", ".join(f"{m} {1e3 * t:.0f} ms" for m, t in times.items())
          + " (ratio to mean: " + ", ".join(f"{m} {t / times['mean']:.1f}x" for m, t in times.items()) + ")")


if __name__ == "__main__":
    main()
