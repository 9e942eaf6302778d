"""Audits of the butterfly's segment owners (net.audit): over real sockets, and case by case."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest

from intellect_jax.coordinator.policing import weigh_audit
from intellect_jax.coordinator.schema import Audit
from intellect_jax.net import RingConfig, audit, butterfly, comm as commlib, mesh_call, pairing, quant
from intellect_jax.net.audit import ENTRY, Case, judge
from intellect_jax.net.errors import AuditFailed, FrameError
from intellect_jax.net.evidence import digest
from intellect_jax.net.frames import MsgType
from intellect_jax.net.plan import butterfly_plan
from intellect_jax.net.tree import make_buckets
from intellect_jax.testing.audit_cases import sign, signed_case, verifier
from intellect_jax.testing.identities import credentials
from tests.helpers import forging_owner
from tests.test_butterfly import _butterfly
from tests.test_net_ring import _inputs, _same_bits

CFG = RingConfig(mode="int8", block_size=64, piece_numel=512, deadline=30, exchange="butterfly", robust="clip")


def _owner(monkeypatch: pytest.MonkeyPatch, bad: int, pieces: set[int] | None = None) -> Any:
    """Rank ``bad`` forges its aggregates (helpers.forging_owner)."""
    return forging_owner(monkeypatch, lambda run: run.rank == bad, pieces)


def _auditor(monkeypatch: pytest.MonkeyPatch, bad: int, world: int) -> int:
    """Fix every call's pairing at offset 1 (rank r audits segment r - 1; the draw from the
    members' nonces picks it otherwise) and say who audits ``bad``."""
    monkeypatch.setattr(pairing, "rotation", lambda draw, world: 1)
    return pairing.auditor_of(bad, world, 1)


def _weigh(ev: dict[str, Any], ids: list[str], accuser: str, certs: dict[str, str] | None = None,
           **over: Any) -> tuple[str | None, str, bool]:
    """The coordinator's check, against the certificates the members presented to it."""
    known = {i: credentials(i).cert_der.hex() for i in ids} if certs is None else certs
    return weigh_audit(Audit.model_validate({**ev, **over}), run_id="ring-test", step=0, epoch_id=0,
                       accuser=accuser, ring=tuple(ids), ca=credentials(ids[0]).ca_der, certs=known)


def test_an_honest_run_is_audited_and_shows_nobody() -> None:
    world, n = 4, 9000
    xs = _inputs(world, n)
    comms, outs, errs = _butterfly(world, xs, CFG)
    assert errs == [None] * world
    ref = butterfly.simulate(xs, "int8", 64, 512, "clip")
    assert all(_same_bits(o, ref) for o in outs)
    assert [c.audited for c in comms] == [None] * world


def test_a_nonce_chain_reveals_nothing_of_the_next_bucket_and_every_rank_audits_one_segment() -> None:
    head, chain = pairing.nonce_chain(bytes(range(32)), 5)
    assert len(chain) == 5 and digest(chain[0]) == head and all(digest(chain[b]) == chain[b - 1] for b in range(1, 5))
    assert len(set(chain)) == 5  # (nonce b + 1 is a preimage of nonce b: not computable from it)
    for world in (2, 3, 4, 16):
        for d in (bytes(32), b"\xff" * 32, digest(b"x")):
            k = pairing.rotation(d, world)
            assert 1 <= k < world
            assert sorted(pairing.audited_by(r, world, k) for r in range(world)) == list(range(world))
            assert all(pairing.auditor_of(pairing.audited_by(r, world, k), world, k) == r != pairing.audited_by(
                r, world, k) for r in range(world))


def test_the_pairing_is_drawn_anew_in_every_bucket_from_the_members_nonces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody knows who audits whom until every owner has committed: the draw comes from every
    member's nonce of the bucket (a hash chain bound in the call's header; the empty first
    bucket's link is skipped), every rank draws the same in each bucket, and the draws differ
    from bucket to bucket (13 buckets of 4 ranks: one offset of 3 throughout would be a
    1-in-531,441 fluke)."""
    world, got = 4, []
    spy = pairing.rotation
    monkeypatch.setattr(pairing, "rotation", lambda d, w: got.append((d, spy(d, w))) or got[-1][1])
    rng = np.random.default_rng(11)
    trees = [{"a0": np.zeros(0, np.float32), "a1": rng.standard_normal(5000).astype(np.float32),
              **{f"b{i:02d}": rng.standard_normal(4000).astype(np.float32) for i in range(12)}} for _ in range(world)]
    cfg = dataclasses.replace(CFG, bucket_numel=4000)  # buckets: [a0] (empty), [a1], [b00], ... [b11]
    assert make_buckets([0, 5000] + [4000] * 12, 4000)[0] == [0]
    comms, outs, errs = _butterfly(world, trees, cfg)
    assert errs == [None] * world and [c.audited for c in comms] == [None] * world
    assert all(_same_bits(outs[r][k], outs[0][k]) for r in range(world) for k in outs[0])
    by_draw: dict[bytes, list[int]] = {}
    for d, offset in got:
        by_draw.setdefault(d, []).append(offset)
    assert len(by_draw) == 13 and all(len(v) == world and len(set(v)) == 1 for v in by_draw.values())
    assert len({v[0] for v in by_draw.values()}) > 1


def test_the_audited_piece_is_the_auditor_s_draw_not_the_pairing_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """The piece an auditor checks must not follow from the pairing's draw: an owner may be the
    last to reveal its nonce, so it could compute such a piece first and withhold its nonce (a
    stall naming nobody) whenever the piece is one it forged. With every member's nonces the
    same in six calls (so the same draw, the same pairing), the auditors still ask for other
    pieces (the same piece six times over is a 1-in-625 fluke at 5 pieces a segment)."""
    world, asked = 4, []
    monkeypatch.setattr(commlib.secrets, "token_bytes", lambda n: bytes(n))
    rows_of_target = audit.Ledger.rows_of_target

    def spy(self: Any, rows: list[bytes]) -> Any:
        why = rows_of_target(self, rows)
        asked.append((self.drawn, self.target, self.challenge))
        return why

    monkeypatch.setattr(audit.Ledger, "rows_of_target", spy)
    for _ in range(6):
        _, _, errs = _butterfly(world, _inputs(world, 9000, seed=15), CFG)
        assert errs == [None] * world
    assert len({d for d, _, _ in asked}) == 1 and butterfly_plan(9000, world, 64, 512).pieces == 5
    assert len({j for _, t, j in asked if t == 0}) > 1, asked


def test_a_nonce_other_than_its_header_bound_fails_the_call_and_names_its_sender(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 reveals a nonce its header's chain does not hash to (it would choose the draw
    after seeing the others'): the first member to get it fails the call on it, naming rank 2
    (the others then see their links close), and nobody completes."""
    world, bad = 4, 2
    send = butterfly._ButterflyRun._audit_frame

    def lying(self: Any, conn: Any, payload: bytes) -> bool:
        if self.rank == bad and self.ledger is not None and payload == self.ledger.ctx.nonce:
            payload = digest(payload)  # the next link of the chain: the wrong one
        return send(self, conn, payload)

    monkeypatch.setattr(butterfly._ButterflyRun, "_audit_frame", lying)
    comms, _, errs = _butterfly(world, _inputs(world, 9000, seed=12), CFG)
    assert all(e is not None for e in errs), errs
    named = [e for r, e in enumerate(errs) if r != bad and isinstance(e, FrameError)]
    assert named and all(f"rank {bad} sent a nonce that is not the one its header committed to" in str(e)
                         for e in named), errs


def test_a_challenge_drawn_from_another_pairing_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member shown other nonces than the rest (by a rank that equivocates) would audit by
    another pairing and leave some segment unaudited: every challenge carries the auditor's draw,
    and a member whose draw differs fails the call for the others instead (the first to see it
    names it; the rest see their links close)."""
    world, bad = 4, 3
    send = butterfly._ButterflyRun._audit_frame

    def other(self: Any, conn: Any, payload: bytes) -> bool:
        led = self.ledger
        if self.rank == bad and led is not None and led.drawn is not None and len(payload) == 4 + audit.DIGEST \
                and payload[4:] == led.drawn:
            payload = payload[:4] + digest(led.drawn)
        return send(self, conn, payload)

    monkeypatch.setattr(butterfly._ButterflyRun, "_audit_frame", other)
    comms, _, errs = _butterfly(world, _inputs(world, 9000, seed=13), CFG)
    assert all(e is not None for e in errs), errs
    named = [e for r, e in enumerate(errs) if r != bad and isinstance(e, FrameError)]
    assert named and all(f"rank {bad} audits by another draw of the pairing than ours" in str(e) for e in named), errs


def test_an_owner_that_forges_its_aggregate_fails_the_call_and_is_caught_with_evidence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 negates every aggregate it sends back, the same bytes to every member, so no check
    on the average could tell. Its auditor recomputes the piece it drew from every member's
    signed piece, finds the owner's signed commitment wrong and fails the call before any of its
    own aggregates leaves: no rank completes, so nobody applies the forgery. The case it keeps
    convicts the owner by the coordinator's check; altered in any part, it does not hold."""
    world, n, bad = 4, 9000, 1
    xs = _inputs(world, n, seed=3)
    auditor = _auditor(monkeypatch, bad, world)
    with _owner(monkeypatch, bad):
        comms, outs, errs = _butterfly(world, xs, CFG)
    assert all(e is not None for e in errs) and isinstance(errs[auditor], AuditFailed), errs
    assert [r for r, c in enumerate(comms) if c.audited is not None] == [auditor]
    ids = [c.ids[c.rank] for c in comms]
    guilty, why, ev = comms[auditor].audited  # type: ignore[misc]
    assert guilty == bad and "is not the clip of the rows it was sent" in why and ev is not None
    assert _weigh(ev, ids, ids[auditor]) == (ids[bad], why, False)
    assert _weigh(ev, ids, ids[2 if auditor != 2 else 3])[::2] == (None, True)  # only the auditor named in it
    assert _weigh(ev, ids, ids[auditor], step=1)[::2] == (None, True)
    assert _weigh(ev, ids, ids[auditor], how="mean")[0] is None  # not what the owner signed
    assert _weigh(ev, ids, ids[auditor], commit_sig="00" * 64)[0] is None
    other = next(j for j in range(len(ev["aggregates"])) if j != ev["piece"])
    assert _weigh(ev, ids, ids[auditor], piece=other)[0] is None  # its row list is another's
    tampered = list(ev["payloads"])
    tampered[0] = tampered[1]
    assert _weigh(ev, ids, ids[auditor], payloads=tampered)[0] is None
    # the coordinator checks each signer against the certificate it knows, never one the case brings:
    # another identity's certificate for a sender voids the case (nobody convicted, nor the reporter)
    swapped = {i: credentials(ids[(k + 1) % world] if k == 0 else i).cert_der.hex() for k, i in enumerate(ids)}
    assert _weigh(ev, ids, ids[auditor], swapped) == (None, _weigh(ev, ids, ids[auditor], swapped)[1], False)
    assert "does not verify" in _weigh(ev, ids, ids[auditor], swapped)[1]


def test_an_owner_forging_one_piece_is_caught_only_when_that_piece_is_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit of one audited piece per owner per call: a forgery in piece 0 fails the call
    when the auditor draws piece 0, and goes through, applied by every rank, when it draws
    another."""
    world, n, bad = 3, 6000, 0
    xs = _inputs(world, n, seed=5)
    p = butterfly_plan(n, world, 64, 512)
    a, b = p.piece(bad, 0)
    ref = butterfly.simulate(xs, "int8", 64, 512, "clip")
    auditor = _auditor(monkeypatch, bad, world)
    for drawn, seen in ((0, True), (1, False)):
        with monkeypatch.context() as m:
            m.setattr(commlib.secrets, "randbelow", lambda k, d=drawn: d % k)
            with _owner(m, bad, pieces={0}):
                comms, outs, errs = _butterfly(world, xs, CFG)
        verdict = comms[auditor].audited
        assert (verdict is not None and verdict[0] == bad) == seen
        assert all(e is not None for e in errs) if seen else errs == [None] * world
        if not seen:
            assert all(_same_bits(o, outs[0]) for o in outs) and np.allclose(outs[0][a:b], -ref[a:b], atol=1e-3)


def test_an_owner_that_withholds_its_row_from_the_audit_fails_the_call_for_everyone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner cannot dodge its audit by not answering: its auditor holds its own aggregates
    back until every piece of its audit is in, so every member fails (none completes)."""
    world, bad = 4, 2
    original = butterfly._ButterflyRun._answer

    def mute(self: Any, conn: Any, o: int) -> bool:
        if self.rank == bad and o == self.ledger.auditor:
            return self.wait_for(lambda: False, "never")  # silent until the deadline
        return original(self, conn, o)

    monkeypatch.setattr(butterfly._ButterflyRun, "_answer", mute)
    cfg = dataclasses.replace(CFG, deadline=4)
    _, _, errs = _butterfly(world, _inputs(world, 5000), cfg)
    assert all(e is not None for e in errs), errs


# ---- cases by hand, with real signatures ------------------------------------------------------------
IDS = ("a0", "a1", "a2")
_verify = verifier(IDS)


def _sign(rank: int, data: bytes) -> bytes:
    return sign(IDS[rank], data)


def _case(xs: list[np.ndarray]) -> Case:
    """Rank 1's audit of piece 1 of honest owner 0 (plain mean)."""
    return signed_case(xs, IDS, owner=0, auditor=1, piece=1, run_id="run", step=0, epoch=0, call=0, mode="int8",
                       block=64, piece_numel=256, how="mean")


def _resign(case: Case, **over: Any) -> Case:
    """``case`` changed as its owner would have committed to it (the owner signs again)."""
    c = dataclasses.replace(case, **over)
    return dataclasses.replace(c, commit_sig=_sign(c.owner, c.committed()))


def test_judge_an_honest_case_and_each_kind_of_fault() -> None:
    xs = _inputs(3, 1500, seed=7)
    case = _case(xs)
    assert judge(case, _verify) == (None, "the aggregate of piece 1 is right", True)
    # the owner's aggregate is not the mean of its rows
    aggs = list(case.aggregates)
    aggs[1] = digest(b"another")
    assert judge(_resign(case, aggregates=tuple(aggs)), _verify)[0] == 0
    # a row in the list whose signature does not verify: the owner's forgery or a sender's trick, not told apart
    rows = bytearray(case.rows)
    rows[2 * ENTRY] ^= 1
    roots = list(case.row_roots)
    roots[1] = digest(bytes(rows))
    guilty, why, right = judge(_resign(case, rows=bytes(rows), row_roots=tuple(roots)), _verify)
    assert guilty is None and not right and "a2 whose signature does not verify" in why  # owner or sender?
    # a sender signs another piece to the auditor than it sent the owner
    other = bytearray(case.payloads[2])
    other[-1] ^= 1
    sigs = list(case.audit_sigs)
    sigs[2] = _sign(2, case.said(2, 1, digest(bytes(other))))
    guilty, why, _ = judge(dataclasses.replace(case, payloads=(*case.payloads[:2], bytes(other)),
                                            audit_sigs=tuple(sigs)), _verify)
    assert guilty == 2 and "signed two different pieces" in why
    # ... but an altered piece nobody signed shows nobody, nor does the auditor's own changed row
    assert judge(dataclasses.replace(case, payloads=(*case.payloads[:2], bytes(other))), _verify)[0] is None
    mine = bytearray(case.payloads[1])
    mine[-1] ^= 1
    assert judge(dataclasses.replace(case, payloads=(case.payloads[0], bytes(mine), case.payloads[2])),
                 _verify)[0] is None
    # the owner's own row under its commitment: changed, it is the owner's double statement
    own = bytearray(case.payloads[0])
    own[0] ^= 1
    sigs = list(case.audit_sigs)
    sigs[0] = _sign(0, case.said(0, 1, digest(bytes(own))))
    assert judge(dataclasses.replace(case, payloads=(bytes(own), *case.payloads[1:]), audit_sigs=tuple(sigs)),
                 _verify)[0] == 0
    # nothing holds without the owner's own signature on the commitment
    assert judge(dataclasses.replace(case, commit_sig=_sign(1, case.committed())), _verify)[0] is None
    assert judge(dataclasses.replace(case, owner=1, auditor=1), _verify)[0] is None


def test_judge_rows_left_out_at_the_row_deadline() -> None:
    """An owner may leave out the rows of fewer than half of the contributors other than itself
    (a sitter counts for nothing), each from a piece on, declared in its commitment: the
    aggregate of the rows it kept is then the right one, and an answer of a member left out is
    never looked at. Leaving out more, or itself, or listing a row other than as declared,
    convicts it under its own signature; so does a round trip through the coordinator's
    schema. ``Ledger.seal`` lists a row left out empty even if it came after all."""
    xs, P = _inputs(3, 1500, seed=7), butterfly_plan(1500, 3, 64, 256).pieces
    kw = dict(owner=0, auditor=1, piece=1, run_id="run", step=0, epoch=0, call=0, mode="int8", block=64,
              piece_numel=256, how="mean")
    honest = _case(xs)
    for left in ({2: 1}, {2: 0}, {2: 2}, {1: 0}):
        case = signed_case(xs, IDS, **kw, left=left)
        assert judge(case, _verify) == (None, "the aggregate of piece 1 is right", True), left
        assert (case.aggregates[1] == honest.aggregates[1]) == (left == {2: 2}), left  # (from piece 2: not in 1)
    case = signed_case(xs, IDS, **kw, left={2: 0})
    junk = dataclasses.replace(case, payloads=(*case.payloads[:2], b"junk"), audit_sigs=(None, None, b"x" * 64))
    assert judge(junk, _verify)[2]  # (its answer, whatever it is, is not looked at)
    ev = audit.to_wire(case)
    assert ev["left"] == [P, P, 0]
    assert audit.from_wire(Audit.model_validate(ev), "run", IDS) == case
    assert judge(signed_case(xs, IDS, **kw, absent=(2,), left={2: 0}), _verify)[2]  # (a sitter is free)
    for left, absent, guilty in (({1: 0, 2: 0}, (), "left out 2 of the 3 contributors' rows of segment 0, more than 1"),
                                 ({1: 0}, (2,), "left out 1 of the 2 contributors' rows of segment 0, more than 0"),
                                 ({0: 0}, (), "declared its own rows of segment 0 left out")):
        assert judge(signed_case(xs, IDS, **kw, absent=absent, left=left), _verify)[:2] == (0, guilty), left
    undeclared = _resign(signed_case(xs, IDS, **kw, left={2: 0}), left=(P, P, P))
    assert judge(undeclared, _verify)[:2] == (0, "lists no row of a2 for piece 1, yet did not declare it left out")
    listed = _resign(honest, left=(P, P, 1))
    assert judge(listed, _verify)[:2] == (0, "lists a row of a2 for piece 1 that it declared left out")
    past = _resign(honest, left=(P, P, (1 << 32) - 1))  # (a u32 in its head: members take it as it comes)
    assert judge(past, _verify)[:2] == (0, f"declared rows left out from a piece past its {P} pieces of segment 0")
    assert audit.from_wire(Audit.model_validate(audit.to_wire(past)), "run", IDS) == past
    ctx = audit.Auditing("run", 0, 0, 0, IDS, sign=lambda data: bytes(64), verify=lambda r, data, sig: True,
                         choose=lambda pieces: 0, nonce=bytes(32), accepts=lambda r, nonce: True,
                         revealed=lambda nonces: None)
    led = audit.Ledger(ctx, 0, 1500, 256, "int8", 64, "mean", frozenset())
    for j in range(P):
        led.entries[j] = [bytes([r + 1]) * ENTRY for r in range(3)]
        led.aggregated(j, np.zeros(4, np.uint8))
    led.left[2] = 1
    head, _, rows = led.seal()
    assert [r[2 * ENTRY:] for r in rows] == [bytes([3]) * ENTRY] + [bytes(ENTRY)] * (P - 1)
    assert audit.split(head, 3)[1] == (P, P, 1) and len(head) == audit.head_nbytes(P, 3)


def _wrap_link(monkeypatch: pytest.MonkeyPatch, world: int, bad: int, victim: int, wrap: Any) -> None:
    """Rank ``bad``'s link to ``victim`` becomes ``wrap(connection, run)`` in every call."""
    run = mesh_call.MeshCall.run

    def wrapped(self: Any) -> Any:
        if self.rank == bad:
            k = (victim - bad - 1) % world
            self.links = dataclasses.replace(self.links, out=list(self.links.out))
            self.links.out[k] = wrap(self.links.out[k], self.buckets[0])
        return run(self)

    monkeypatch.setattr(mesh_call.MeshCall, "run", wrapped)


class _Equivocating:
    """The owner's link to one victim: every aggregate negated and a commitment to those, signed
    by the owner (what a malicious owner sends one member while the others get the honest ones)."""

    def __init__(self, conn: Any, run: Any) -> None:
        self.conn, self.run, self.next_sig = conn, run, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def send(self, mtype: Any, payload: Any, **kw: Any) -> Any:
        run, led = self.run, self.run.ledger
        whole = payload if isinstance(payload, np.ndarray) and payload.base is None else getattr(payload, "base", None)
        j = next((j for j, a in enumerate(run.agg) if a is not None and a is whole), None)
        if j is not None:  # one of our aggregates (or the last one's head or tail): forge it
            a, b = run.plan.piece(run.rank, j)
            forged = quant.encode(-quant.decode(whole, b - a, run.mode, run.block), run.mode, run.block)
            if payload is not whole:  # a slice of it: the same slice of the forgery
                start = (payload.__array_interface__["data"][0] - whole.__array_interface__["data"][0])
                forged = forged[start:start + payload.nbytes]
            payload = forged
        elif led.commit is not None and isinstance(payload, bytes) and payload == led.commit[0]:
            ds = [digest(quant.encode(-quant.decode(w, e - s, run.mode, run.block), run.mode, run.block))
                  for w, (s, e) in zip(run.agg, (run.plan.piece(run.rank, j) for j in range(run.plan.pieces)))]
            payload = b"".join(ds) + payload[len(ds) * audit.DIGEST:]  # (its left-out vector and rows' root as is)
            self.forged_sig = led.ctx.sign(led._said(run.rank, ds, led.left, payload[-audit.DIGEST:]))
            self.next_sig = True
        elif self.next_sig:
            payload, self.next_sig = self.forged_sig, False
        return self.conn.send(mtype, payload, **kw)


def test_an_owner_that_sends_one_member_other_aggregates_is_caught_by_the_echoes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 sends rank 3 negated aggregates under a second commitment it signs (consistent
    with what rank 3 got, so rank 3 alone sees nothing wrong); every member passes the owner's
    commitment on to its auditor, which holds both versions under the owner's signature, fails
    the call (nobody applies either) and keeps the pair as the case that convicts the owner."""
    world, bad, victim = 4, 1, 3
    auditor = _auditor(monkeypatch, bad, world)
    assert auditor != victim
    _wrap_link(monkeypatch, world, bad, victim, _Equivocating)
    comms, _, errs = _butterfly(world, _inputs(world, 9000, seed=9), CFG)
    assert all(e is not None for e in errs) and isinstance(errs[auditor], AuditFailed), errs
    guilty, why, ev = comms[auditor].audited  # type: ignore[misc]
    assert guilty == bad and "signed two different commitments" in why and ev["other"] is not None
    ids = [c.ids[c.rank] for c in comms]
    assert _weigh(ev, ids, ids[auditor]) == (ids[bad], why, False)
    assert _weigh(ev, ids, ids[auditor], other=[ev["other"][0], "00" * 64])[0] is None  # not the owner's
    # each version alone: the honest one checks out against the rows, the other convicts the owner
    # (which of the two the auditor holds first depends on whether the victim's forward came first)
    head = bytes.fromhex(ev["other"][0])
    swapped = {"aggregates": [d.hex() for d in audit.split(head, world)[0]],
               "commit_sig": ev["other"][1], "other": None}
    alone = sorted((_weigh(ev, ids, ids[auditor], other=None), _weigh(ev, ids, ids[auditor], **swapped)),
                   key=lambda j: j[0] is None)
    assert alone[0][0] == ids[bad] and "is not the" in alone[0][1] and alone[1][::2] == (None, True), alone


class _Negating(_Equivocating):
    """The owner's link to one victim: every aggregate negated, its own (honest) commitment as is."""

    def send(self, mtype: Any, payload: Any, **kw: Any) -> Any:
        led = self.run.ledger
        if led.commit is not None and isinstance(payload, bytes) and payload == led.commit[0]:
            return self.conn.send(mtype, payload, **kw)
        return super().send(mtype, payload, **kw)


def test_an_owner_and_a_forwarder_in_league_cannot_split_a_member_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 sends rank 0 negated aggregates and signs a second commitment to them; its
    accomplice rank 3, a forwarder of rank 1's commitment to rank 0, forwards rank 0 that one
    instead of the one it got, and both hold the honest one back from everyone else until rank 0
    holds the second. Rank 0 then applies aggregates nobody else does, and every
    commitment its auditor (rank 2) gets from anyone else is the honest one. Rank 0's echo
    carries the commitment it holds, not just the one the owner sent it, so the auditor holds
    both under the owner's signature: the call fails and the case convicts rank 1 (when the echo
    was the owner's own, rank 0 completed with another result than the rest, unseen)."""
    world, bad, victim, accomplice = 5, 1, 0, 3
    auditor = _auditor(monkeypatch, bad, world)
    assert pairing.forwarders(bad, victim, world) == [auditor, accomplice]
    assert victim not in pairing.forwarders(bad, auditor, world)  # (else its forward shows the auditor too)
    _wrap_link(monkeypatch, world, bad, victim, _Negating)
    second: dict[str, bytes] = {}
    holds = threading.Event()
    committed, frame = audit.Ledger.committed, butterfly._ButterflyRun._audit_frame

    def on_commit(self: Any, owner: int, head: bytes, sig: bytes, via: int | None = None) -> Any:
        why = committed(self, owner, head, sig, via)
        if self.rank == victim and owner == bad and self.heads.get(bad) == (second.get("head"), second.get("sig")):
            holds.set()
        return why

    def league(self: Any, conn: Any, payload: bytes) -> bool:
        led = self.ledger
        to = next(butterfly.peer_of(self.rank, world, k) for k in range(world - 1) if self.links.out[k] is conn)
        if self.rank == bad and led.commit is not None and payload == led.commit[0]:
            if not second:  # (what it sends the victim, negated, and signs too)
                run, ds = self, []
                for j in range(run.plan.pieces):
                    a, b = run.plan.piece(run.rank, j)
                    ds.append(digest(quant.encode(-quant.decode(run.agg[j], b - a, run.mode, run.block), run.mode,
                                                  run.block)))
                second["head"] = b"".join(ds) + payload[len(ds) * audit.DIGEST:]
                second["sig"] = led.ctx.sign(led._said(run.rank, ds, led.left, payload[-audit.DIGEST:]))
            if to != accomplice:
                holds.wait(10)
        elif self.rank == accomplice and second and payload == led.heads.get(bad, (None,))[0]:
            if to == victim:
                payload, second["swap"] = second["head"], b"1"
            else:  # (the honest one reaches the others only once the victim holds the second)
                holds.wait(10)
        elif self.rank == accomplice and to == victim and second.pop("swap", None):
            payload = second["sig"]
        return frame(self, conn, payload)

    monkeypatch.setattr(audit.Ledger, "committed", on_commit)
    monkeypatch.setattr(butterfly._ButterflyRun, "_audit_frame", league)
    comms, outs, errs = _butterfly(world, _inputs(world, 9000, seed=14), CFG)
    assert holds.is_set(), "rank 0 never held the second commitment: the split did not happen"
    assert all(e is not None for e in errs) and isinstance(errs[auditor], AuditFailed), errs
    guilty, why, ev = comms[auditor].audited  # type: ignore[misc]
    assert guilty == bad and "signed two different commitments" in why
    ids = [c.ids[c.rank] for c in comms]
    assert _weigh(ev, ids, ids[auditor]) == (ids[bad], why, False)


def test_a_sender_with_a_bad_signature_is_left_out_by_every_owner_and_frames_nobody(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 signs its pieces with garbage: each owner checks every row's signature as it
    arrives (it commits to them) and leaves rank 2's rows out from the first (a minority of the
    contributors, declared in its commitment), so no row list ever holds an unsigned row, no
    audit case against an honest owner can arise, and every rank completes with the aggregates
    of the others' rows: rank 2 loses its own say, and nobody else loses anything."""
    world, bad = 4, 2
    seal_of = commlib.SocketCommunicator._mesh_seal

    def garbage(self: Any, call: int, links: Any) -> Any:
        seal = seal_of(self, call, links)
        if self.rank == bad:
            return dataclasses.replace(seal, sign=lambda *a: bytes(64))
        return seal

    monkeypatch.setattr(commlib.SocketCommunicator, "_mesh_seal", garbage)
    xs = _inputs(world, 5000)
    comms, outs, errs = _butterfly(world, xs, CFG)
    assert errs == [None] * world, errs
    ref = butterfly.simulate(xs, "int8", 64, 512, "clip", left={c: {bad: 0} for c in range(world) if c != bad})
    assert all(_same_bits(o, ref) for o in outs)
    assert not _same_bits(ref, butterfly.simulate(xs, "int8", 64, 512, "clip"))
    assert [c.audited for c in comms] == [None] * world


def test_an_owner_answering_its_audit_with_an_unsigned_piece_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner that forges and then answers its auditor with another piece under a garbage
    signature, to leave the case inconclusive, gets the call failed at its auditor (an answer
    is checked as it arrives; an inconclusive audit would fail it too): nobody applies the
    forgery."""
    world, bad = 4, 1
    original = butterfly._ButterflyRun._answer

    def garbled(self: Any, conn: Any, o: int) -> bool:
        if self.rank != bad or o != self.ledger.auditor:
            return original(self, conn, o)
        a, b = self.plan.piece(self.rank, self.ledger.asked[o])
        conn.send(MsgType.AUDIT, bytes(quant.encoded_nbytes(b - a, self.mode, self.block)), deadline=self.deadline)
        conn.send(MsgType.AUDIT, bytes(64), deadline=self.deadline)
        return True

    monkeypatch.setattr(butterfly._ButterflyRun, "_answer", garbled)
    auditor = _auditor(monkeypatch, bad, world)
    with _owner(monkeypatch, bad):
        comms, _, errs = _butterfly(world, _inputs(world, 9000, seed=4), CFG)
    assert all(e is not None for e in errs), errs
    assert "the signature of its answer to our audit does not verify" in str(errs[auditor]), errs


def test_an_owner_s_own_row_is_inspected_by_its_auditor_and_is_evidence_against_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner's own row never travels in the scatter, so no other member saw it: its auditor
    now checks the piece it draws like every other row, and a NaN there is evidence against the
    owner, in the codec under the owner's signature to the auditor, which the coordinator's check
    upholds."""
    from intellect_jax.coordinator.policing import weigh
    from intellect_jax.coordinator.schema import Evidence

    world, n, bad = 4, 9000, 1
    xs = _inputs(world, n, seed=6)
    p = butterfly_plan(n, world, 64, 512)
    for j in range(p.pieces):  # a NaN in every piece of its own segment: whatever piece is drawn
        a, _ = p.piece(bad, j)
        xs[bad][a] = np.nan
    auditor = _auditor(monkeypatch, bad, world)
    comms, outs, errs = _butterfly(world, xs, CFG)
    assert errs == [None] * world  # every aggregator drops a row that is not finite
    suspect = comms[auditor].suspect
    assert suspect is not None and suspect[0] == bad and suspect[1] == "non-finite values", suspect
    ev = Evidence.model_validate(suspect[2])
    assert (ev.mode, ev.block) == ("int8", 64)
    ids = [c.ids[c.rank] for c in comms]
    guilty, _ = weigh(ev, run_id="ring-test", step=0, epoch_id=0, accuser=ids[auditor], accused=ids[bad],
                      ca=credentials(ids[0]).ca_der, recorded=None)
    assert guilty == "non-finite values"


def test_a_forger_that_left_before_the_barrier_is_banned_all_the_same() -> None:
    """A forger that drops out as soon as its forgery is caught is not at the barrier that
    judges the case: the case convicts it all the same (it goes on the ban list), and nobody
    present is touched."""
    from intellect_jax.coordinator.policing import Police
    from intellect_jax.coordinator.protocol import CoordinatorConfig
    from intellect_jax.coordinator.roster import Arrival, Node, Role
    from intellect_jax.coordinator.schema import Report

    ids = ("a0", "a1", "a2")
    case = signed_case(_inputs(3, 1500, seed=8), ids, owner=0, auditor=1, piece=1, run_id="run", step=0, epoch=1,
                       call=0, mode="int8", block=64, piece_numel=256, how="mean", forge=lambda j, v: -v)
    said: list[str] = []
    police = Police(CoordinatorConfig(), said.append, ca=credentials("a0").ca_der)
    police.certs = {i: credentials(i).cert_der.hex() for i in ids}
    police.formed(0, 1, ids)  # barrier 0 formed epoch 1; its all-reduce failed on a1's audit
    report = Report(audit=Audit.model_validate(audit.to_wire(case)))
    members = [Node(i, f"127.0.0.1:{k + 1}", 1, "s", Role.MEMBER, (k, 0), 0.0,
                    arrival=Arrival(0, 0.0, "h", True, report=report if i == "a1" else None))
               for k, i in enumerate(ids[1:])]  # the retry of barrier 0, without a0
    keep, evict = police.judge(0, members, "run")
    assert police.frauds == {"a0": judge(case, verifier(ids)).why} and not evict and keep == members
    assert any("shows a0 at fault by its own signature" in line for line in said), said


def test_the_audit_frames_go_out_between_the_aggregates_as_soon_as_they_are_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner's commitment, challenge and answers do not wait for its last aggregate: they go
    out between its aggregates as soon as each is ready, so the audit's round trips overlap the
    gather. Rank 0 here holds its gather back until it has committed: every other member gets its
    commitment before any of its aggregates, and the call completes, bit-identical."""
    world = 4
    gather_to = butterfly._ButterflyRun._gather_to
    committed, got = audit.Ledger.committed, audit.Ledger.got
    seen: dict[int, list[str]] = {r: [] for r in range(1, world)}

    def hold(self: Any, k: int) -> None:
        if self.rank != 0 or self.wait_for(lambda: self.ledger.commit is not None, "our commitment"):
            gather_to(self, k)

    def on_commit(self: Any, owner: int, head: bytes, sig: bytes, via: int | None = None) -> Any:
        if owner == 0 and via is None:  # (its own: others forward it too)
            seen[self.rank].append("commitment")
        return committed(self, owner, head, sig, via)

    def on_got(self: Any, owner: int, *a: Any) -> Any:
        if owner == 0:
            seen[self.rank].append("aggregate")
        return got(self, owner, *a)

    monkeypatch.setattr(butterfly._ButterflyRun, "_gather_to", hold)
    monkeypatch.setattr(audit.Ledger, "committed", on_commit)
    monkeypatch.setattr(audit.Ledger, "got", on_got)
    xs = _inputs(world, 9000)
    _, outs, errs = _butterfly(world, xs, CFG)
    assert errs == [None] * world
    assert all(_same_bits(o, butterfly.simulate(xs, "int8", 64, 512, "clip")) for o in outs)
    pieces = butterfly_plan(9000, world, 64, 512).pieces
    assert pieces > 2 and all(s == ["commitment"] + ["aggregate"] * pieces for s in seen.values()), seen


class _Reorder:
    """Rank ``bad``'s link to one victim, sending its frames in another order (``how``)."""

    def __init__(self, conn: Any, how: Any) -> None:
        self.conn, self.how, self.held = conn, how, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def send(self, mtype: MsgType, payload: Any = b"", **kw: Any) -> Any:
        return self.how(self, mtype, payload, kw)


def _tail_first(w: _Reorder, mtype: MsgType, payload: Any, kw: Any) -> Any:
    if mtype == MsgType.AUDIT:  # every audit frame held back until after the tail
        w.held.append(payload)
        return None
    w.conn.send(mtype, payload, **kw)
    if mtype == MsgType.DATA and getattr(payload, "nbytes", 0) == butterfly.TAIL:
        for p in w.held:
            w.conn.send(MsgType.AUDIT, p, **kw)
    return None


def _audit_in_step1(w: _Reorder, mtype: MsgType, payload: Any, kw: Any) -> Any:
    if not w.held:  # an audit frame before its first piece
        w.held.append(w.conn.send(MsgType.AUDIT, bytes(8), **kw))
    return w.conn.send(mtype, payload, **kw)


def _extra_audit(w: _Reorder, mtype: MsgType, payload: Any, kw: Any) -> Any:
    if mtype == MsgType.DATA and getattr(payload, "nbytes", 0) == butterfly.TAIL:
        w.conn.send(MsgType.AUDIT, bytes(64), **kw)  # one audit frame more than an audit has
    return w.conn.send(mtype, payload, **kw)


@pytest.mark.parametrize(("how", "audit_on"), [(_tail_first, True), (_audit_in_step1, True), (_extra_audit, True),
                                               (_tail_first, False)])
def test_audit_frames_out_of_order_fail_the_call_on_their_sender_and_frame_nobody(
        monkeypatch: pytest.MonkeyPatch, how: Any, audit_on: bool) -> None:
    """A sender's audit frames may come anywhere between its aggregates, but not before its
    pieces and not one too many: either is a FrameError on that link naming the sender. Before
    its pieces, it ends that link in step 1 and the victim leaves the sender's rows out of its
    segment (the row deadline; before, it failed the call): then as held back, below. One too many, after all its audit frames, ends that link in
    the gather only: the victim gets the sender's last piece relayed by a member that holds it,
    checked against the sender's commitment, and every rank completes with the same bits. Held
    back until after its tail, the tail is out of step and ends the link: what the victim needs
    of them has a second source (commitment and nonce forwarded, answer supplied by the owner
    the victim audits, echo done without) unless the draw makes one of the two the other's
    auditor (row lists, or a challenge, only the sender holds): then the call fails, else every
    rank completes with the same bits. No honest member is named or suspected. Without audits
    there is nothing to reorder."""
    world, bad, victim = 4, 1, 3
    _wrap_link(monkeypatch, world, bad, victim, lambda conn, _: _Reorder(conn, how))
    cfg = dataclasses.replace(CFG, deadline=3, audit=audit_on)
    t0 = time.monotonic()
    xs = _inputs(world, 9000, seed=2)
    comms, outs, errs = _butterfly(world, xs, cfg)
    assert time.monotonic() - t0 < 6
    if how is _tail_first and not audit_on or how is _extra_audit or how is not _extra_audit and errs == [None] * world:
        assert errs == [None] * world, errs  # (no audit frames to reorder; relayed; or every one had a second source)
        left = {victim: {bad: 0}} if how is _audit_in_step1 else None
        assert all(_same_bits(o, butterfly.simulate(xs, "int8", 64, 512, "clip", left=left)) for o in outs)
        return
    assert errs[victim] is not None, errs
    for e in errs:  # a frame error names the sender of the frame: never an honest rank
        assert not isinstance(e, FrameError) or (f"r{bad} " in str(e) and "AUDIT" in str(e)), errs
    for c in comms:
        assert set(c.missing) <= {bad} and c.audited is None and (c.suspect is None or c.suspect[0] == bad)


def test_an_auditor_asks_its_target_for_the_rows_of_members_gone_quiet_and_takes_only_committed_ones() -> None:
    """``Ledger.decide``: the request for rows waits for the answer and echo of every member
    whose link to the auditor has not ended (never on time alone: an echo merely late could be
    made so by a colluder), then names the members whose answers have not come; ``supply``
    takes a supplied row as an answer only if it is the one the target's row list commits to,
    and never over an answer that came."""
    ctx = audit.Auditing("run", 3, 1, 0, ("a", "b", "c", "d"), sign=lambda data: bytes(64),
                         verify=lambda r, data, sig: True, choose=lambda pieces: 0, nonce=bytes(32),
                         accepts=lambda r, nonce: True, revealed=lambda nonces: None)
    led = audit.Ledger(ctx, 0, 4000, 256, "int8", 64, "mean", frozenset())
    led.target, led.auditor = 2, 3
    led.lefts[2] = (led.plan.pieces,) * 4
    assert not led.decide(()), "decided before the challenge"
    led.challenge = 0
    rows = [quant.encode(np.full(250, r, np.float32), "int8", 64).tobytes() for r in range(4)]
    led.audited = ([], b"", [b"".join(digest(p) + bytes(ENTRY - 32) for p in rows)])
    led.answers[2], led.answers[1] = (rows[2], b"s"), (rows[1], b"s")
    assert not led.decide(()), "member 1's echo and member 3's answer and echo are due"
    led.echoes[1] = ((b"", b""), (b"", b""))
    assert not led.decide(()), "member 3's link has not ended"
    assert led.decide({3}) and led.wants == bytes([0, 0, 0, 1])
    assert not led.supply(3, rows[1]) and 3 not in led.answers  # (another member's row: not the committed one)
    assert led.supply(3, rows[3]) and led.answers[3] == (rows[3], None)
    assert led.supply(1, rows[1]) and led.answers[1] == (rows[1], b"s")  # (its own answer stays)
    done = audit.Ledger(ctx, 0, 4000, 256, "int8", 64, "mean", frozenset())
    done.target, done.auditor, done.challenge = 2, 3, 0
    done.lefts[2] = (done.plan.pieces,) * 4
    done.answers = {r: (rows[r], b"s") for r in (1, 2, 3)}
    done.echoes = {r: ((b"", b""), (b"", b"")) for r in (1, 3)}
    assert done.decide(()) and done.wants == bytes(4)  # (all came: an empty request)
    # a member whose row our target declared left out of the piece we check: its answer is not
    # waited for nor asked for (its echo is); it is, from a later piece on
    for first, wants in ((0, bytes(4)), (1, None)):
        out = audit.Ledger(ctx, 0, 4000, 256, "int8", 64, "mean", frozenset())
        out.target, out.auditor, out.challenge = 2, 3, 0
        out.lefts[2] = (out.plan.pieces, out.plan.pieces, out.plan.pieces, first)
        out.answers = {r: (rows[r], b"s") for r in (1, 2)}
        out.echoes = {1: ((b"", b""), (b"", b""))}
        assert not out.decide(()), "member 3's echo is due"
        out.echoes[3] = ((b"", b""), (b"", b""))
        assert out.decide(()) == (wants is not None) and out.wants == wants
        assert out.answered() == (wants is not None)
