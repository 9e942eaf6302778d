"""Liveness of the butterfly exchange: a member that withholds its own pieces is named by the
owners it withheld them from, and nobody else is (a failure on one link cuts nobody's pieces
short on the others); the coordinator evicts a member most others name in consecutive failed
calls, and nobody when half the ring or more would be named."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest

from intellect_jax.coordinator.policing import Police
from intellect_jax.coordinator.protocol import CoordinatorConfig
from intellect_jax.coordinator.roster import Arrival, Node, Role
from intellect_jax.coordinator.schema import Missing, Report
from intellect_jax.net import RingConfig, audit, butterfly, mesh_call, pairing, relay
from intellect_jax.net.butterfly import MeshSeal
from intellect_jax.net.comm import SocketCommunicator
from intellect_jax.net.errors import FrameError, PeerClosed
from intellect_jax.net.evidence import verdict
from intellect_jax.net.frames import MsgType
from tests.helpers import (first_piece, garbling_commitment, quiet_after_first_piece, tailless, unsigned_rows,
                           withholding_aggregates, withholding_answers)
from tests.test_net_ring import _inputs, _members, _nodes, _run, _same_bits

CFG = RingConfig(deadline=3, exchange="butterfly", robust="clip", piece_numel=256)
# _withheld's deadline: half of it opens the links, and 1.5 s was once too little under the whole
# suite's load (every link of every rank timed out opening, so every rank named every other)
WITHHELD = 5.0


def _withheld(monkeypatch: pytest.MonkeyPatch, how: str, bad: tuple[int, ...] = (2,),
              first: int = 300) -> tuple[list, list, float]:
    """A butterfly call of 4 ranks over sockets in which the ranks ``bad`` misbehave as ``how``
    says; (each rank's ``missing``, each rank's error, seconds taken)."""
    honest = butterfly._ButterflyRun._scatter_to

    def scatter(self: Any, k: int) -> None:
        if self.rank in bad and how == "silent":  # in the call, its header sent, none of its pieces
            time.sleep(max(0.0, self.deadline - time.monotonic()))
            return
        if self.rank in bad and how == "garbage" and not getattr(self.mseal, "bad", False):
            sign = self.mseal.sign  # its pieces to rank 0 with a signature that does not verify

            class Bad(MeshSeal):
                bad = True
            self.mseal = Bad(lambda owner, *a: bytes(64) if owner == 0 else sign(owner, *a), self.mseal.verify)
        return honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    world = 4
    nodes = _nodes(world, first=first)
    try:
        cfgs = [RingConfig(deadline=WITHHELD, exchange="butterfly", robust="cclip" if how == "mismatch" and r in bad
                           else "clip", piece_numel=256) for r in range(world)]
        comms = [n.ring(_members(nodes), r, config=cfgs[r]) for r, n in enumerate(nodes)]
        for c in comms:
            c.inspect = lambda theirs: verdict(theirs, None)
        xs = _inputs(world, 5000)
        ranks = [r for r in range(world) if not (how == "absent" and r in bad)]
        t0 = time.monotonic()
        _, errs = _run([comms[r] for r in ranks], [xs[r] for r in ranks])
        took = time.monotonic() - t0
        missing = [comms[r].missing if r in ranks else None for r in range(world)]
        full = [None] * world
        for r, e in zip(ranks, errs):
            full[r] = e
        return missing, full, took
    finally:
        for n in nodes:
            n.close()


@pytest.mark.parametrize("how", ["silent", "absent", "mismatch"])
def test_a_member_that_withholds_its_pieces_is_named_by_every_other_owner_and_nobody_else(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Rank 2 sends its header but no piece (silent), never comes (absent: no link opens), or
    comes with another aggregator (mismatch: every link to it fails its header): every other
    rank fails and names rank 2 alone, within the deadline."""
    missing, errs, took = _withheld(monkeypatch, how, first=300 + 10 * ["silent", "absent", "mismatch"].index(how))
    assert all(errs[r] is not None for r in (0, 1, 3)), errs
    assert [missing[r] for r in (0, 1, 3)] == [(2,)] * 3, (missing, errs)
    assert took < WITHHELD + 3
    if how == "absent":  # nobody waits for it past the opening share of the deadline
        assert took < WITHHELD, took
        assert "waiting for rank 2" in str(errs[0]), errs[0]


def test_a_bad_link_cuts_nobody_s_pieces_short_on_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 2 and 3 send rank 0 pieces whose signatures do not verify: rank 0 leaves the first
    out and fails at the second (a majority of the others may not be left out), yet its own
    pieces still reach ranks 1, 2 and 3 whole, so only rank 0 names anybody (ranks 2 and 3), and
    nobody names rank 0, whose failure every other rank then meets."""
    missing, errs, _ = _withheld(monkeypatch, "garbage", bad=(2, 3), first=340)
    assert all(e is not None for e in errs), errs
    assert missing == [(2, 3), (), (), ()], (missing, errs)
    assert "does not verify" in str(errs[0]), errs[0]


@pytest.mark.parametrize("how", ["unsigned", "late"])
def test_an_owner_leaves_out_the_rows_of_one_member_unsigned_or_late_to_it(monkeypatch: pytest.MonkeyPatch,
                                                                          how: str) -> None:
    """Rank 2 sends rank 0 its pieces under signatures that do not verify, or 3 s late (past
    the row deadline; then the rest of that link on time): rank 0 aggregates the others' rows
    without them, declares rank 2 left out from the first piece in its commitment, which its
    auditor checks, and reads the late rows past. Every rank completes with the bits of
    ``simulate`` with rank 2's rows of segment 0 left out: a member can take away its own say
    in one owner's segment, and nothing else. Before, the call failed on every rank."""
    honest = butterfly._ButterflyRun._scatter_to

    def scatter(self: Any, k: int) -> None:
        if self.rank == 2 and how == "late" and butterfly.peer_of(2, 4, k) == 0:
            time.sleep(3.0)
        if self.rank == 2 and how == "unsigned" and not hasattr(self, "garbled"):
            sign = self.garbled = self.mseal.sign
            self.mseal = dataclasses.replace(self.mseal, sign=lambda owner, *a: bytes(64) if owner == 0 else
                                             sign(owner, *a))
        return honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    xs = _inputs(4, 5000, seed=11)
    missing, errs, outs = _call(monkeypatch, 670 + 5 * ["unsigned", "late"].index(how), xs, deadline=10)
    assert errs == [None] * 4, errs
    ref = butterfly.simulate(xs, "int8", 64, 256, "clip", left={0: {2: 0}})
    assert all(_same_bits(o, ref) for o in outs)
    assert not _same_bits(ref, butterfly.simulate(xs, "int8", 64, 256, "clip"))
    assert missing == [()] * 4


@pytest.mark.slow
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_a_member_quiet_to_one_owner_is_left_out_there_and_stalls_nobody(monkeypatch: pytest.MonkeyPatch,
                                                                         offset: int) -> None:
    """Rank 2 keeps its link to rank 0 open and sends nothing on it (the links' ``io_timeout``
    30 s, past the deadline, as a node sets it). Rank 0 leaves rank 2's rows out at the row
    deadline, takes its commitment and nonce as forwarded, its aggregates by relay, and does
    without its audit frames while its link stays quiet (its answers come from the owners
    audited). Every honest rank completes well before the deadline with ``simulate``'s bits
    with rank 2's rows of segment 0 left out; only rank 2 itself waits out the deadline on its
    link (a review found that an auditor waited for a left-out member's echo until its link
    timed out, which with a node's ``io_timeout`` is the deadline). Unless the draw makes rank 0 rank 2's auditor (offset
    2): rank 2's row lists have no other source, so rank 2's segment cannot be audited and the
    call fails, with rank 0 naming rank 2 (before, the call failed with every offset)."""
    honest, run, ends = butterfly._ButterflyRun._scatter_to, mesh_call.MeshCall.run, {}

    def scatter(self: Any, k: int) -> None:
        if self.rank == 2 and butterfly.peer_of(2, 4, k) == 0:
            time.sleep(max(0.0, self.deadline - time.monotonic()))
            return
        return honest(self, k)

    def timed(self: Any) -> None:
        try:
            run(self)
        finally:
            ends[self.rank] = time.monotonic() - t0

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    monkeypatch.setattr(mesh_call.MeshCall, "run", timed)
    monkeypatch.setattr(pairing, "rotation", lambda draw, world: offset)
    xs, t0 = _inputs(4, 5000, seed=11 + offset), time.monotonic()
    missing, errs, outs = _call(monkeypatch, 680 + 5 * offset, xs, io_timeout=30, deadline=10)
    if offset == 2:
        assert all(errs[r] is not None for r in (0, 1, 3)) and missing[0] == (2,), (errs, missing)
        return
    assert errs == [None] * 4, errs
    ref = butterfly.simulate(xs, "int8", 64, 256, "clip", left={0: {2: 0}})
    assert all(_same_bits(o, ref) for o in outs)
    assert max(ends[r] for r in (0, 1, 3)) < 6, ends  # (the deadline is 10 s)


@pytest.mark.slow
@pytest.mark.parametrize("offset", [1, 3])
def test_a_member_quiet_to_one_owner_after_its_first_piece_fails_one_call_not_the_next(
        monkeypatch: pytest.MonkeyPatch, offset: int) -> None:
    """Rank 2 sends rank 0 its first piece, then keeps the link open and quiet, in every call
    (``io_timeout`` 30 s, past the 10 s deadline, as a node sets it). The first call fails at
    the deadline: rank 0 leaves rank 2's rows out, but waits for its echo, since a member
    that sent us a piece may be one that colluders held back for a while, whose echo shows its
    owner splitting it off; rank 0 alone names rank 2. That puts rank 2 on probation with rank 0
    (its node's ``probation``): in the next call rank 0 gives its missing rows the shortest
    grace, does without its audit frames once it is left out and quiet, and answers its
    challenge, which never reaches it, empty (rank 2 takes that answer from the owner it
    audits), and every rank completes, the honest ones well before the deadline, with
    ``simulate``'s bits with rank 2's rows of segment 0 left out from the second piece on
    (before, every call failed at the deadline and the honest nodes left after their retries)."""
    go, ends, t0 = mesh_call.MeshCall.run, {}, [0.0]
    quiet = quiet_after_first_piece(monkeypatch, lambda run, o: run.rank == 2 and o == 0)

    def timed(self: Any) -> None:
        try:
            go(self)
        finally:
            ends[self.rank] = time.monotonic() - t0[0]

    def before(c: int, nodes: list[Any]) -> None:
        ends.clear()
        t0[0] = time.monotonic()
        if c == 1:  # (the first call put rank 2 on probation with rank 0 alone)
            assert [n.probation for n in nodes] == [{nodes[2].name}, set(), set(), set()]

    decide, declined = audit.Ledger.decide, []

    def decided(self: Any, gone: Any) -> bool:  # (which auditor took whose row from its target for a DECLINED)
        first = self.wants is None
        ok = decide(self, gone)
        if ok and first and self.declined:
            declined.append((self.rank, sorted(self.declined)))
        return ok

    monkeypatch.setattr(audit.Ledger, "decide", decided)
    monkeypatch.setattr(mesh_call.MeshCall, "run", timed)
    monkeypatch.setattr(pairing, "rotation", lambda draw, world: offset)
    xs = _inputs(4, 5000, seed=21 + offset)
    (missing, errs, _), (_, errs2, outs) = _calls(710 + 5 * offset, xs, 2, io_timeout=30, deadline=10, before=before)
    assert all(errs[r] is not None for r in (0, 1, 3)), errs
    assert missing[0] == (2,) and missing[1] == missing[3] == (), missing
    assert errs2 == [None] * 4, errs2
    ref = butterfly.simulate(xs, "int8", 64, 256, "clip", left={0: {2: 1}})
    assert all(_same_bits(o, ref) for o in outs)
    assert max(ends[r] for r in (0, 1, 3)) < 8, ends  # (the deadline is 10 s)
    assert quiet == [(2, 0)] * 2, quiet
    assert declined == [(2, [0])], declined  # rank 0's answer to rank 2's challenge, which never came


@pytest.mark.slow
@pytest.mark.parametrize("still", [0.3, 3.0, 8.0])
def test_a_member_whose_link_closes_in_step_1_is_on_probation_only_if_it_stood_still_to_the_end(
        monkeypatch: pytest.MonkeyPatch, still: float) -> None:
    """Rank 2 sends rank 0 its first piece, then, ``still`` seconds later, shuts the link (the
    deadline is 10 s). The call fails, rank 0 naming rank 2 each time. After 0.3 s, as a rank
    aborted from outside (the coordinator said the epoch broke) shuts its links while its
    pieces still go out, nobody puts rank 2 on probation: a review found that other ranks'
    aborts could otherwise put an honest member on probation, and colluders then do without
    its echo. Nor after 3 s of a still link: before step 1 goes unpaced, colluders taking turns
    to read an honest member's pieces can hold its links still that long, then have it aborted
    (found by a review). After 8 s, 3 s after its step 1 went unpaced at the latest (half the
    call after its link opened), rank 0 does: a seeded schedule found that a quiet member whose
    own deadline came first, so that its link closed a moment before rank 0's deadline, was
    never put on probation and failed every call."""
    honest = butterfly._ButterflyRun._scatter_to

    def scatter(self: Any, k: int) -> None:
        if self.rank != 2 or butterfly.peer_of(2, 4, k) != 0:
            return honest(self, k)
        conn = first_piece(self, k)
        time.sleep(still)
        conn.abort()
        raise PeerClosed("rank 2: aborted from outside")

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    seen: list[Any] = []
    [(missing, errs, _)] = _calls({0.3: 730, 3.0: 735, 8.0: 770}[still], _inputs(4, 5000, seed=31), 1,
                                  io_timeout=30, deadline=10, before=lambda c, nodes: seen.extend(nodes))
    assert all(e is not None for e in errs), errs
    assert missing[0] == (2,), missing
    assert [n.probation for n in seen] == [{seen[2].name} if still > 5 else set(), set(), set(), set()]


@pytest.mark.slow
def test_a_member_that_started_late_and_stood_still_while_paced_is_not_put_on_probation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 1 and 3 start their calls 1.5 s after rank 0, rank 2 2.5 s after it (links open
    within the first half of the 10-s deadline). Rank 2 sends rank 0 its first piece while
    rank 0 still waits for its rows, then its link stands still, as an honest member's does
    while colluders taking turns to read its pieces hold its pacing (which runs to half the
    call from its own start), and it is aborted from outside 8.5 s into rank 0's call, in its
    last quarter. Rank 0 names it, but does not put it on probation: its step 1 may have been
    paced until 7.5 s or later (a review found that a rule counting a close in the call's last
    quarter put it on probation)."""
    honest, call = butterfly._ButterflyRun._scatter_to, SocketCommunicator.all_reduce_mean

    def late(self: Any, tree: Any, **kw: Any) -> Any:
        time.sleep({0: 0.0, 1: 1.5, 2: 2.5, 3: 1.5}[self.rank])
        return call(self, tree, **kw)

    def scatter(self: Any, k: int) -> None:
        if self.rank != 2 or butterfly.peer_of(2, 4, k) != 0:
            return honest(self, k)
        conn = first_piece(self, k)
        time.sleep(max(0.0, t0[0] + 8.5 - time.monotonic()))
        conn.abort()
        raise PeerClosed("rank 2: aborted from outside")

    t0: list[float] = [0.0]
    monkeypatch.setattr(SocketCommunicator, "all_reduce_mean", late)
    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    seen: list[Any] = []

    def before(c: int, nodes: list[Any]) -> None:
        seen.extend(nodes)
        t0[0] = time.monotonic()

    [(missing, errs, _)] = _calls(775, _inputs(4, 5000, seed=33), 1, io_timeout=30, deadline=10, before=before)
    assert all(e is not None for e in errs), errs
    assert missing[0] == (2,), missing
    assert [n.probation for n in seen] == [set()] * 4


@pytest.mark.slow
def test_a_member_that_sends_a_frame_header_alone_after_its_first_piece_is_still_put_on_probation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 sends rank 0 its first piece, then keeps the link quiet, but 7 s into the 10-s
    call sends the header of its next piece without the piece. Rank 0's transport counts the
    header's bytes when it comes, so a look at the link's bytes saw it move (a review found that
    this kept a quiet member off probation); only a whole piece counts now, and rank 0 puts it on
    probation."""
    from intellect_jax.net.frames import pack_header, payload_tag

    honest, headers = butterfly._ButterflyRun._scatter_to, []

    def scatter(self: Any, k: int) -> None:
        if self.rank != 2 or butterfly.peer_of(2, 4, k) != 0:
            return honest(self, k)
        conn = first_piece(self, k)
        time.sleep(max(0.0, self.deadline - 3.0 - time.monotonic()))
        nxt = self._encode(0, 1)
        tag = payload_tag(memoryview(nxt), conn.cfg.integrity)
        hdr = pack_header(MsgType.DATA, conn._run, conn._send_seq, nxt.nbytes, tag, conn.cfg.integrity)
        conn._send_seq += 1
        conn._send_views([memoryview(hdr)], self.deadline, "a header alone")
        headers.append(time.monotonic())
        time.sleep(max(0.0, self.deadline + 1.0 - time.monotonic()))

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    seen: list[Any] = []
    [(missing, errs, _)] = _calls(780, _inputs(4, 5000, seed=35), 1, io_timeout=30, deadline=10,
                                  before=lambda c, nodes: seen.extend(nodes))
    assert headers, "no header was sent"
    assert all(errs[r] is not None for r in (0, 1, 3)), errs
    assert missing[0] == (2,), missing
    assert [n.probation for n in seen] == [{seen[2].name}, set(), set(), set()]


@pytest.mark.slow
def test_a_member_that_holds_its_first_piece_back_but_not_its_link_is_still_put_on_probation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 1 and 3 start 2 s after rank 0 (so rank 0's row deadline comes after 4 s). Rank
    2's link to rank 0 opens with its own start, on time, but it sends its first piece only 2.8
    s into rank 0's 10-s call, before rank 0 left it out, then keeps the link quiet. Its link
    opened after its call had started, so its step 1 went unpaced by about 5 s, and rank 0 puts
    it on probation (a review found that a rule counting from its first piece let it escape: a
    first piece that late looks like a late start)."""
    honest, call, t0 = butterfly._ButterflyRun._scatter_to, SocketCommunicator.all_reduce_mean, [0.0]

    def late(self: Any, tree: Any, **kw: Any) -> Any:
        time.sleep({0: 0.0, 1: 2.0, 2: 0.0, 3: 2.0}[self.rank])
        return call(self, tree, **kw)

    def scatter(self: Any, k: int) -> None:
        if self.rank != 2 or butterfly.peer_of(2, 4, k) != 0:
            return honest(self, k)
        first_piece(self, k, at=t0[0] + 2.8)
        time.sleep(max(0.0, self.deadline + 1.0 - time.monotonic()))

    def before(c: int, nodes: list[Any]) -> None:
        seen.extend(nodes)
        t0[0] = time.monotonic()

    monkeypatch.setattr(SocketCommunicator, "all_reduce_mean", late)
    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    seen: list[Any] = []
    [(missing, errs, _)] = _calls(785, _inputs(4, 5000, seed=37), 1, io_timeout=30, deadline=10, before=before)
    assert all(errs[r] is not None for r in (0, 1, 3)), errs
    assert missing[0] == (2,), missing
    assert [n.probation for n in seen] == [{seen[2].name}, set(), set(), set()]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="open (issue 22, docs/net.md limits): a member quiet to one member after "
                   "step 1 is not left out, so that member's audit waits for its frames; every call fails")
def test_a_member_quiet_to_one_member_after_step_1_fails_one_call_not_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 sends rank 0 every piece of its own, then keeps the link open and quiet in step 3
    (no aggregates, no audit frames, no tail), in every call; the draw never makes the two audit
    each other (rank 0 audits segment 3, rank 2 segment 1). What rank 0 needs of rank 2 on that
    link has a second source (its aggregates and tail by relay, its answer from the owner rank 0
    audits) but its challenge, which rank 0 must answer (it fails with "rank 2's challenge not
    ready before the deadline"), and its echo, which rank 0's own audit waits for: every call
    fails, with nobody named (rank 2's pieces all came). What the issue asks: as with a member
    quiet after its first piece, at most the first call fails; here the second fails too
    (strict: this test passes once that is fixed)."""
    gather = butterfly._ButterflyRun._gather_to

    def gather_to(self: Any, k: int) -> None:
        if self.rank == 2 and butterfly.peer_of(self.rank, self.world, k) == 0:
            time.sleep(max(0.0, self.deadline + 1.0 - time.monotonic()))
            return
        gather(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_gather_to", gather_to)
    monkeypatch.setattr(pairing, "rotation", lambda draw, world: 1)
    xs = _inputs(4, 5000, seed=31)
    _, (_, errs2, outs) = _calls(800, xs, 2, io_timeout=30, deadline=4)
    assert errs2 == [None] * 4, errs2
    assert all(_same_bits(o, outs[0]) for o in outs)


@pytest.mark.slow
def test_a_member_whose_first_piece_comes_after_it_was_left_out_then_quiet_stalls_nobody(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 starts its call 2.5 s after the others, so every owner leaves its rows out before
    any piece of it came; it then sends rank 0 one piece and keeps that link quiet (the pairing
    fixed so that ranks 0 and 2 do not audit each other; the deadline 16 s). Once its step 1
    has gone unpaced at the latest (half the call after its link opened) rank 0 does without its
    audit frames, as it does for a member that never sent a piece (``MeshCall.unheard_still``),
    and every rank completes with ``simulate``'s bits with rank 2's rows left out of every other
    segment (before, a piece that came after it was left out made rank 0 wait for its echo, and
    the call failed; found by review: such a member also escapes probation, since it cannot be
    told from a late starter)."""
    call = SocketCommunicator.all_reduce_mean

    def late(self: Any, tree: Any, **kw: Any) -> Any:
        if self.rank == 2:
            time.sleep(2.5)
        return call(self, tree, **kw)

    monkeypatch.setattr(SocketCommunicator, "all_reduce_mean", late)
    quiet = quiet_after_first_piece(monkeypatch, lambda run, o: run.rank == 2 and o == 0)
    monkeypatch.setattr(pairing, "rotation", lambda draw, world: 1)
    xs = _inputs(4, 5000, seed=39)
    missing, errs, outs = _call(monkeypatch, 790, xs, io_timeout=30, deadline=16)
    assert quiet == [(2, 0)], quiet
    assert errs == [None] * 4, errs
    ref = butterfly.simulate(xs, "int8", 64, 256, "clip", left={c: {2: 0} for c in (0, 1, 3)})
    assert all(_same_bits(o, ref) for o in outs)


def _call(monkeypatch: pytest.MonkeyPatch, first: int, xs: list[Any], io_timeout: float = 5.0,
          **cfg: Any) -> tuple[list, list, list]:
    """One butterfly call of 4 ranks over sockets with the patches already in place; (each
    rank's ``missing``, each rank's error, each rank's result)."""
    return _calls(first, xs, 1, io_timeout, **cfg)[0]


def _calls(first: int, xs: list[Any], calls: int, io_timeout: float = 5.0, before: Any = None,
           **cfg: Any) -> list[tuple[list, list, list]]:
    """``calls`` butterfly calls of 4 ranks over sockets, one after the other on the same
    nodes (a communicator per call and epoch, as a node makes for each retry), with the patches
    already in place; ``before(c, nodes)`` runs before call ``c``. For each call (each rank's
    ``missing``, each rank's error, each rank's result)."""
    nodes, got = _nodes(4, first=first, io_timeout=io_timeout), []  # (before(c, nodes))
    try:
        for c in range(calls):
            comms = [n.ring(_members(nodes), r, epoch=c, config=RingConfig(**{
                **dict(deadline=CFG.deadline, exchange="butterfly", robust="clip", piece_numel=256), **cfg}))
                for r, n in enumerate(nodes)]
            for comm in comms:
                comm.inspect = lambda theirs: verdict(theirs, None)
            if before is not None:
                before(c, nodes)
            outs, errs = _run(comms, xs)
            got.append(([comm.missing for comm in comms], errs, outs))
            for comm in comms:
                comm.close()
        return got
    finally:
        for n in nodes:
            n.close()


@pytest.mark.parametrize("how", ["dropped", "closed"])
def test_a_failure_in_one_bucket_gets_nobody_named_for_the_next(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Two buckets: rank 2 withholds the last 4 bytes of its bucket-0 aggregate from rank 0 only
    (``dropped``), or closes its link to rank 0 there (``closed``). Its bucket-1 pieces went out
    before any bucket's gather, so nobody lacks them and nobody is named (when each bucket's
    step 1 followed the bucket before, rank 0 never sent them, and all three named it). What
    comes in place of the tail is bucket 1's mark, out of step: rank 0 reads the link on from
    there (``_ButterflyRun.resync``) and gets the last piece of bucket 0 relayed, and every rank
    completes with the same bits (before, that link ended there, and with it rank 2's bucket-1
    audit frames: rank 0 failed). A closed link still fails the call (a failing rank tells its
    neighbours so)."""
    honest = butterfly._ButterflyRun._gather_to

    def gather(self: Any, k: int) -> None:
        if self.rank == 2 and self.x.shape[0] == 5000 and butterfly.peer_of(2, self.world, k) == 0:
            conn = self.links.out[k]
            send = conn.send

            def tailless(t: MsgType, payload: Any = b"", **kw: Any) -> Any:
                if getattr(payload, "nbytes", 0) != butterfly.TAIL:
                    return send(t, payload, **kw)
                if how == "closed":
                    conn.abort()
                return None
            conn.send = tailless
        honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_gather_to", gather)
    a, b = _inputs(4, 5000), _inputs(4, 3000, seed=1)
    missing, errs, outs = _call(monkeypatch, 360 + 5 * ["dropped", "closed"].index(how),
                                [{"a": a[r], "b": b[r]} for r in range(4)], bucket_numel=5000, deadline=6)
    assert all(m == () for m in missing), (missing, errs)
    if how == "closed":
        assert errs[0] is not None, errs
        return
    assert errs == [None] * 4, errs
    for leaf, xs in (("a", a), ("b", b)):
        assert all(_same_bits(o[leaf], butterfly.simulate(xs, "int8", 64, 256, "clip")) for o in outs)


def _skip_aggregates(monkeypatch: pytest.MonkeyPatch, owner: int, victim: int) -> None:
    """``owner`` sends ``victim`` none of its aggregates (its audit frames and POST frames it does)."""
    withholding_aggregates(monkeypatch, lambda run, k: run.rank == owner and
                           butterfly.peer_of(owner, run.world, k) == victim)


def _skip_one_bucket(monkeypatch: pytest.MonkeyPatch, owner: int, victim: int, bucket: int) -> list[Any]:
    """``owner`` sends ``victim`` none of bucket ``bucket``'s aggregates (its audit frames, and every
    other bucket's aggregates, it does); the types of the frames it dropped go into the list."""
    honest, dropped = butterfly._ButterflyRun._gather_to, []

    def gather(self: Any, k: int) -> None:
        conn = self.links.out[k]
        if self.rank == owner and self.index == bucket and butterfly.peer_of(owner, self.world, k) == victim:
            send = conn.send
            conn.send = lambda t, payload=b"", **kw: dropped.append(t) if t == MsgType.DATA else send(t, payload, **kw)
            try:
                honest(self, k)
            finally:
                del conn.send
        else:
            honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_gather_to", gather)
    return dropped


def _bucketed(buckets: int, seed: int) -> tuple[list, list]:
    """Inputs of 4 ranks in 1 to 3 buckets (with ``bucket_numel`` 5000): (each bucket's inputs,
    each rank's tree)."""
    leaves = [_inputs(4, n, seed=seed + i) for i, n in enumerate([5000, 3000, 4000][:buckets])]
    return leaves, [{f"b{i}": leaf[r] for i, leaf in enumerate(leaves)} for r in range(4)]


def _outs(first: int, xs: list[Any], cfg: RingConfig = CFG) -> tuple[list, list]:
    """One butterfly call of 4 ranks over sockets with the patches already in place; (each
    rank's result, each rank's error)."""
    nodes = _nodes(4, first=first)
    try:
        return _run([n.ring(_members(nodes), r, config=cfg) for r, n in enumerate(nodes)], xs)
    finally:
        for n in nodes:
            n.close()


@pytest.mark.parametrize("buckets", [1, 3])
def test_an_owner_s_aggregates_withheld_from_one_member_are_relayed_to_it(monkeypatch: pytest.MonkeyPatch,
                                                                          buckets: int) -> None:
    """Rank 2 sends rank 0 its audit frames but none of its aggregates (and says DONE in their
    place). Rank 0 asks a member that said DONE for them, checks each against rank 2's
    commitment, and completes: every rank returns the same bits, well before the deadline (before,
    rank 0 failed at the deadline and the three others completed: rank 0 was removed as behind).
    With three buckets, each bucket's first audit frame comes where its previous bucket's
    aggregates were due, and rank 0 reads on (before, its link from rank 2 ended there, and with
    it rank 2's later audit frames: rank 0 failed)."""
    _skip_aggregates(monkeypatch, owner=2, victim=0)
    sizes = [5000, 3000, 4000][:buckets]
    leaves = [_inputs(4, n, seed=i) for i, n in enumerate(sizes)]
    xs = [{f"b{i}": leaf[r] for i, leaf in enumerate(leaves)} for r in range(4)]
    t0 = time.monotonic()
    outs, errs = _outs(380 + 3 * buckets, xs, dataclasses.replace(CFG, bucket_numel=5000))
    took = time.monotonic() - t0
    assert errs == [None] * 4, errs
    for i, leaf in enumerate(leaves):
        assert all(_same_bits(o[f"b{i}"], butterfly.simulate(leaf, "int8", 64, 256, "clip")) for o in outs)
    assert took < CFG.deadline * 0.8, took


def _altering_relayer(monkeypatch: pytest.MonkeyPatch, rank: int, what: str) -> list[int]:
    """``rank`` flips a byte in every piece it relays (``piece``), or in the owner's signature
    that its audit passed (``pass``); one entry goes into the list returned for each."""
    serve, relayed = relay.Relay._serve, []

    def altered(self: Any, conn: Any, i: int, q: int, first: int) -> None:
        if self.rank == rank:
            send = conn.send

            def flip(t: MsgType, payload: Any = b"", **kw: Any) -> Any:
                sig = isinstance(payload, bytes) and len(payload) == 64
                if t == MsgType.DATA and sig == (what == "pass"):
                    payload = np.array(bytearray(payload), np.uint8, copy=True)
                    payload[-1] ^= 1
                    relayed.append(1)
                return send(t, payload, **kw)
            conn = type("Flip", (), {"send": staticmethod(flip)})()
        serve(self, conn, i, q, first)

    monkeypatch.setattr(relay.Relay, "_serve", altered)
    return relayed


def test_an_owner_that_withholds_one_bucket_s_aggregates_only_is_read_on_in_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 sends rank 0 none of its first bucket's aggregates but all of its second's (its
    audit frames all along). Its second bucket starts with an aggregate, not an audit frame (its
    first aggregate goes out before it can commit), so only a mark at the start of each bucket's
    gather tells rank 0 that the first bucket's aggregates were skipped; rank 0 asks for them by
    relay and reads the second bucket on, and every rank completes with the same bits, well
    before the deadline (found by review, 2026-11-28)."""
    dropped = _skip_one_bucket(monkeypatch, owner=2, victim=0, bucket=0)
    audit_out, first = butterfly._ButterflyRun._audit_out, []

    def data_first(self: Any, conn: Any, o: int, wait: bool) -> bool:
        if self.rank == 2 and self.index == 1 and o == 0 and not wait and not first:
            first.append(True)  # (its first aggregate goes first, as when it cannot commit yet)
            return True
        return audit_out(self, conn, o, wait)

    monkeypatch.setattr(butterfly._ButterflyRun, "_audit_out", data_first)
    a, b = _inputs(4, 5000, seed=31), _inputs(4, 3000, seed=32)
    cfg = dataclasses.replace(CFG, bucket_numel=5000)
    t0 = time.monotonic()
    outs, errs = _outs(500, [{"a": a[r], "b": b[r]} for r in range(4)], cfg)
    took = time.monotonic() - t0
    assert errs == [None] * 4, errs
    assert dropped, "nothing was withheld"
    for leaf, xs in (("a", a), ("b", b)):
        assert all(_same_bits(o[leaf], butterfly.simulate(xs, "int8", 64, 256, "clip")) for o in outs)
    assert took < CFG.deadline * 0.8, took


@pytest.mark.parametrize("what", ["piece", "pass"])
def test_a_relayer_that_alters_what_it_relays_is_passed_over(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """As above, and rank 1 flips a byte in every piece it relays (``piece``), or in rank 2's
    signature that its audit passed, which must come with its last piece (``pass``: so a
    relayer that found an auditor's held-back tail from its committed digest cannot complete a
    member before that audit); rank 3 says DONE a second late. Rank 0 asks rank 1 first, drops
    what does not hold, then asks rank 3, and completes with the same bits as every other rank."""
    _skip_aggregates(monkeypatch, owner=2, victim=0)
    relayed, post_out = _altering_relayer(monkeypatch, 1, what), relay.Relay.post_out

    def late(self: Any, k: int) -> None:
        if self.rank == 3:
            time.sleep(1.0)
        post_out(self, k)

    monkeypatch.setattr(relay.Relay, "post_out", late)
    xs = _inputs(4, 5000)
    outs, errs = _outs(390 + 5 * ["piece", "pass"].index(what), xs, dataclasses.replace(CFG, deadline=6))
    assert errs == [None] * 4, errs
    assert relayed, "rank 1 relayed nothing: the test did not test it"
    assert all(_same_bits(o, butterfly.simulate(xs, "int8", 64, 256, "clip")) for o in outs)


@pytest.mark.parametrize("seed", range(12))
def test_seeded_schedules_of_an_owner_withholding_from_one_member_complete_everywhere(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """A seeded schedule of what one owner does to one member, over 1 to 3 buckets: it withholds
    all its aggregates, or one bucket's, or sends other ones than it commits to (piece 0's, or
    every piece's), and
    garbles its commitment, its nonce, both or neither (something in all), and a third rank may
    alter what it relays if asked. Whatever the mix, every rank completes with the same bits as
    ``butterfly.simulate``, within the deadline, and the mix really happened."""
    rng = np.random.default_rng(seed)
    owner, victim = (int(r) for r in rng.choice(4, 2, replace=False))
    agg = (None, "withheld", "altered", "altered-first", "withheld-one")[int(rng.integers(5))]
    what = [w for w in ("commitment", "nonce") if rng.random() < 0.6]
    agg = agg if agg or what else "withheld"
    buckets, alter = int(rng.integers(1, 4)), rng.random() < 0.5 and agg is not None
    link = (victim - owner - 1) % 4  # (mesh link of the owner that joins the victim)
    altered = [] if agg not in ("altered", "altered-first") else _altering(monkeypatch, owner, victim,
                                                                          agg == "altered-first")
    one = int(rng.integers(buckets)) if agg == "withheld-one" else None
    dropped = [] if one is None else _skip_one_bucket(monkeypatch, owner=owner, victim=victim, bucket=one)
    if agg == "withheld":
        _skip_aggregates(monkeypatch, owner=owner, victim=victim)
    garbled = [] if not what else garbling_commitment(
        monkeypatch, lambda run, conn: run.rank == owner and conn is run.links.out[link], tuple(what))
    if alter:  # (the victim's first peer but the owner: the one it asks first if both others said DONE)
        _altering_relayer(monkeypatch, next(p for p in ((victim + 1 + k) % 4 for k in range(3)) if p != owner), "piece")
    leaves, xs = _bucketed(buckets, seed)
    cfg = dataclasses.replace(CFG, bucket_numel=5000, deadline=6)
    t0 = time.monotonic()
    outs, errs = _outs(460 + 4 * seed, xs, cfg)
    took = time.monotonic() - t0
    case = dict(owner=owner, victim=victim, agg=agg, one=one, what=what, buckets=buckets, alter=alter)
    assert errs == [None] * 4, (case, errs)
    for i, leaf in enumerate(leaves):
        assert all(_same_bits(o[f"b{i}"], butterfly.simulate(leaf, "int8", 64, 256, "clip")) for o in outs), case
    assert took < cfg.deadline * 0.8, (case, took)
    assert len(garbled) == buckets * len(what), (case, garbled)
    assert bool(altered) == (agg is not None and agg.startswith("altered")), (case, altered)
    assert bool(dropped) == (agg == "withheld-one"), (case, dropped)


@pytest.mark.parametrize("what,buckets,bucket", [("answer", 1, 0), ("echo", 1, 0), ("both", 1, 0), ("both", 3, 2),
                                                 ("both", 3, 0), ("answer", 3, 1)])
def test_a_member_withholding_its_answers_or_echoes_stalls_nobody(monkeypatch: pytest.MonkeyPatch, what: str,
                                                                  buckets: int, bucket: int) -> None:
    """Rank 1 sends every auditor but its own no answer to its challenge (``answer``), no echo of
    the commitment it audits (``echo``), or neither, in one bucket (its next frame on the link is
    then out of step). Each such auditor, once that link is out of step, asks the owner it audits
    for rank 1's row, which that owner holds under rank 1's signature and committed to, checks
    it against the row list, and judges without the echoes that have not come; in a bucket but
    the last it reads the link on from the next bucket's mark. Every rank completes with the
    same bits as ``butterfly.simulate``, within the deadline (before, the call failed on every
    rank, naming nobody, and was retried until the honest nodes left)."""
    supplied = withholding_answers(monkeypatch, lambda run: run.rank == 1 and
                                   run.index == bucket % len(run.mesh.buckets), what)
    sizes = [5000, 3000, 4000][:buckets]
    leaves = [_inputs(4, n, seed=40 + i) for i, n in enumerate(sizes)]
    xs = [{f"b{i}": leaf[r] for i, leaf in enumerate(leaves)} for r in range(4)]
    cfg = dataclasses.replace(CFG, bucket_numel=5000, deadline=8)
    t0 = time.monotonic()
    cases = [("answer", 1, 0), ("echo", 1, 0), ("both", 1, 0), ("both", 3, 2), ("both", 3, 0), ("answer", 3, 1)]
    outs, errs = _outs(560 + 5 * cases.index((what, buckets, bucket)), xs, cfg)
    took = time.monotonic() - t0
    assert errs == [None] * 4, errs
    for i, leaf in enumerate(leaves):
        assert all(_same_bits(o[f"b{i}"], butterfly.simulate(leaf, "int8", 64, 256, "clip")) for o in outs)
    assert took < cfg.deadline * 0.75, took
    if what == "echo":  # (its answers came: nobody asks for its rows)
        assert supplied == [], supplied
    else:  # every auditor but rank 1 itself and its own auditor
        assert len(supplied) == 2 and all(r == 1 and ok for _, r, ok in supplied), supplied


def test_a_link_out_of_step_before_its_challenge_is_read_on_and_its_answer_done_without(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two buckets, the pairing fixed (rank r audits r - 2, so ranks 0 and 1 do not audit each
    other). In bucket 0 rank 1 sends rank 0 its commitment one byte short: rank 0's link from it
    is out of step at once, and rank 0 reads it on from bucket 1's mark, so it never gets rank
    1's challenge. From that frame on, rank 0 does without rank 1's bucket-0 frames (its
    commitment and nonce come forwarded, its aggregates by relay) and sends rank 1 no answer;
    rank 1, reading something else where that answer was due, asks the owner it audits for
    rank 0's row. Every rank completes with the same bits (found by review: rank 0 first waited
    for the challenge the skipped frames held, rank 1 for its answer, and the call failed)."""
    from intellect_jax.net import audit_frames, pairing

    monkeypatch.setattr(pairing, "rotation", lambda draw, world: 2)
    commit, short = audit_frames.AuditFrames._commit_to, []

    def commit_to(self: Any, conn: Any) -> bool:
        if self.rank == 1 and self.index == 0 and conn is self.links.out[2]:  # (its link to rank 0)
            head, sig, _ = self.ledger.commit
            short.append(1)
            return self._audit_frame(conn, head[:-1]) and self._audit_frame(conn, sig)
        return commit(self, conn)

    monkeypatch.setattr(audit_frames.AuditFrames, "_commit_to", commit_to)
    a, b = _inputs(4, 5000, seed=51), _inputs(4, 3000, seed=52)
    outs, errs = _outs(610, [{"a": a[r], "b": b[r]} for r in range(4)],
                       dataclasses.replace(CFG, bucket_numel=5000, deadline=8))
    assert short, "nothing was sent short"
    assert errs == [None] * 4, errs
    for leaf, xs in (("a", a), ("b", b)):
        assert all(_same_bits(o[leaf], butterfly.simulate(xs, "int8", 64, 256, "clip")) for o in outs)


@pytest.mark.parametrize("seed", range(10))
def test_seeded_schedules_of_a_member_out_of_step_complete_everywhere(monkeypatch: pytest.MonkeyPatch,
                                                                     seed: int) -> None:
    """A seeded schedule of what one member does, over 1 to 3 buckets and a fixed pairing:
    it withholds its answers and echoes from every auditor but its own in one bucket, sends one
    member its commitment a byte short in one bucket (so that member's link from it is out of
    step from there: only where neither of the two audits the other, since their row lists and
    challenges have no second source), and drops its last tail to one member in one bucket
    (something in all); and, drawn apart, signs its pieces to the victim with garbage in one
    bucket (the victim leaves its rows out from there on, for the rest of the call). Whatever
    the mix, every rank completes with the same bits as ``butterfly.simulate`` (with those
    rows left out), well within the deadline, and the mix really happened."""
    from intellect_jax.net import audit_frames, pairing

    rng = np.random.default_rng(1212 + seed)  # (seeds 0-9 put each behaviour in a bucket but the last 4 times)
    bad, victim = (int(r) for r in rng.choice(4, 2, replace=False))
    offset, buckets = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    paired = (bad - offset) % 4 == victim or (victim - offset) % 4 == bad
    what = [w for w in ("answers", "early", "tail") if rng.random() < 0.6 and not (w == "early" and paired)] or \
        ["answers"]
    at = {w: int(rng.integers(buckets)) for w in what}
    link = (victim - bad - 1) % 4  # (the mesh link of the bad member that joins the victim)
    apart = np.random.default_rng(1313 + seed)  # (its own stream: the draws above stay as they were)
    unsigned = int(apart.integers(buckets)) if apart.random() < 0.5 else None
    monkeypatch.setattr(pairing, "rotation", lambda draw, world: offset)
    supplied = withholding_answers(monkeypatch, lambda run: run.rank == bad and run.index == at["answers"]) \
        if "answers" in what else []
    commit, done = audit_frames.AuditFrames._commit_to, []
    scatter = butterfly._ButterflyRun._scatter_to

    def scatter_to(self: Any, k: int) -> None:
        if self.rank == bad and self.index == unsigned and not hasattr(self, "garbled"):
            sign = self.garbled = self.mseal.sign
            self.mseal = dataclasses.replace(self.mseal, sign=lambda o, *a: bytes(64) if o == victim else sign(o, *a))
            done.append("unsigned")
        return scatter(self, k)

    def commit_to(self: Any, conn: Any) -> bool:
        if "early" in what and self.rank == bad and self.index == at["early"] and conn is self.links.out[link]:
            head, sig, _ = self.ledger.commit
            done.append("early")
            return self._audit_frame(conn, head[:-1]) and self._audit_frame(conn, sig)
        return commit(self, conn)

    monkeypatch.setattr(audit_frames.AuditFrames, "_commit_to", commit_to)
    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter_to)
    dropped = tailless(monkeypatch, lambda run, o: "tail" in what and run.rank == bad and run.index == at["tail"]
                       and o == victim)
    leaves, xs = _bucketed(buckets, 200 + seed)
    cfg = dataclasses.replace(CFG, bucket_numel=5000, deadline=8)
    t0 = time.monotonic()
    outs, errs = _outs(620 + 4 * seed, xs, cfg)
    took = time.monotonic() - t0
    case = dict(bad=bad, victim=victim, offset=offset, buckets=buckets, what=what, at=at, unsigned=unsigned)
    assert errs == [None] * 4, (case, errs)
    for i, leaf in enumerate(leaves):
        left = {victim: {bad: 0}} if unsigned is not None and i >= unsigned else None
        assert all(_same_bits(o[f"b{i}"], butterfly.simulate(leaf, "int8", 64, 256, "clip", left=left))
                   for o in outs), case
    assert took < cfg.deadline * 0.75, (case, took)
    done += ["tail"] * bool(dropped)
    assert sorted(set(done)) == sorted([w for w in what if w != "answers"] + ["unsigned"] * (unsigned is not None)), \
        (case, done)
    assert ("answers" in what) == bool(supplied), (case, supplied)


def test_an_owner_that_supplies_another_row_than_it_committed_to_completes_nobody(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above (rank 1 answers only its own auditor), and every owner alters the rows it
    supplies (two members in league: a withholder and an owner): no supplied row is the one the
    row list commits to, so none is taken for rank 1's answer, the audits wait on and every
    rank fails at the deadline; nobody applies a row its sender did not sign."""
    from intellect_jax.net import audit_frames

    supplied, honest = withholding_answers(monkeypatch, lambda run: run.rank == 1), audit_frames.AuditFrames._supply

    def supply(self: Any, conn: Any, o: int) -> bool:
        def send(t: MsgType, payload: Any, **kw: Any) -> Any:
            if len(payload) > self.world:  # (a row, not the request read back)
                payload = bytes(payload)[:-1] + bytes([bytes(payload)[-1] ^ 1])
            return conn.send(t, payload, **kw)
        return honest(self, type("Altering", (), {"send": staticmethod(send)})(), o)

    monkeypatch.setattr(audit_frames.AuditFrames, "_supply", supply)
    xs = _inputs(4, 5000, seed=44)
    outs, errs = _outs(600, xs, dataclasses.replace(CFG, deadline=4))
    assert all(e is not None for e in errs), errs
    assert supplied and not any(ok for *_, ok in supplied), supplied


def test_a_link_that_fails_after_its_owner_skipped_a_bucket_dooms_the_call_in_time() -> None:
    """An owner's link that gave up one bucket's aggregates (a skip: read on) and then fails for
    real (a frame out of place) dooms the call once no peer has said DONE for as long again as
    the call had taken, as any failed owner's link does: the skip recorded first must not hide
    the failure until the deadline. So do aggregates other than committed, though that link is
    read on (both found by review, 2026-11-28)."""
    class Mesh(relay.Relay):
        rank, world = 0, 4

        def __init__(self) -> None:
            self.cond = threading.Condition()
            self._init_relay(True)

    m = Mesh()
    m.lost(1, 1, None, skipped=True)
    assert m._doomed(time.monotonic() + 60) is None  # (a skip alone dooms nothing: its aggregates are relayed)
    failure = FrameError("rank 2: its aggregates are not the ones it committed to")
    m.lost(1, 1, failure)
    assert m._doomed(time.monotonic()) is None and m._doomed(time.monotonic() + 1.5) is failure
    assert 2 in m.mute
    # aggregates other than committed: the link is read on, yet the call is doomed if nobody says DONE
    # for as long again as the call had taken once that link's gather ended (before, the members that
    # could relay them may still be in their own gathers)
    m = Mesh()
    m.lost(1, 2, failure, skipped=True)
    assert m._doomed(time.monotonic() + 60) is None
    m.gathered_from(2)
    assert m._doomed(time.monotonic()) is None and m._doomed(time.monotonic() + 1.5) is failure
    assert 3 not in m.mute and not m.ended[1][2] and 2 not in m.dirty
    m.done_from[0], m.first_done = True, time.monotonic()  # (a peer said DONE: it may relay them)
    assert m._doomed(time.monotonic() + 60) is None


def test_no_member_completes_by_relay_before_an_auditor_s_audit_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2's audit never ends, so it never sends its last piece's tail. Rank 1 holds that
    whole piece anyway (here taken from rank 2's memory; a real attacker finds the 4 bytes from
    the piece's committed digest), says DONE without holding the whole result, and relays it,
    with a signature of its own making in place of rank 2's that its audit passed. Ranks 0 and
    3 must not place it: nobody completes, as before the relay (the tail is what keeps every
    rank from applying a result whose audit has not passed)."""
    leak: dict[str, Any] = {}
    encoder, whole, held, audit_end = (butterfly._ButterflyRun.encoder, butterfly._ButterflyRun.whole,
                                       butterfly._ButterflyRun.held, butterfly._ButterflyRun._audit_end)

    def encode(self: Any) -> None:
        encoder(self)
        if self.rank == 2:
            leak["wire"] = np.array(self.agg[-1], copy=True)

    def hang(self: Any, conn: Any, o: int) -> bool:
        if self.rank == 2:  # every audit frame out, but never the tail
            self._audit_out(conn, o, wait=True)
            time.sleep(max(0.0, self.deadline - time.monotonic()))
            return False
        return audit_end(self, conn, o)

    def fake_whole(self: Any) -> bool:
        return whole(self) or self.rank == 1 and all(self.unsettled(q) in (None, self.plan.pieces - 1)
                                                     for q in range(self.world))

    def fake_held(self: Any, q: int, j: int) -> Any:
        if self.rank == 1 and q == 2 and j == self.plan.pieces - 1 and "wire" in leak:
            leak["relayed"] = True
            return leak["wire"], bytes(64)
        return held(self, q, j)

    monkeypatch.setattr(butterfly._ButterflyRun, "encoder", encode)
    monkeypatch.setattr(butterfly._ButterflyRun, "_audit_end", hang)
    monkeypatch.setattr(butterfly._ButterflyRun, "whole", fake_whole)
    monkeypatch.setattr(butterfly._ButterflyRun, "held", fake_held)
    _, errs = _outs(410, _inputs(4, 5000))
    assert leak.get("relayed"), "rank 1 relayed nothing: the test did not test it"
    assert errs[0] is not None and errs[3] is not None, errs


@pytest.mark.parametrize("what", ["commitment", "nonce"])
def test_an_owner_that_garbles_its_commitment_or_nonce_to_one_member_stalls_nobody(
        monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """Two buckets: rank 2 sends rank 0, in each, its commitment under a signature that does
    not verify (``commitment``) or a nonce its header's chain does not hash to (``nonce``), and
    nobody else anything wrong. The next two members after rank 2 forward rank 0 what rank 2
    signed and bound, and every rank completes with the same bits, well before the deadline
    (before, rank 0 failed the call at once for everyone: one garbled frame a call stalled the
    run, naming nobody the coordinator could act on)."""
    # (mesh link 1 of rank 2 joins rank 0)
    garbled = garbling_commitment(monkeypatch, lambda run, conn: run.rank == 2 and conn is run.links.out[1], (what,))
    a, b = _inputs(4, 5000), _inputs(4, 3000, seed=1)
    cfg = dataclasses.replace(CFG, bucket_numel=5000)
    t0 = time.monotonic()
    outs, errs = _outs(430 + 5 * ["commitment", "nonce"].index(what), [{"a": a[r], "b": b[r]} for r in range(4)], cfg)
    took = time.monotonic() - t0
    assert errs == [None] * 4, errs
    assert sorted(garbled) == [0, 1], garbled
    for leaf, xs in (("a", a), ("b", b)):
        assert all(_same_bits(o[leaf], butterfly.simulate(xs, "int8", 64, 256, "clip")) for o in outs)
    assert took < CFG.deadline * 0.8, took


class _Altering:
    """An owner's link to one member: its aggregates of piece 0 (``first``) or of every piece,
    in every bucket, with their first byte flipped (each altered (bucket, piece) goes into
    ``altered``); all else as is."""

    def __init__(self, conn: Any, buckets: list[Any], first: bool, altered: list[tuple[int, int]]) -> None:
        self.conn, self.buckets, self.first, self.altered = conn, buckets, first, altered

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def send(self, mtype: Any, payload: Any, **kw: Any) -> Any:
        if mtype == MsgType.DATA and isinstance(payload, np.ndarray) and payload.nbytes > 4:
            at = next(((i, j) for i, b in enumerate(self.buckets) for j, a in enumerate(b.agg)
                       if a is not None and (payload is a or payload.base is a)), None)
            if at is not None and (not self.first or at[1] == 0):
                payload = payload.copy()
                payload[0] ^= 0xFF
                self.altered.append(at)
        return self.conn.send(mtype, payload, **kw)


def _altering(monkeypatch: pytest.MonkeyPatch, owner: int, victim: int, first: bool) -> list[tuple[int, int]]:
    """``owner`` sends ``victim`` aggregates other than it commits to (:class:`_Altering`)."""
    run, altered = mesh_call.MeshCall.run, []

    def wrapped(self: Any) -> Any:
        if self.rank == owner:
            k = (victim - owner - 1) % self.world
            self.links = dataclasses.replace(self.links, out=list(self.links.out))
            self.links.out[k] = _Altering(self.links.out[k], self.buckets, first, altered)
        return run(self)

    monkeypatch.setattr(mesh_call.MeshCall, "run", wrapped)
    return altered


@pytest.mark.parametrize("what", ["first", "every", "every-garbled"])
def test_an_owner_that_sends_one_member_other_aggregates_than_it_commits_to_stalls_nobody(
        monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """Rank 2 sends rank 0 its first aggregate, or every one, other than the ones it commits to
    (the bytes altered; its commitment and every other frame as they should be, or its own
    commitment under a garbled signature: rank 0 then holds a forwarded one). Rank 0 asks for
    those pieces by relay and reads the link on, so it still gets rank 2's audit frames, and every
    rank completes with the same bits, well before the deadline. Before, a contradicted piece
    failed the call at once when it came before the commitment (which proves nothing to anyone
    else), and after it, ended the link and so lost rank 2's later audit frames (found by review,
    2026-11-28)."""
    altered = _altering(monkeypatch, 2, 0, what == "first")
    garbled = [] if what != "every-garbled" else garbling_commitment(
        monkeypatch, lambda run, conn: run.rank == 2 and isinstance(conn, _Altering), ("commitment",))
    xs = _inputs(4, 5000, seed=21)
    t0 = time.monotonic()
    outs, errs = _outs(480 + 5 * ["first", "every", "every-garbled"].index(what), xs)
    took = time.monotonic() - t0
    assert errs == [None] * 4, errs
    assert altered == ([(0, 0)] if what == "first" else [(0, j) for j in range(len(altered))]) and altered, altered
    assert len(garbled) == (what == "every-garbled"), garbled
    assert all(_same_bits(o, butterfly.simulate(xs, "int8", 64, 256, "clip")) for o in outs)
    assert took < CFG.deadline * 0.8, took


def test_a_member_that_withholds_only_its_second_bucket_is_named_by_every_owner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two buckets: rank 2 sends all its own pieces of bucket 0 and none of bucket 1. Every
    bucket's step 1 comes before any bucket's step 3, so the three others name it (before, only
    the first bucket's gaps counted, since a rank that failed in an earlier bucket's gather never
    sent its later pieces, and a member withholding in a later bucket stalled every call
    unnamed), and nobody names anyone else."""
    honest = butterfly._ButterflyRun._scatter_to

    def scatter(self: Any, k: int) -> None:
        if self.rank == 2 and self.x.shape[0] == 3000:
            time.sleep(max(0.0, self.deadline - time.monotonic()))
            return
        honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    a, b = _inputs(4, 5000), _inputs(4, 3000, seed=1)
    missing, errs, _ = _call(monkeypatch, 350, [{"a": a[r], "b": b[r]} for r in range(4)], bucket_numel=5000)
    assert all(e is not None for e in errs), errs
    assert missing == [(2,), (2,), (), (2,)], (missing, errs)


def test_a_peer_that_reads_slowly_holds_nobody_s_pieces_back_until_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's link to rank 2 takes 0.2 s a frame (rank 2 reads just fast enough never to count
    as stuck: 80 frames, 16 s, past the 4 s deadline). The pacing holds rank 0's other links
    within 2 pieces of that one, so its pieces would reach nobody in time and every owner would
    name it; step 1 goes unpaced after half the call's time, and ranks 1 and 3 name nobody."""
    honest = butterfly._ButterflyRun._scatter_to

    def scatter(self: Any, k: int) -> None:
        if self.rank == 0 and butterfly.peer_of(0, self.world, k) == 2:
            send = self.links.out[k].send
            self.links.out[k].send = lambda *a, **kw: (time.sleep(0.2), send(*a, **kw))[1]
        honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    missing, errs, _ = _call(monkeypatch, 370, _inputs(4, 4 * 256 * 40), deadline=4)
    assert missing[1] == () and missing[3] == (), (missing, errs)


def test_a_peer_that_reads_slowly_gets_no_honest_row_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 reads its link from rank 0 at 0.15 s a frame, never slowly enough to count as
    stuck: the pacing holds rank 0's other links to that pace, so rank 0's rows reach owners 1
    and 3 late too, but they keep coming, and no owner leaves them out (a review feared that a
    minority reading slowly could have every owner leave out the honest senders it chose; each
    piece's grace runs from when its owner began waiting on it, at least 1 s, longer than the
    pacing can hold a sender, and a sender heard from within ``ROW_IDLE`` is waited for in any
    case). Every rank completes with every row."""
    honest = butterfly._ButterflyRun._scatter_to

    def scatter(self: Any, k: int) -> None:
        if self.rank == 0 and butterfly.peer_of(0, self.world, k) == 2:
            conn = self.links.out[k]
            send = conn.send
            conn.send = lambda *a, **kw: (time.sleep(0.15), send(*a, **kw))[1]
            try:
                return honest(self, k)
            finally:  # (its step 1 only)
                del conn.send
        honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    xs = _inputs(4, 4 * 256 * 16, seed=5)
    missing, errs, outs = _call(monkeypatch, 700, xs, deadline=12)
    assert errs == [None] * 4, errs
    assert all(_same_bits(o, butterfly.simulate(xs, "int8", 64, 256, "clip")) for o in outs)


def test_the_rows_left_out_stay_within_the_cap_over_the_whole_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two buckets: rank 2 signs its pieces of rank 0's segment in bucket 1 with garbage (rank 0
    leaves it out of bucket 1 while it still waits for bucket 0's rows), and rank 3 sends rank 0
    its pieces 2.5 s late. Rank 2 out of bucket 1 and rank 3 out of bucket 0 would put both out
    of bucket 1 (a sender left out is out of every later bucket), over the cap of one at N = 4:
    so rank 0 waits for rank 3 (a review found the cap counted per bucket, and rank 0's bucket-1
    commitment then convicted it). Every rank completes: bucket 0 with every row, bucket 1
    without rank 2's in segment 0."""
    left = unsigned_rows(monkeypatch, lambda run, o: run.rank == 2 and o == 0 and run.index == 1)
    scatter = butterfly._ButterflyRun._scatter_to

    def late(self: Any, k: int) -> None:
        if self.rank == 3 and self.index == 0 and butterfly.peer_of(3, 4, k) == 0:
            time.sleep(2.5)
        return scatter(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", late)
    leaves = [_inputs(4, n, seed=30 + i) for i, n in enumerate((5000, 3000))]
    xs = [{f"b{i}": leaf[r] for i, leaf in enumerate(leaves)} for r in range(4)]
    outs, errs = _outs(705, xs, dataclasses.replace(CFG, bucket_numel=5000, deadline=10))
    assert errs == [None] * 4, errs
    assert all(_same_bits(o["b0"], butterfly.simulate(leaves[0], "int8", 64, 256, "clip")) for o in outs)
    ref = butterfly.simulate(leaves[1], "int8", 64, 256, "clip", left={0: {2: 0}})
    assert all(_same_bits(o["b1"], ref) for o in outs)
    assert set(left) == {(0, 2)}, left


def _members_of(ring: tuple[str, ...], step: int, epoch: int, named: dict[str, list[str]]) -> list[Node]:
    """The retry of barrier ``step``: every member of ``ring`` with its report on epoch ``epoch``
    (``named[reporter]``: whose pieces never reached it)."""
    return [Node(i, f"127.0.0.1:{k + 1}", 1, "s", Role.MEMBER, (k, 0), 0.0,
                 arrival=Arrival(step, 0.0, "h", True, report=Report(missing=Missing(step=step, epoch=epoch,
                                                                                    nodes=named[i]))
                                 if named.get(i) else None))
            for k, i in enumerate(ring)]


def _barrier(police: Police, members: list[Node], step: int, epoch: int, named: dict[str, list[str]]) -> list[str]:
    """One judged retry of barrier ``step`` on ``epoch``; the ids evicted (the nodes keep their counts)."""
    by_id = {n.node_id: n for n in members}
    police.formed(step, epoch, tuple(by_id))
    fresh = _members_of(tuple(by_id), step, epoch, named)
    for n, f in zip(members, fresh):
        n.arrival = f.arrival
    _, evict = police.judge(step, members, "run")
    return [n.node_id for n, _ in evict]


def test_a_member_most_others_name_in_two_failed_calls_in_a_row_is_evicted() -> None:
    said: list[str] = []
    police = Police(CoordinatorConfig(), said.append)
    ring = ("a", "b", "c", "d")
    members = _members_of(ring, 0, 1, {})
    staller = {"a": ["d"], "b": ["d"], "c": ["d"], "d": ["a"]}  # d names a to muddy the water
    assert _barrier(police, members, 0, 1, staller) == []  # one call: not yet
    assert members[3].stalls == 1 and members[0].stalls == 0
    assert _barrier(police, members, 0, 2, staller) == ["d"]
    assert any("3 of the 3 others (a, b, c) say d's own pieces never reached them" in s for s in said), said


@pytest.mark.parametrize(("ring", "named", "why"), [
    ("abcd", {"a": ["b"]}, "one liar of four names b"),
    ("abcde", {"a": ["b"], "e": ["b"]}, "two liars of five name b: two of its four others, not most"),
    ("abcd", {"a": ["c", "d"], "b": ["c", "d"], "c": ["a", "b"], "d": ["a", "b"]}, "a partition"),
])
def test_no_eviction_without_most_others_or_when_half_the_ring_is_named(ring: str, named: dict[str, list[str]],
                                                                        why: str) -> None:
    said: list[str] = []
    police = Police(CoordinatorConfig(), said.append)
    members = _members_of(tuple(ring), 0, 1, {})
    for epoch in (1, 2, 3):
        assert _barrier(police, members, 0, epoch, named) == [], why
    assert all(n.stalls == 0 for n in members)
    assert ("half the ring or more" in " ".join(said)) == (why == "a partition")


def test_a_call_that_went_through_or_a_report_on_another_epoch_resets_nothing_it_should_not() -> None:
    """Named in one failed call, then a call in which it was not named: the count starts over; a
    report on an epoch other than the failed one counts for nothing."""
    police = Police(CoordinatorConfig(), lambda _: None)
    members = _members_of(("a", "b", "c"), 0, 1, {})
    named = {"a": ["c"], "b": ["c"]}
    assert _barrier(police, members, 0, 1, named) == [] and members[2].stalls == 1
    assert _barrier(police, members, 0, 2, {}) == [] and members[2].stalls == 0
    assert _barrier(police, members, 0, 3, named) == [] and members[2].stalls == 1
    police.formed(0, 4, ("a", "b", "c"))
    for n, f in zip(members, _members_of(("a", "b", "c"), 0, 3, named)):  # a report on epoch 3 at epoch 4's retry
        n.arrival = f.arrival
    assert police.judge(0, members, "run")[1] == [] and members[2].stalls == 0


def test_missing_reports_are_parsed_strictly() -> None:
    Report.model_validate({"missing": {"step": 3, "epoch": 9, "nodes": ["a"]}})
    for bad in ({"step": -1, "epoch": 0, "nodes": []}, {"step": 0, "epoch": 0, "nodes": [""]},
                {"step": 0, "epoch": 0, "nodes": ["a"], "extra": 1}, {"step": 0, "epoch": 0, "nodes": ["x" * 129]}):
        with pytest.raises(ValueError):
            Report.model_validate({"missing": bad})


def test_an_abort_from_outside_ends_a_mesh_that_is_still_opening(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 3 opens its links but holds its headers back, so the others wait to read them (up to
    half the 20 s deadline); the coordinator says the epoch broke and each aborts: all end at
    once, naming nobody (a call cut short says nothing of who withheld what)."""
    import threading

    from intellect_jax.net import comm as commlib

    send = commlib.send_msg
    monkeypatch.setattr(commlib, "send_msg", lambda conn, msg, deadline=None: (
        time.sleep(8) if conn.channel.startswith("ring/0/3>") else send(conn, msg, deadline)))
    cfg = RingConfig(deadline=20, exchange="butterfly", robust="clip", piece_numel=256)
    nodes = _nodes(4, first=380)
    try:
        comms = [n.ring(_members(nodes), r, config=cfg) for r, n in enumerate(nodes)]
        xs = _inputs(4, 5000)
        threading.Thread(target=_run, args=([comms[3]], xs[3:]), daemon=True).start()
        threading.Timer(1.0, lambda: [c.abort() for c in comms[:3]]).start()
        t0 = time.monotonic()
        _, errs = _run(comms[:3], xs[:3])
        took = time.monotonic() - t0
    finally:
        for n in nodes:
            n.close()
    assert all(e is not None for e in errs) and took < 4, (took, errs)
    assert [c.missing for c in comms[:3]] == [()] * 3


def test_reports_on_an_epoch_that_lost_a_member_name_nobody() -> None:
    """d left during the call (the epoch broke, and whoever aborted first on hearing so cut its
    own pieces short): at the retry the others' reports naming a count for nothing, twice."""
    said: list[str] = []
    police = Police(CoordinatorConfig(), said.append)
    members = _members_of(("a", "b", "c", "d"), 0, 1, {})
    for epoch in (1, 2):
        police.formed(0, epoch, ("a", "b", "c", "d"))
        for n, f in zip(members, _members_of(("a", "b", "c", "d"), 0, epoch, {"b": ["a"], "c": ["a"], "d": ["a"]})):
            n.arrival = f.arrival
        _, evict = police.judge(0, members[:3], "run")  # d is not at the retry
        assert evict == [] and members[0].stalls == 0, (evict, said)


def test_a_peer_that_holds_its_header_back_from_one_member_delays_nobody_else_s_links(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 holds its header to rank 0 back for 1.9 s of the 4 s deadline and reads rank 0's
    pieces slowly (0.2 s a frame against 0.04 s to the others). Rank 0's links to ranks 1 and 3
    do not wait for that one link to open, so its pieces reach them in time and neither names
    it (when every link waited for the slowest to open, all three others named rank 0)."""
    from intellect_jax.net import comm as commlib

    send = commlib.send_msg
    monkeypatch.setattr(commlib, "send_msg", lambda conn, msg, deadline=None: (
        time.sleep(1.9) if conn.channel.startswith("ring/0/2>0/") else None, send(conn, msg, deadline))[1])
    honest = butterfly._ButterflyRun._scatter_to

    def scatter(self: Any, k: int) -> None:
        if self.rank == 0:
            pause = 0.2 if butterfly.peer_of(0, self.world, k) == 2 else 0.04
            out = self.links.out[k].send
            self.links.out[k].send = lambda t, payload, **kw: (
                time.sleep(pause) if getattr(payload, "nbytes", 0) > 64 else None, out(t, payload, **kw))[1]
        honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    missing, errs, _ = _call(monkeypatch, 390, _inputs(4, 4 * 256 * 40), deadline=4)
    assert missing[1] == () and missing[3] == (), (missing, errs)


def test_a_link_given_up_on_answers_at_once_and_its_late_connection_is_closed() -> None:
    """A link whose opener has not finished by the deadline becomes a DeadLink for every later
    ask too, without another wait (each ask waited a second more before); the connection the
    opener brings afterwards is closed, not leaked."""
    import threading

    from intellect_jax.net import mesh
    from intellect_jax.net.errors import PeerTimeout

    release, closed, failures = threading.Event(), threading.Event(), []

    class Conn:
        def close(self) -> None:
            closed.set()

    def opener() -> Conn:
        release.wait(10)
        return Conn()

    link = mesh.Pending("rank 9", opener, time.monotonic() + 0.05, failures.append)
    assert isinstance(link.get(), mesh.DeadLink) and isinstance(failures[0], PeerTimeout)
    t0 = time.monotonic()
    for _ in range(3):
        assert isinstance(link.get(), mesh.DeadLink)
    assert time.monotonic() - t0 < 0.5 and len(failures) == 1
    release.set()
    assert closed.wait(5)


def test_a_sitter_s_forged_piece_of_a_later_bucket_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unaudited, six buckets: rank 3 sits the round out but sends owner 0 non-zero pieces of
    bucket 3 under a forged signature, while rank 2 holds its bucket-0 pieces back 1 s, so owner
    0 gets bucket 3's pieces while it still aggregates bucket 0 (it keeps them as they came).
    Every signed piece's signature is checked as it arrives, a sitter's too, so owner 0 fails on
    rank 3's at once and names it (a review found it named by nobody when the check waited for
    the piece's decoding, once the owner reached that bucket)."""
    honest = butterfly._ButterflyRun._scatter_to

    def scatter(self: Any, k: int) -> None:
        if self.rank == 2 and self.first == 0:
            time.sleep(1.0)
        if self.rank == 3 and self.x.shape[0] == 8192 and self.first == 3 * self.plan.pieces:
            sign = self.mseal.sign
            self.mseal = MeshSeal(lambda owner, *a: bytes(64) if owner == 0 else sign(owner, *a), self.mseal.verify)
        honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    world, n = 4, 8192
    nodes = _nodes(world, first=330)
    try:
        comms = [nd.ring(_members(nodes), r, config=RingConfig(deadline=8, exchange="butterfly", robust="clip",
                                                               piece_numel=1024, bucket_numel=n, audit=False))
                 for r, nd in enumerate(nodes)]
        for c in comms:
            c.inspect, c.absent = (lambda theirs: verdict(theirs, None)), frozenset({3})
        trees = [{f"l{b}": _inputs(world, n, seed=b)[r] for b in range(6)} for r in range(world)]
        _, errs = _run(comms, trees)
    finally:
        for nd in nodes:
            nd.close()
    assert errs[0] is not None and "signature" in str(errs[0]), errs
    assert comms[0].missing == (3,), [c.missing for c in comms]
