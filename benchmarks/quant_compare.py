"""Compare this layer's blockwise int8 with PRIME's 8-bit codebook scheme at equal bytes.

    python benchmarks/quant_compare.py [--numel 1048576] [--world 4] [--chunk 262144]

PRIME (zeroband ``uniform_8bit_quantize``): per ring chunk, bins of width
6*rms/256 around 0 (so +-3 sigma), codes ``clamp(round(x/w) + 128, 0, 255)``, and a
256-entry float32 lookup table of bucket means (values outside +-3 sigma are clipped into
the edge buckets). Its all-gather re-quantizes at every hop, so ranks end up different.

For each synthetic pseudo-gradient distribution, prints bytes per value, the relative L2
error of one quantization, and of the N-rank ring mean (ours: the exact socket-ring
arithmetic via :func:`~intellect_jax.net.plan.simulate`; PRIME: its ring, per rank), plus
how far PRIME's ranks drift apart (ours are bit-identical by construction).
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import numpy as np

from intellect_jax.net import quant
from intellect_jax.net.plan import make_plan, simulate

Dist = Callable[[np.random.Generator, int], np.ndarray]


def _pseudo_grad(shared: np.ndarray, rows: np.ndarray) -> Dist:
    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        x = (np.sqrt(0.5) * shared + np.sqrt(0.5) * rng.standard_normal(n)) * rows
        x[rng.integers(0, n, n // 10_000)] *= 20
        return x

    return draw


def distributions(n: int, seed: int) -> dict[str, Dist]:
    """Per-rank samplers: iid Gaussian, Student-t(3) (heavy tails), Gaussian with 0.1% 30x
    outliers, and DiLoCo-like pseudo-gradients (shared direction + per-node noise, per-row
    scales over ~2 decades, 0.01% 20x spikes)."""
    rng = np.random.default_rng(seed)
    rows = np.repeat(np.exp(rng.normal(0.0, 1.0, n // 1024 + 1)), 1024)[:n]

    def outliers(r: np.random.Generator, m: int) -> np.ndarray:
        x = r.standard_normal(m)
        x[r.integers(0, m, m // 1000)] *= 30
        return x

    return {
        "gaussian": lambda r, m: r.standard_normal(m),
        "student_t3": lambda r, m: r.standard_t(3, m),
        "gauss+0.1%x30": outliers,
        "pseudo_grad": _pseudo_grad(rng.standard_normal(n), rows),
    }


def prime_encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PRIME's per-chunk codebook quantization: (uint8 codes, 256 float32 bucket means)."""
    n = x.shape[0]
    rms = float(np.linalg.norm(x.astype(np.float64))) / np.sqrt(max(n - 1, 1))
    width = 6.0 * rms / 256 if rms > 0 else 1.0
    q = np.clip(np.rint(x / width) + 128, 0, 255).astype(np.uint8)
    sums = np.bincount(q, weights=x, minlength=256)
    counts = np.maximum(np.bincount(q, minlength=256), 1)
    return q, (sums / counts).astype(np.float32)


def prime_decode(q: np.ndarray, lookup: np.ndarray) -> np.ndarray:
    """Look the codes up in the bucket-mean table."""
    return lookup[q]


def prime_ring(inputs: list[np.ndarray], chunk: int) -> list[np.ndarray]:
    """PRIME's ring (mean): re-quantize every reduce-scatter and every all-gather hop."""
    world, n = len(inputs), inputs[0].shape[0]
    plan = make_plan(n, world, 1, chunk)
    outs = [np.empty(n, np.float32) for _ in range(world)]
    for c in range(world):
        for j in range(plan.pieces):
            a, b = plan.piece(c, j)
            acc = inputs[c][a:b].astype(np.float32)
            for k in range(1, world):
                acc = prime_decode(*prime_encode(acc)) + inputs[(c + k) % world][a:b]
            val = acc / np.float32(world)
            owner = (c - 1) % world
            outs[owner][a:b] = val  # PRIME's owner keeps its unquantized mean
            for hop in range(1, world):
                val = prime_decode(*prime_encode(val))
                outs[(owner + hop) % world][a:b] = val
    return outs


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - ref) / np.linalg.norm(ref))


def compare(numel: int, world: int, chunk: int, blocks: tuple[int, ...], seed: int = 0) -> list[dict]:
    """One row per (distribution, scheme)."""
    rows: list[dict] = []
    for name, draw in distributions(numel, seed).items():
        rng = np.random.default_rng(seed + 1)
        xs = [draw(rng, numel).astype(np.float32) for _ in range(world)]
        ref = np.mean(np.stack(xs).astype(np.float64), axis=0)
        one = xs[0].astype(np.float64)
        pq = [prime_decode(*prime_encode(xs[0][a : a + chunk])) for a in range(0, numel, chunk)]
        prime_outs = prime_ring(xs, chunk)
        rows.append({
            "dist": name, "scheme": f"PRIME codebook (chunk {chunk})",
            "bytes_per_value": round(1 + 256 * 4 / chunk, 4),
            "single_err": _rel(np.concatenate(pq), one),
            "ring_err": max(_rel(o, ref) for o in prime_outs),
            "rank_spread": max(_rel(o, prime_outs[0].astype(np.float64)) for o in prime_outs[1:]),
        })
        for block in blocks:
            rows.append({
                "dist": name, "scheme": f"ours int8 block {block}",
                "bytes_per_value": round(quant.encoded_nbytes(numel, "int8", block) / numel, 4),
                "single_err": _rel(quant.roundtrip(xs[0], "int8", block), one),
                "ring_err": _rel(simulate(xs, "int8", block, chunk), ref),
                "rank_spread": 0.0,
            })
        rows.append({
            "dist": name, "scheme": "ours bf16", "bytes_per_value": 2.0,
            "single_err": _rel(quant.roundtrip(xs[0], "bf16", 64), one),
            "ring_err": _rel(simulate(xs, "bf16", 64, chunk), ref), "rank_spread": 0.0,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/quant_compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--chunk", type=int, default=1 << 18, help="ring chunk (PRIME codebook scope, our piece)")
    p.add_argument("--blocks", default="1024,256,64,32", help="int8 block sizes to try")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = p.parse_args(argv)
    rows = compare(a.numel, a.world, a.chunk, tuple(int(b) for b in a.blocks.split(",")))
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"relative L2 error, {a.world}-rank ring mean of {a.numel} values (lower is better)")
    print(f"{'distribution':15s} {'scheme':30s} {'B/value':>8s} {'1 quant':>9s} {'ring mean':>10s} {'rank spread':>12s}")
    for r in rows:
        print(f"{r['dist']:15s} {r['scheme']:30s} {r['bytes_per_value']:8.4f} {r['single_err']:9.3%} "
              f"{r['ring_err']:10.3%} {r['rank_spread']:12.3%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
