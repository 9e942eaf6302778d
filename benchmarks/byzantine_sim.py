"""The attack suite of the Byzantine-robust exchange in the seeded in-process harness.

    python benchmarks/byzantine_sim.py [--steps 20] [--robust mean,clip,cclip] [--exchange butterfly]
        [--setups 4:1,8:1,8:2,16:1] [--attacks flip,push,ratchet,late-nan,x1000,sitout,owner,stall] [--seed 0]

Each run is the fault simulation's (``intellect_jax.testing.sim``: the real node loop and
coordinator in virtual time, a toy model, the exchange's exact arithmetic, evidence signed by
each sender and checked by the coordinator) with the first attackers (``n1``, then ``n5``,
``n9``, ...) corrupting what they send from outer step 1 to the end (``World.poison``):

* ``flip``: -N x its honest pseudo-gradient; ``push``: 7x its norm in one fixed direction;
  ``ratchet``: 1.6^step x it; ``late-nan``: NaN in its very last value; ``x1000``: every value
  x1000; ``sitout``: says it sits the round out (its own check fails) yet sends its honest one;
  ``owner``: sends its honest one but, as a segment owner, its aggregate negated (net.audit);
  ``stall``: comes to every all-reduce and sends none of its pieces (the butterfly's liveness).

For each (setup, attack, aggregator) it prints one JSON line: the lowest cosine, over the
exchanges an attacker took part in, between the applied average and the honest contributors'
mean (and over every exchange of the clean run as ``clean_min_cos``), the final validation loss
over the clean run's with the same aggregator and nodes, the boundary at which each attacker
was first evicted, and any honest node evicted. The harness checks its own invariants (one
hash per outer step, nobody hangs, every process ends) on every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import numpy as np

from intellect_jax.testing.sim import Script, Sim, SimParams
from intellect_jax.testing.sim_checks import evictions
from intellect_jax.testing.sim_plan import attacker

ATTACKS = ("flip", "push", "ratchet", "late-nan", "x1000", "sitout", "owner", "stall")


def run(nodes: int, attackers: list[int], value: str | None, robust: str, exchange: str, steps: int,
        seed: int, dim: int) -> dict:
    faults = {f"n{a}#0": attacker(value, steps) for a in attackers} if value else {}
    p = SimParams(nodes=nodes, outer_steps=steps, outer_lr=1.0, outer_momentum=0.0, exchange=exchange, robust=robust,
                  dim=dim)
    sim = Sim(seed, p, script=Script(faults=faults))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN arithmetic on purpose
        report = sim.run()
    bad = {f"n{a}" for a in attackers}
    cos = []
    for _, _, inputs, result, absent in sim.exchanges:
        if bad and not bad & set(inputs):
            continue  # no attacker in this exchange
        honest = [x for n, x in inputs.items() if n not in bad and n not in absent]
        if not honest:
            continue
        mean = np.mean(np.stack(honest).astype(np.float64), axis=0)
        res = result.astype(np.float64)
        den = np.linalg.norm(mean) * np.linalg.norm(res)
        cos.append(float(mean @ res / den) if den > 0 and np.isfinite(den) else float("nan"))
    final = [row["val_loss"] for _, _, row in sim.rows if row["outer_step"] == steps and "val_loss" in row]
    evicted = evictions(report["log"])
    return {"ok": report["ok"], "problems": report["problems"][:3], "min_cos": min(cos) if cos else None,
            "final": final[0] if final else None, "evicted": evicted, "honest_evicted": sorted(set(evicted) - bad)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/byzantine_sim.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--robust", default="mean,clip,cclip")
    ap.add_argument("--exchange", default="butterfly", choices=("ring", "butterfly"))
    ap.add_argument("--setups", default="4:1,8:1,8:2,16:1", help="nodes:attackers, comma-separated")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dim", type=int, default=1024,
                    help="the toy model's values: at least 32 per node, so that every owner's segment holds some")
    a = ap.parse_args(argv)
    attacks = a.attacks.split(",")
    if not set(attacks) <= set(ATTACKS):
        ap.error(f"--attacks: unknown {sorted(set(attacks) - set(ATTACKS))}; expected some of {ATTACKS}")
    t0 = time.time()
    print(json.dumps({"loadavg_before": round(os.getloadavg()[0], 2), "steps": a.steps, "seed": a.seed,
                      "exchange": a.exchange, "dim": a.dim}), flush=True)
    for setup in a.setups.split(","):
        nodes, k = (int(v) for v in setup.split(":"))
        attackers = [1 + 4 * i for i in range(k)]
        for robust in a.robust.split(","):
            clean = run(nodes, [], None, robust, a.exchange, a.steps, a.seed, a.dim)
            print(json.dumps({"nodes": nodes, "attackers": 0, "robust": robust, "ok": clean["ok"],
                              "clean_min_cos": round(clean["min_cos"], 3), "final": round(clean["final"], 4),
                              "evicted": clean["evicted"]}),
                  flush=True)
            for attack in attacks:
                r = run(nodes, attackers, attack, robust, a.exchange, a.steps, a.seed, a.dim)
                ratio = r["final"] / clean["final"] if r["final"] is not None else None
                print(json.dumps({"nodes": nodes, "attackers": k, "attack": attack, "robust": robust, "ok": r["ok"],
                                  "min_cos": None if r["min_cos"] is None else round(r["min_cos"], 3),
                                  "final_over_clean": None if ratio is None else round(ratio, 4),
                                  "evicted_at": r["evicted"], "honest_evicted": r["honest_evicted"],
                                  "problems": r["problems"]}), flush=True)
    print(json.dumps({"seconds": round(time.time() - t0, 1), "loadavg_after": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
