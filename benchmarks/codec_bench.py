"""Bytes and encode/decode time of every pseudo-gradient codec (a script, not a test).

    python benchmarks/codec_bench.py [--numel 25000000] [--nodes 4] [--repeat 3] [--device]

For each codec (`diloco.mode` and its parameters): bits per value on the wire, bytes one node
sends per outer step for a model of `--numel` values in a `--nodes` ring (the ring's
2(N-1)/N segments for int8/int4/bf16/fp32, N-1 whole contributions for the gathered int2, int1, top-k
and top-1), that against int8, the relative L2 error of one encode/decode of a Gaussian
pseudo-gradient with outliers, and the median wall time of encode and of decode on this host's
numpy (one thread). Timings are seconds per `--numel` values, measured side by side in one run.
With `--device`, also top-k, top-1 and int1 encoded by XLA on this machine's first jax device
(`diloco/device_codec.py`, as a GPU node encodes: error feedback included, the residual kept
there): the host encode of the same bytes beside it, bytes that leave the device per value,
and whether positions and codes equal the host's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CODECS = [  # (label, wire mode, block)
    ("fp32", "fp32", 64), ("bf16", "bf16", 64), ("int8 (block 64)", "int8", 64), ("int4 (block 64)", "int4", 64),
    ("int2 (block 64)", "int2", 64), ("int2 (block 256)", "int2", 256),
    ("int1 (block 512)", "int1", 512), ("int1 (block 1024)", "int1", 1024),
    ("topk 64 of 4096 (1.56%)", "topk64", 4096), ("topk 128 of 4096 (3.1%)", "topk128", 4096),
    ("topk 256 of 4096 (6.25%)", "topk256", 4096),
    ("top-1 of 8 (12.5%)", "top1of8", 4096), ("top-1 of 4 (25%)", "top1of4", 4096),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", action="store_true", help="also time the XLA encoder of top-k, top-1 and int1")
    a = ap.parse_args()
    import numpy as np

    from intellect_jax.net import codecs, quant

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(a.numel) * 1e-3).astype(np.float32)
    x[rng.integers(0, a.numel, a.numel // 1000)] *= 20  # heavy tails, as pseudo-gradients have
    n, N = a.numel, a.nodes

    def per_node(mode: str, block: int) -> float:
        b = quant.encoded_nbytes(n, mode, block)
        return (N - 1) * b if codecs.gathered(mode) else 2 * (N - 1) / N * b

    ref = per_node("int8", 64)
    print(f"{n} values, {N} nodes, load average {os.getloadavg()[0]:.2f}")
    print("| codec | bits per value | MB sent per node per outer step | vs int8 | rel. L2 error | encode s | decode s |")
    print("|---|---|---|---|---|---|---|")
    for label, mode, block in CODECS:
        enc, dec = [], []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            wire = quant.encode(x, mode, block)
            t1 = time.perf_counter()
            y = quant.decode(wire, n, mode, block)
            dec.append(time.perf_counter() - t1)
            enc.append(t1 - t0)
        err = float(np.linalg.norm(x - y) / np.linalg.norm(x))
        bits = 8 * quant.encoded_nbytes(n, mode, block) / n
        print(f"| {label} | {bits:.3f} | {per_node(mode, block) / 1e6:.2f} | {ref / per_node(mode, block):.2f}x "
              f"| {err:.4f} | {sorted(enc)[len(enc) // 2]:.3f} | {sorted(dec)[len(dec) // 2]:.3f} |", flush=True)
    if a.device:
        device_table(x, a.repeat)


def device_table(x, repeat: int) -> None:  # noqa: ANN001
    import jax
    import numpy as np

    from intellect_jax.diloco.device_codec import DeviceEncoder
    from intellect_jax.net import quant

    dev = jax.device_put(x, jax.devices()[0])
    zeros = jax.device_put(np.zeros_like(x), jax.devices()[0])
    print(f"\nencoded on {jax.devices()[0].device_kind} (XLA, feedback included) against numpy on the host; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| codec | device encode s | host encode s | device / host | bytes off the device per value "
          "| positions and codes as the host's |")
    print("|---|---|---|---|---|---|")
    for label, mode, block in CODECS:
        if mode[:3] != "top" and mode != "int1":
            continue
        enc = DeviceEncoder(mode, block, 1 << 26, 1 << 18)
        enc.encode(dev, zeros, 0.95, False)  # compile
        td, th = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            e, r, _ = enc.encode(dev, zeros, 0.95, False)
            jax.block_until_ready(r)
            t1 = time.perf_counter()
            host = np.concatenate([quant.encode(x[a_:b_], mode, block) for a_, b_ in _pieces(x.size, block)])
            th.append(time.perf_counter() - t1)
            td.append(t1 - t0)
        wire = np.concatenate([w for b in e.payloads for w in b])
        same = _same_sections(wire, host, x.size, mode, block)
        md, mh = sorted(td)[len(td) // 2], sorted(th)[len(th) // 2]
        print(f"| {label} | {md:.3f} | {mh:.3f} | {md / mh:.2f} | {enc.last_bytes / x.size:.3f} | {same} |", flush=True)


def _pieces(n: int, block: int) -> list[tuple[int, int]]:
    from intellect_jax.net.gather import gather_plan

    p = gather_plan(n, block, 1 << 18)
    return [p.piece(0, j) for j in range(p.pieces)]


def _same_sections(wire, host, n: int, mode: str, block: int) -> str:  # noqa: ANN001
    """Whether every piece's positions and codes equal the host's (levels: float32 rounding)."""
    import numpy as np

    from intellect_jax.net import quant

    o = 0
    for a_, b_ in _pieces(n, block):
        k = quant.encoded_nbytes(b_ - a_, mode, block)
        nl = (4 if mode == "int1" else 8) * -(-(b_ - a_) // block)  # (levels: int1 one, the others two)
        if not np.array_equal(wire[o + nl: o + k], host[o + nl: o + k]):
            return "no"
        o += k
    return "yes"


if __name__ == "__main__":
    main()
