"""DiLoCo vs one node, and int8 vs fp32 all-reduce, on the bundled corpus (a script, not a test).

    python benchmarks/diloco_experiment.py [--nodes 4] [--inner-steps 50] [--steps 500] [--out runs/exp]
        [--butterfly clip,cclip] [--no-baselines]

Runs, through the real launcher (socket ring, coordinator, separate processes):
  1. N DiLoCo nodes, H inner steps, int8 all-reduce;
  2. the same with the fp32 all-reduce;
  3. one node trained on the same total number of tokens (its batch is N x a node's batch, same
     number of steps: what data-parallel training over N nodes would compute);
  4. with ``--butterfly AGG,...``: run 1 over the butterfly exchange with each robust aggregator
     (what the Byzantine-robust path costs a clean run; ``--no-baselines`` skips runs 2 and 3).
Prints one JSON object: each run's final validation loss (outer params for DiLoCo), the ratios
DiLoCo/one-node and int8/fp32, and the bytes each DiLoCo node sent against what DDP (an fp32
ring all-reduce of the gradients every step) would send.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIG = "configs/debug_diloco.toml"


def rows(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def run(cmd: list[str], log: Path, dry: bool = False) -> float | None:
    if dry:
        return None
    t0 = time.time()
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"command failed ({r.returncode}), see {log}: {' '.join(cmd)}")
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--steps", type=int, default=500, help="inner steps per node")
    ap.add_argument("--batch", type=int, default=8, help="sequences per node per step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3, help="inner (and one-node) peak learning rate")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov momentum (0: plain SGD)")
    ap.add_argument("--eval-seqs", type=int, default=128,
                    help="held-out sequences every run is evaluated on (the same windows for all)")
    ap.add_argument("--overlap", action="store_true", help="overlapped rounds (default: synchronous, as measured)")
    ap.add_argument("--out", default="runs/exp")
    ap.add_argument("--butterfly", default="", help="robust aggregators to run over the butterfly, e.g. clip,cclip")
    ap.add_argument("--no-baselines", action="store_true", help="skip the fp32 and one-node runs")
    ap.add_argument("--summarize", action="store_true",
                    help="run nothing: report on the runs already in --out (same arguments)")
    a = ap.parse_args()
    if a.eval_seqs % (a.batch * a.nodes):
        sys.exit(f"--eval-seqs ({a.eval_seqs}) must be a multiple of nodes x batch ({a.nodes * a.batch})")
    out = (ROOT / a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--run.steps", str(a.steps), "--data.seq_len", str(a.seq), "--optim.lr", str(a.lr),
              "--run.eval_every", "0", "--ckpt.every", "0",
              "--optim.warmup_steps", str(a.steps // 10), "--optim.decay_steps", str(a.steps // 5)]
    res: dict = {"nodes": a.nodes, "inner_steps": a.inner_steps, "steps": a.steps,
                 "tokens_per_node_step": a.batch * a.seq, "lr": a.lr, "outer_lr": a.outer_lr,
                 "outer_momentum": a.outer_momentum}
    runs = [("diloco_int8", "int8", [])] + ([] if a.no_baselines else [("diloco_fp32", "fp32", [])]) + [
        (f"diloco_int8_butterfly_{agg}", "int8", ["--diloco.exchange", "butterfly", "--diloco.robust", agg])
        for agg in filter(None, a.butterfly.split(","))]
    for name, mode, extra in runs:
        secs = run([sys.executable, "-m", "intellect_jax.launch", "--nodes", str(a.nodes), "--config", CONFIG,
                    "--out-dir", str(out), "--table-every", "0", "--run.name", name, *extra,
                    "--diloco.mode", mode, "--diloco.inner_steps", str(a.inner_steps), "--diloco.overlap", str(a.overlap),
                    "--diloco.outer_lr", str(a.outer_lr), "--diloco.outer_momentum", str(a.outer_momentum),
                    "--data.batch_size", str(a.batch), "--run.eval_batches", str(a.eval_seqs // a.batch),
                    *common], out / f"{name}.log", a.summarize)
        r0 = rows(out / name / "node0" / "metrics.jsonl")
        outer = [r for r in r0 if "outer_hash" in r]
        hashes = {json.dumps([r["outer_hash"] for r in rows(out / name / f"node{i}" / "metrics.jsonl")
                              if "outer_hash" in r]) for i in range(a.nodes)}
        res[name] = {"val_loss": outer[-1]["val_loss"], "seconds": secs and round(secs, 1),
                     "bytes_sent_per_node": sum(r["bytes_sent"] for r in outer),
                     "mean_utilization": sum(r["utilization"] for r in outer) / len(outer),
                     "hashes_agree": len(hashes) == 1}
        if name.startswith("diloco_int8_butterfly"):
            res[name]["val_ratio_vs_ring_int8"] = res[name]["val_loss"] / res["diloco_int8"]["val_loss"]
    if a.no_baselines:
        print(json.dumps(res, indent=2))
        return
    secs = run([sys.executable, "-m", "intellect_jax.train", "--config", CONFIG, "--run.name", "single",
                "--run.out_dir", str(out), "--diloco.no-enabled", "--run.no-progress",
                "--data.batch_size", str(a.batch * a.nodes),
                "--run.eval_batches", str(a.eval_seqs // (a.batch * a.nodes)), *common], out / "single.log", a.summarize)
    single = [r for r in rows(out / "single" / "metrics.jsonl") if "val_loss" in r][-1]
    res["single_node"] = {"val_loss": single["val_loss"], "seconds": secs and round(secs, 1),
                          "batch": a.batch * a.nodes}
    n_params = _num_params()
    ddp = 2 * (a.nodes - 1) / a.nodes * 4 * n_params * a.steps
    res["ddp_bytes_sent_per_node"] = ddp
    res["val_ratio_diloco_int8_vs_single"] = res["diloco_int8"]["val_loss"] / single["val_loss"]
    res["val_ratio_int8_vs_fp32"] = res["diloco_int8"]["val_loss"] / res["diloco_fp32"]["val_loss"]
    res["traffic_reduction_vs_ddp"] = ddp / res["diloco_int8"]["bytes_sent_per_node"]
    print(json.dumps(res, indent=2))
    (out / "result.json").write_text(json.dumps(res, indent=2))


def _num_params() -> int:
    from intellect_jax.config import load_toml

    return load_toml(ROOT / CONFIG).model.build().num_params()


if __name__ == "__main__":
    main()
