"""Seeded fault simulation of elastic DiLoCo: whole runs of N nodes in one process.

Each node is a thread running the real outer loop (:class:`~intellect_jax.diloco.loop.NodeLoop`) with the real
coordinator client, talking to the real coordinator service (membership state machine,
journal) through the in-process wire, all in the virtual time of a :class:`~.clock.SimClock`.
Only the heavy parts are stand-ins: a numpy "model" trained by a deterministic rule
(:class:`~.sim_parts.SimInner`), an in-process ring with the int8 ring's exact arithmetic, an in-process
state transport, and in-memory checkpoints that survive a node's death (its "disk").

Faults come from a seeded schedule and are injected here, around the collaborators, never in
production code: a node is SIGKILLed (during compute, at the barrier, inside the all-reduce,
after a ring that only some ranks finished, while donating, while receiving, while waiting
for admission, around its registration) or SIGSTOPped for a while; the coordinator crashes and
restarts from its journal, or is SIGSTOPped for 0.05-30 s (its clients see the timeouts a
real client sees); the coordinator starts after the founders; a node and the coordinator die
together; several nodes, or every node but one, die at once (an outage); nodes (re)start
while the coordinator is down or paused; killed nodes restart from their newest or from an
older checkpoint, or with an empty disk; checkpoints are sometimes 2-3 outer steps apart (a
restart can lose the newest state: the coordinator rolls back by itself); new nodes join; one
registers after the run has completed. The invariants checked (:meth:`Sim.check`): never two
hashes for one outer step among everything any node recorded, the run completes, every node
still alive ends cleanly (none because of a transient coordinator fault) and soon after the
run completed, no node is evicted for a stall of the coordinator's own, nothing hangs.

Modules: :mod:`.sim_plan` (parameters, faults, the seeded schedule), :mod:`.sim_world` (what
the simulated processes share, their fault points), :mod:`.sim_parts` (the stand-ins),
:mod:`.sim_driver` (:class:`Sim`: the run), :mod:`.sim_checks` (the invariants); this one is
the command line:

    python -m intellect_jax.testing.sim --seeds 0:200      # prints one line per failing seed
    python -m intellect_jax.testing.sim --seed 17 -v       # replay one seed with its event log
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from intellect_jax.testing.sim_driver import Sim
from intellect_jax.testing.sim_plan import Fault, Script, SimParams
from intellect_jax.testing.sim_world import Killed

__all__ = ["Fault", "Killed", "Script", "Sim", "SimParams", "main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.testing.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="replay one seed")
    ap.add_argument("--seeds", default="0:50", help="a range START:END of seeds")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the event log of each seed")
    ap.add_argument("--overlap", action="store_true", help="the nodes run overlapped rounds")
    ap.add_argument("--mode", default="int8", help="the exchange's codec, e.g. int8, int4, int2, int1, topk4 (chunks "
                    "of 32 values)")
    ap.add_argument("--feedback-local", type=float, default=0.0, metavar="ALPHA",
                    help="a gathered codec's local feedback (diloco.feedback_local)")
    ap.add_argument("--no-leases", action="store_true", help="nodes read their own data (no coordinator leases)")
    ap.add_argument("--exchange", default="ring", choices=("ring", "butterfly"),
                    help="butterfly: every segment's owner checks each member's signed piece (net/butterfly.py)")
    ap.add_argument("--robust", default="mean", help="the butterfly owners' aggregator: mean, clip, trim<k>, cclip")
    a = ap.parse_args(argv)
    seeds = [a.seed] if a.seed is not None else range(*map(int, a.seeds.split(":")))
    bad, total = 0, Counter()
    t0 = time.monotonic()
    for seed in seeds:
        r = Sim(seed, SimParams(overlap=a.overlap, mode=a.mode, feedback_local=a.feedback_local, leases=not a.no_leases,
                                exchange=a.exchange, robust=a.robust)).run()
        total.update(r["faults"])
        if a.verbose:
            print("\n".join(r["log"]))
        if not r["ok"]:
            bad += 1
            print(f"seed {seed}: FAILED: {'; '.join(r['problems'])}  (replay: python -m intellect_jax.testing.sim "
                  f"--seed {seed} -v)", flush=True)
    n = len(seeds)
    print(f"{n - bad}/{n} seeds passed in {time.monotonic() - t0:.1f}s; faults injected: {dict(total)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
