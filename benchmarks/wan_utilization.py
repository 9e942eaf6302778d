"""Compute utilization of synchronous vs overlapped DiLoCo on emulated WAN links (a script, not a test).

    python benchmarks/wan_utilization.py [--nodes 4] [--inner-steps 25] [--outer-steps 8] [--shares 0.2 0.5]
        [--slowdowns 1 4] [--codec 'NAME=TRAIN ARGS' ...]

Needs root (network namespaces, veth, tc). N real nodes (`python -m intellect_jax.train
--diloco.enabled`, one CPU device each) each live in their own network namespace behind a
tbf-shaped link (`benchmarks/netns.py`: the rate up and down), with a coordinator in the
first one. A calibration run (synchronous, 1 Gbit/s links) measures a round's compute time, the
all-reduce's bytes and its cost on a fast link; for each target share s of a synchronous round
spent in sync, the link rate is then set so that the all-reduce should take s/(1-s) of a
round's compute (and, with ``--slowdowns``, also 4x slower, say), and the synchronous and the
overlapped int8 runs train on the same tokens, then every ``--codec`` (extra train flags, e.g.
``top1of4=--diloco.mode top1 --diloco.feedback 0.95 ...``) overlapped on the same link. Every
figure is measured from the nodes' own metrics, in the steady state (rounds 1 to K-2; round 0
compiles): utilization = Σ inner compute time / wall time from the start of round 1 to the
start of round K-1 (per node, then the mean), wall time per outer step, bytes sent per node
per outer step, the final validation loss (outer params, node 0), and whether all nodes logged
one hash per outer step. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PORT, RING_PORT = 29400, 29500


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_once(a: argparse.Namespace, mbit: float, overlap: bool, tag: str, codec: tuple[str, list[str]] = ("int8", [])
             ) -> dict:
    """One DiLoCo run of N nodes on links of ``mbit`` (``codec``: its name and extra train flags);
    returns its measured figures."""
    from netns import ShapedNet

    out = Path(a.out).absolute()
    name = f"{tag}-{codec[0]}-{'overlap' if overlap else 'sync'}"
    env = dict(os.environ, INTELLECT_KEYS=str(a.keys), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    H, K = a.inner_steps, a.outer_steps
    with ShapedNet(a.nodes, mbit) as net:
        coord = subprocess.Popen(
            [*net.exec_prefix(0), sys.executable, "-m", "intellect_jax.coordinator", "--host", net.addr(0),
             "--port", str(PORT), "--min-nodes", str(a.nodes), "--heartbeat-timeout", "60",
             "--boundary-timeout", "900", "--no-journal"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        procs = []
        try:
            for i in range(a.nodes):
                cmd = [*net.exec_prefix(i), sys.executable, "-m", "intellect_jax.train", "--config",
                       "configs/debug_diloco.toml", "--run.name", f"wan/{name}/node{i}", "--run.out_dir", str(out),
                       "--diloco.coordinator", f"{net.addr(0)}:{PORT}", "--diloco.listen", f"{net.addr(i)}:{RING_PORT}",
                       "--diloco.node_id", f"node{i}", "--diloco.data_rank", str(i), "--diloco.data_ranks",
                       str(a.nodes), "--diloco.inner_steps", str(H), "--run.steps", str(H * K), "--run.eval_every",
                       str(H * K), "--run.log_every", str(H), "--ckpt.every", "0", "--data.cache_dir",
                       str(out / "cache"), "--diloco.pseudo_gradient", "device",
                       "--diloco.overlap", str(overlap),
                       *(["--diloco.overlap_delay", str(a.overlap_delay)] if overlap and a.overlap_delay else []),
                       *codec[1]]
                log = open(out / f"{name}.node{i}.log", "w")  # noqa: SIM115 - closed with the process
                procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
            for p, log in procs:
                if p.wait(timeout=a.timeout):
                    sys.exit(f"{name}: a node failed ({p.returncode}); see {log.name}")
        finally:
            for p, log in procs:
                p.kill()
                log.close()
            coord.kill()
            coord.wait()
    nodes = [[r for r in _rows(out / "wan" / name / f"node{i}" / "metrics.jsonl") if "outer_hash" in r]
             for i in range(a.nodes)]
    hashes = {}
    for rs in nodes:
        for r in rs:
            hashes.setdefault(r["outer_step"], set()).add(r["outer_hash"])
    # steady state: rounds 1..K-2 (round 0 compiles the step), each with the gap after it until the
    # next round starts; row j carries round j-1's compute time and start
    util = [sum(r["compute_s"] for r in rs[1:-1]) / (rs[-1]["round_start_s"] - rs[1]["round_start_s"])
            for rs in nodes]
    n0, mean = nodes[0], (lambda key, rs: sum(r.get(key, 0.0) for r in rs) / len(rs))
    return {"run": name, "mbit": round(mbit, 2), "utilization": sum(util) / len(util),
            "utilization_min": min(util), "wall_per_outer_s": (n0[-1]["round_start_s"] - n0[1]["round_start_s"]) / (K - 2),
            "compute_per_round_s": mean("compute_s", n0[1:-1]), "sync_per_outer_s": mean("sync_s", n0[1:-1]),
            "overlap_wait_s": mean("overlap_wait_s", n0[2:]),
            "delay_steps": mean("delay_steps", n0[1:-1]),  # inner steps from send to merge (0: synchronous)
            "mb_sent_per_outer": mean("bytes_sent", n0) / 1e6,
            "val_loss": next(r["val_loss"] for r in reversed(n0) if "val_loss" in r),
            "hashes_agree": sorted(hashes) == list(range(1, K + 1)) and all(len(h) == 1 for h in hashes.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=25, help="H")
    ap.add_argument("--outer-steps", type=int, default=8, help="at least 4 (the first round compiles)")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.2, 0.5],
                    help="target shares of a synchronous round spent in sync")
    ap.add_argument("--overlap-delay", type=int, default=None,
                    help="a fixed tau for the overlapped runs (default: each average merged when ready)")
    ap.add_argument("--slowdowns", type=float, nargs="+", default=[1.0],
                    help="for each share, also links this many times slower than its rate")
    ap.add_argument("--codec", action="append", default=[], metavar="NAME=ARGS",
                    help="an extra overlapped run on every link: its name and train flags (repeatable)")
    ap.add_argument("--calibrate-mbit", type=float, default=1000.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--out", default="runs/wan")
    a = ap.parse_args()
    codecs = []
    for spec in a.codec:
        name, sep, flags = spec.partition("=")
        if not sep or not name or "/" in name:
            sys.exit(f"error: --codec {spec!r}: expected NAME=TRAIN FLAGS (a name without '/')")
        codecs.append((name, shlex.split(flags)))
    from netns import require_root

    why = require_root()
    if why:
        sys.exit(f"error: {why}")
    from intellect_jax.net.identity import Authority

    a.keys = Path(a.out).absolute() / f"keys-{time.strftime('%H%M%S')}"  # a fresh run authority, every node issued
    Authority.init(a.keys, "intellect-jax")
    for i in range(a.nodes):
        Authority.load(a.keys).issue(f"node{i}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    tag = time.strftime("%H%M%S")
    results = [cal := run_once(a, a.calibrate_mbit, False, f"{tag}-cal")]
    C, S0, mbits = cal["compute_per_round_s"], cal["sync_per_outer_s"], cal["mb_sent_per_outer"] * 8
    print(f"calibration: compute {C:.2f} s per round, sync {S0:.2f} s at {a.calibrate_mbit:.0f} Mbit/s, "
          f"{cal['mb_sent_per_outer']:.2f} MB sent per node per outer step", flush=True)
    for share in a.shares:
        want = share / (1 - share) * C
        if want <= S0:
            print(f"share {share}: the all-reduce already costs {S0:.2f} s on a fast link; skipped", flush=True)
            continue
        for slow in a.slowdowns:
            mbit = mbits / (want - S0) / slow
            runs = [(False, ("int8", [])), (True, ("int8", [])), *((True, c) for c in codecs)]
            for overlap, codec in runs:
                r = run_once(a, mbit, overlap, f"{tag}-s{int(share * 100)}" + (f"x{slow:g}" if slow != 1 else ""), codec)
                r["target_share"], r["slowdown"] = share, slow
                results.append(r)
                print(json.dumps(r), flush=True)
    head = f"{'run':<36} {'Mbit/s':>8} {'delay':>5} {'util':>6} {'min':>6} {'wall/outer':>10} {'sync':>6} {'wait':>6} " \
           f"{'MB/outer':>8} {'val loss':>8} hashes"
    print(head)
    for r in results:
        print(f"{r['run']:<36} {r['mbit']:>8.1f} {r['delay_steps']:>5.1f} {r['utilization']:>6.1%} {r['utilization_min']:>6.1%} "
              f"{r['wall_per_outer_s']:>9.2f}s {r['sync_per_outer_s']:>5.2f}s {r['overlap_wait_s']:>5.2f}s "
              f"{r['mb_sent_per_outer']:>8.2f} {r['val_loss']:>8.4f} {'agree' if r['hashes_agree'] else 'DIFFER'}")
    print(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "results": results}))


if __name__ == "__main__":
    main()
