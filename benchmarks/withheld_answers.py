"""A real run's wall time with a member withholding its answers and echoes, signing its pieces
to one owner with garbage, or going quiet to one owner after its first piece (a script, not a test).

    python benchmarks/withheld_answers.py [--how answers|unsigned|quiet --repeats 3 --steps 8 --dim 4096]

Runs a socket coordinator and four numpy nodes in threads (``tests.helpers.socket_run``: every
part real but the model; the butterfly exchange, audited, ``int8``, robust ``clip``), clean and
with node n1 misbehaving in every bucket of every all-reduce: ``answers``, sending every auditor
but its own no answer to its challenge and no echo (each auditor then gets n1's row from the
owner it audits); ``unsigned``, signing its pieces of n0's segment with garbage (n0 leaves n1's
rows out at once, declared in its commitment); ``quiet``, sending n3 its first piece of n3's
segment, then keeping the link quiet until the deadline (10 s): the first call fails, n1 goes on
probation with n3, and from then on only the calls whose draw makes n1 and n3 audit each other
fail. The two kinds alternate so that the machine's
load falls on both alike. Checks that nobody was evicted
and that the nodes end with one state; prints each run's wall time and how many of the
victim's calls failed (n0's; n3's with ``quiet``), then one JSON line with the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from intellect_jax.net import RingConfig  # noqa: E402
from intellect_jax.net.comm import SocketCommunicator  # noqa: E402
from tests.helpers import quiet_after_first_piece, socket_run, unsigned_rows, withholding_answers  # noqa: E402

RING = RingConfig(mode="int8", piece_numel=256, deadline=10.0, exchange="butterfly", robust="clip")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--how", choices=("answers", "unsigned", "quiet"), default="answers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="outer steps per run")
    ap.add_argument("--dim", type=int, default=4096, help="model values (+8)")
    args = ap.parse_args()
    walls: dict[str, list[float]] = {"clean": [], "withheld": []}
    victim = "n3" if args.how == "quiet" else "n0"
    honest = SocketCommunicator.all_reduce_mean
    for rep in range(args.repeats):
        for kind in walls:
            mp, calls = pytest.MonkeyPatch(), []

            def counted(self: SocketCommunicator, tree: object, **kw: object) -> object:
                t0 = time.monotonic()
                try:
                    out = honest(self, tree, **kw)
                except BaseException:
                    calls.append((self.ids[self.rank], False, time.monotonic() - t0))
                    raise
                calls.append((self.ids[self.rank], True, time.monotonic() - t0))
                return out

            mp.setattr(SocketCommunicator, "all_reduce_mean", counted)
            try:
                ids = lambda run, r: run.ledger.ctx.ids[r]  # noqa: E731
                supplied = [] if kind == "clean" else \
                    withholding_answers(mp, lambda run: ids(run, run.rank) == "n1") if args.how == "answers" else \
                    unsigned_rows(mp, lambda run, o: ids(run, run.rank) == "n1" and ids(run, o) == "n0") \
                    if args.how == "unsigned" else \
                    quiet_after_first_piece(mp, lambda run, o: ids(run, run.rank) == "n1" and ids(run, o) == "n3")
                r = socket_run(4, f"withheld-{kind}-{rep}", RING, outer_steps=args.steps, dim=args.dim)
            finally:
                mp.undo()
            if r["evictions"] or len(set(r["node_hashes"])) != 1:
                sys.exit(f"{kind} run {rep}: evictions {r['evictions']}, {len(set(r['node_hashes']))} states")
            if kind == "withheld" and not supplied:
                sys.exit(f"run {rep}: no auditor asked for a row, no owner left one out, or nobody went quiet: "
                         "nothing was withheld")
            walls[kind].append(r["wall_s"])
            ok = [t for who, good, t in calls if who == victim and good]
            bad = [t for who, good, t in calls if who == victim and not good]
            print(f"{kind} run {rep}: {r['wall_s']:.2f} s; at {victim} {len(bad)} of {len(ok) + len(bad)} calls failed "
                  f"({sum(bad):.1f} s), the others took {statistics.median(ok):.2f} s (median)", flush=True)
    clean, withheld = statistics.median(walls["clean"]), statistics.median(walls["withheld"])
    print(json.dumps({"clean_s": round(clean, 3), "withheld_s": round(withheld, 3),
                      "ratio": round(withheld / clean, 3), "how": args.how, "repeats": args.repeats,
                      "steps": args.steps}))


if __name__ == "__main__":
    main()
