"""Probation in seeded schedules of several calls: a member quiet to one owner after its first
piece fails one call, then is done without in the next ones (``NetNode.probation``), whatever
else happens in them (docs/net.md, "Liveness")."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from intellect_jax.net import butterfly, pairing
from tests.helpers import quiet_after_first_piece, tailless, withholding_answers
from tests.test_liveness import _bucketed, _calls
from tests.test_net_ring import _same_bits

pytestmark = pytest.mark.slow  # (schedules of deadline-bound calls: among the long tests, README)


@pytest.mark.parametrize("seed", range(6))
def test_seeded_schedules_of_a_member_on_probation_over_two_calls(monkeypatch: pytest.MonkeyPatch,
                                                                  seed: int) -> None:
    """Two calls on the same 4 nodes, 1 or 2 buckets, the pairing drawn per call. In the first,
    member ``q`` sends owner ``v`` its first piece, then keeps the link open and quiet (``io_timeout``
    past the deadline, as a node sets it): the call fails, and ``v`` alone puts ``q`` on probation.
    In the second, ``q`` is quiet to ``v`` again or honest, and a third member ``b`` may withhold
    its answers and echoes in one bucket, or drop its last tail to one member in one bucket:

    * ``q`` honest: every rank completes with ``simulate``'s bits, and ``v`` takes ``q`` off
      probation;
    * ``q`` quiet, and the draw does not make ``q`` and ``v`` audit each other: every rank
      completes with ``simulate``'s bits with ``q``'s rows of segment ``v`` left out (from piece 1
      of bucket 0, which ``q`` sent, and from piece 0 of the next), and ``q`` stays on probation;
    * ``q`` quiet, and they audit each other (``q``'s row lists or challenge, or its own answer,
      have no second source): the call fails on every honest rank, ``v`` names ``q`` and nobody
      else is named, and ``q`` stays on probation with ``v`` alone.

    Whatever the mix, nobody else is ever on probation, and the mix really happened."""
    rng = np.random.default_rng(4048 + seed)  # (seeds 0-5: q honest, quiet, quiet and paired, each in 1 and 2 buckets)
    q, v = (int(r) for r in rng.choice(4, 2, replace=False))
    b = int(rng.choice([r for r in range(4) if r != q]))
    buckets, offsets = int(rng.integers(1, 3)), [int(o) for o in rng.integers(1, 4, size=2)]
    quiet_again = bool(rng.random() < 0.6)
    what = [w for w in ("answers", "tail") if rng.random() < 0.5]
    at = {w: int(rng.integers(buckets)) for w in what}
    to = int(rng.choice([r for r in range(4) if r != b]))  # (whom b drops its tail to)
    paired = (q - offsets[1]) % 4 == v or (v - offsets[1]) % 4 == q
    case = dict(q=q, v=v, b=b, buckets=buckets, offsets=offsets, quiet_again=quiet_again, what=what, at=at, to=to,
                paired=paired)
    call, seen, nodes_ = [0], [], []

    def before(c: int, nodes: list[Any]) -> None:
        call[0] = c
        seen.append([set(n.probation) for n in nodes])
        nodes_[:] = nodes

    monkeypatch.setattr(pairing, "rotation", lambda draw, world: offsets[call[0]])
    quiet = quiet_after_first_piece(monkeypatch, lambda run, o: run.rank == q and o == v and
                                    (call[0] == 0 or quiet_again))
    supplied = withholding_answers(monkeypatch, lambda run: call[0] == 1 and "answers" in what and run.rank == b
                                   and run.index == at["answers"])
    dropped = tailless(monkeypatch, lambda run, o: call[0] == 1 and "tail" in what and run.rank == b and o == to
                        and run.index == at["tail"])
    leaves, xs = _bucketed(buckets, 500 + seed)
    t0 = time.monotonic()
    (missing0, errs0, _), (missing1, errs1, outs) = _calls(740 + 5 * seed, xs, 2, io_timeout=30, deadline=6,
                                                           bucket_numel=5000, before=before)
    took = time.monotonic() - t0
    names, after = [n.name for n in nodes_], [set(n.probation) for n in nodes_]
    assert all(errs0[r] is not None for r in range(4) if r != q), (case, errs0)
    assert missing0 == [(q,) if r == v else () for r in range(4)], (case, missing0)
    assert seen[1] == [{names[q]} if r == v else set() for r in range(4)], (case, seen[1], errs0)
    if quiet_again and paired:
        assert all(errs1[r] is not None for r in range(4) if r != q), (case, errs1)
        assert missing1[v] == (q,) and all(missing1[r] == () for r in range(4) if r not in (v, q)), (case, missing1)
        assert after == seen[1], (case, after)
    else:
        assert errs1 == [None] * 4, (case, errs1)
        for i, leaf in enumerate(leaves):
            left = {v: {q: 1 if i == 0 else 0}} if quiet_again else None
            ref = butterfly.simulate(leaf, "int8", 64, 256, "clip", left=left)
            assert all(_same_bits(o[f"b{i}"], ref) for o in outs), (case, i)
        assert after == ([{names[q]} if r == v else set() for r in range(4)] if quiet_again else [set()] * 4), \
            (case, after)
    assert quiet == [(q, v)] * (2 if quiet_again else 1), (case, quiet)
    if not (quiet_again and paired):  # (a call that fails may end before b's frames are due)
        assert ("answers" in what) == any(r == b and a != q for a, r, _ in supplied), (case, supplied)
        assert all(ok for *_, ok in supplied), (case, supplied)
        assert dropped == [b] * ("tail" in what), (case, dropped)
    assert took < 40, (case, took)
