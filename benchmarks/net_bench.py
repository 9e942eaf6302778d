"""Benchmark the ring all-reduce against torch.distributed gloo on the same links.

    python benchmarks/net_bench.py --nodes 4 --numel 25000000 --mode int8 \
        [--repeats 5] [--shape-mbit 500] [--streams 1] [--block 64] [--no-gloo] [--butterfly cclip] [--unaudited] \
        [--buckets 1]

Spawns N node processes (each in its own network namespace with tbf-shaped links when
``--shape-mbit`` is given; root only). Every node times this layer's all-reduce and,
alternately in the same processes (so both see the same machine load), torch.distributed
gloo ``all_reduce`` of fp32 over the same links. Prints one JSON object per method:
median seconds (slowest rank of each repeat), algorithm bandwidth (fp32 bytes / time),
CPU seconds per node, bytes sent per node, and the ratio of the line-rate bound
``2(N-1)/N * payload / rate`` to the measured time (1.0 = wire speed).
With ``--butterfly AGG`` every node also times the butterfly exchange (``net.butterfly``, the
owners aggregating with AGG: mean, clip, trim<k>, cclip) on the same data, alternating with the
ring, and the report gives its time over the ring's; ``--unaudited`` times it a third way,
without the audits of its owners (``net.audit``), for the audits' own cost side by side.
``--buckets K`` cuts the vector into K leaves reduced as K buckets (``bucket_numel``), as a
model above 2^26 values is (the butterfly then sends every bucket's pieces before any
aggregate); gloo still reduces one flat tensor.
The workers' certificates come from a throwaway run authority made here (the test one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

import netns  # beside this file

from intellect_jax.net import quant

PORT = 29400


def _mode(m: str) -> str:
    if m not in ("fp32", "bf16", "int8", "int4", "int2", "int1") and not m.startswith(("topk", "top1of")):
        raise argparse.ArgumentTypeError(f"unknown wire mode {m!r}; expected one of {quant.MODES}")
    return m


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/net_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--mode", type=_mode, default="int8",
                   help="wire codec: fp32, bf16, int8, int4 (ring); int2, int1, topk<K>, top1of<G> (all-gather; --block: chunk)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shape-mbit", type=float, default=None, help="tbf rate of every link (needs root)")
    p.add_argument("--streams", type=int, default=1, help="parallel TCP streams per ring link")
    p.add_argument("--block", type=int, default=64, help="int8 block size")
    p.add_argument("--piece", type=int, default=1 << 18, help="pipeline piece, elements")
    p.add_argument("--integrity", choices=("sha256", "crc32"), default="crc32")
    p.add_argument("--no-gloo", action="store_true", help="skip the torch.distributed gloo baseline")
    p.add_argument("--butterfly", metavar="AGG", default=None,
                   help="also time the butterfly exchange, its owners aggregating with AGG (mean, clip, trim<k>, cclip)")
    p.add_argument("--buckets", type=int, default=1, help="leaves (and buckets) the vector is cut into")
    p.add_argument("--unaudited", action="store_true",
                   help="with --butterfly, also time it without the audits of its owners (net.audit), side by side")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before workers are killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gloo-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--peers", help=argparse.SUPPRESS)
    return p


def _data(rank: int, numel: int) -> np.ndarray:
    """Pseudo-gradient-like data: Gaussian with sparse 20x outliers."""
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal(numel, dtype=np.float32)
    idx = rng.integers(0, numel, numel // 10_000)
    x[idx] *= 20
    return x


def _worker(a: argparse.Namespace, peers: list[str]) -> dict[str, Any]:
    """One node: time the ring and (if asked) gloo, alternating, so both see the same load."""
    from intellect_jax.net import NetNode, RingConfig
    from intellect_jax.testing.identities import transport_config

    host, port = peers[a.rank].rsplit(":", 1)
    cfg = transport_config(f"bench{a.rank}", "bench", io_timeout=120, integrity=a.integrity)
    members = [(f"bench{r}", p) for r, p in enumerate(peers)]
    x = _data(a.rank, a.numel)
    y = np.empty_like(x)
    bucket = -(-a.numel // a.buckets)
    xt = {f"{i:04d}": x[i * bucket:(i + 1) * bucket] for i in range(a.buckets)}  # (views: no copy)
    yt = {f"{i:04d}": y[i * bucket:(i + 1) * bucket] for i in range(a.buckets)}
    gloo = None
    if a.gloo_port:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{peers[0].rsplit(':', 1)[0]}:{a.gloo_port}",
                                rank=a.rank, world_size=a.nodes)
        gloo = torch.from_numpy(x.copy())
        dist.all_reduce(gloo)  # warm-up
    out: dict[str, Any] = {"rank": a.rank, "ring": {"times": [], "cpu": []}, "gloo": {"times": [], "cpu": []},
                           "butterfly": {"times": [], "cpu": []}, "unaudited": {"times": [], "cpu": []}}
    with NetNode(cfg, host, int(port)) as node:
        ring = node.ring(members, a.rank, epoch=0, config=RingConfig(
            mode=a.mode, block_size=a.block, streams=a.streams, piece_numel=a.piece, deadline=a.timeout,
            bucket_numel=bucket))
        barrier = node.ring(members, a.rank, epoch=1, config=RingConfig(mode="fp32", deadline=a.timeout))
        fly = None if a.butterfly is None else node.ring(members, a.rank, epoch=2, config=RingConfig(
            mode=a.mode, block_size=a.block, piece_numel=a.piece, deadline=a.timeout, exchange="butterfly",
            robust=a.butterfly, bucket_numel=bucket))
        bare = None if a.butterfly is None or not a.unaudited else node.ring(members, a.rank, epoch=3, config=RingConfig(
            mode=a.mode, block_size=a.block, piece_numel=a.piece, deadline=a.timeout, exchange="butterfly",
            robust=a.butterfly, audit=False, bucket_numel=bucket))
        one = np.zeros(1, np.float32)
        ring.all_reduce_mean(xt, out=yt)  # warm-up (connects, fills buffer pools)
        for c in (fly, bare):
            if c is not None:
                c.all_reduce_mean(xt, out=yt)
        for _ in range(a.repeats):
            for name, c in (("ring", ring), ("butterfly", fly), ("unaudited", bare)):  # one after another
                if c is None:
                    continue
                barrier.all_reduce_mean(one)
                t0, c0 = time.perf_counter(), time.process_time()
                c.all_reduce_mean(xt, out=yt)
                out[name]["times"].append(time.perf_counter() - t0)
                out[name]["cpu"].append(time.process_time() - c0)
            if gloo is not None:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                dist.all_reduce(gloo)
                out["gloo"]["times"].append(time.perf_counter() - t0)
                out["gloo"]["cpu"].append(time.process_time() - c0)
        out["ring"]["bytes_sent"] = ring.last_stats.bytes_sent
        if fly is not None:
            out["butterfly"]["bytes_sent"] = fly.last_stats.bytes_sent
            fly.close()
        if bare is not None:
            out["unaudited"]["bytes_sent"] = bare.last_stats.bytes_sent
            bare.close()
        # gloo's ring sends 2(N-1)/N of the fp32 payload per node (torch does not count it)
        out["gloo"]["bytes_sent"] = int(2 * (a.nodes - 1) / a.nodes * 4 * a.numel)
        barrier.all_reduce_mean(one)
        ring.close()
        barrier.close()
    if gloo is not None:
        dist.destroy_process_group()
    return out


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _launch(a: argparse.Namespace, net: netns.ShapedNet | None, gloo: bool) -> list[dict[str, Any]]:
    if net is not None:
        peers, gloo_port = [f"{net.addr(i)}:{PORT}" for i in range(a.nodes)], PORT + 50
    else:
        ports = _free_ports(a.nodes + 1)
        peers, gloo_port = [f"127.0.0.1:{p}" for p in ports[:-1]], ports[-1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME=netns.IFNAME if net is not None else "lo",
               OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    procs = []
    for i in range(a.nodes):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(i),
               "--peers", ",".join(peers), "--gloo-port", str(gloo_port if gloo else 0)] + _passthrough(a)
        # own session per node: like separate machines, each node gets its own scheduler group
        procs.append(subprocess.Popen((net.exec_prefix(i) if net else []) + cmd, env=env, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results, errors = [], []
    deadline = time.monotonic() + a.timeout
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                errors.append(f"rank {i} exited {p.returncode}: {err.strip()[-2000:]}")
            else:
                results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def _passthrough(a: argparse.Namespace) -> list[str]:
    return ["--nodes", str(a.nodes), "--numel", str(a.numel), "--mode", a.mode, "--repeats", str(a.repeats),
            "--streams", str(a.streams), "--block", str(a.block), "--piece", str(a.piece),
            "--integrity", a.integrity, "--timeout", str(a.timeout), "--buckets", str(a.buckets)] + \
        ([] if a.butterfly is None else ["--butterfly", a.butterfly]) + (["--unaudited"] if a.unaudited else [])


def _summary(results: list[dict[str, Any]], a: argparse.Namespace, payload: int) -> dict[str, Any]:
    """Median over repeats of the slowest rank's time, and derived rates."""
    per_repeat = [max(r["times"][i] for r in results) for i in range(a.repeats)]
    med = statistics.median(per_repeat)
    out: dict[str, Any] = {
        "median_s": round(med, 4),
        "times_s": [round(t, 4) for t in per_repeat],
        "algbw_gbit_s": round(a.numel * 4 * 8 / med / 1e9, 3),
        "cpu_s_per_node": round(statistics.median(statistics.median(r["cpu"]) for r in results), 4),
        "bytes_sent_per_node": max(r["bytes_sent"] for r in results),
        "payload_bytes": payload,
    }
    if a.shape_mbit:
        bound = 2 * (a.nodes - 1) / a.nodes * payload * 8 / (a.shape_mbit * 1e6)
        out["line_rate_bound_s"] = round(bound, 4)
        out["ratio_to_bound"] = round(bound / med, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        print(json.dumps(_worker(a, a.peers.split(","))), flush=True)
        return 0
    if a.shape_mbit is not None and (why := netns.require_root()):
        print(f"error: {why}", file=sys.stderr)
        return 2
    gloo = not a.no_gloo
    if gloo:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            gloo = False
    from intellect_jax.testing.identities import credentials

    for r in range(a.nodes):  # issued once here; the workers inherit $INTELLECT_TEST_KEYS
        credentials(f"bench{r}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    net = netns.ShapedNet(a.nodes, a.shape_mbit) if a.shape_mbit else None
    report: dict[str, Any] = {"nodes": a.nodes, "numel": a.numel, "mode": a.mode, "block": a.block, "buckets": a.buckets,
                              "streams": a.streams, "piece": a.piece, "integrity": a.integrity,
                              "shape_mbit": a.shape_mbit, "repeats": a.repeats, "butterfly_agg": a.butterfly,
                              "loadavg_before": round(os.getloadavg()[0], 2)}
    try:
        if net is not None:
            net.up()
        results = _launch(a, net, gloo)
    finally:
        if net is not None:
            net.close()
    report["loadavg_after"] = round(os.getloadavg()[0], 2)
    report["ring"] = _summary([r["ring"] for r in results], a, quant.encoded_nbytes(a.numel, a.mode, a.block))
    if a.butterfly is not None:
        report["butterfly"] = _summary([r["butterfly"] for r in results], a,
                                       quant.encoded_nbytes(a.numel, a.mode, a.block))
        report["butterfly_time_over_ring"] = round(report["butterfly"]["median_s"] / report["ring"]["median_s"], 3)
        report["butterfly_bytes_over_ring"] = round(report["butterfly"]["bytes_sent_per_node"]
                                                    / report["ring"]["bytes_sent_per_node"], 4)
        if a.unaudited:
            report["butterfly_unaudited"] = _summary([r["unaudited"] for r in results], a,
                                                     quant.encoded_nbytes(a.numel, a.mode, a.block))
            report["audited_time_over_unaudited"] = round(report["butterfly"]["median_s"]
                                                          / report["butterfly_unaudited"]["median_s"], 3)
            report["unaudited_time_over_ring"] = round(report["butterfly_unaudited"]["median_s"]
                                                       / report["ring"]["median_s"], 3)
    if gloo:
        report["gloo_fp32"] = _summary([r["gloo"] for r in results], a, 4 * a.numel)
        report["speedup_vs_gloo"] = round(report["gloo_fp32"]["median_s"] / report["ring"]["median_s"], 3)
    else:
        report["gloo_fp32"] = "skipped (--no-gloo or torch not installed)"
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
