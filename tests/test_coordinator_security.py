"""The coordinator against its own members (issue 21): requests bound to the connection's
identity, unpredictable session tokens, accusations only from the accused's ring successor,
history by quorum, a ticker and request handling that survive any exception, handler caps,
revocation, and signed votes."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from intellect_jax.coordinator.journal import RunRecord
from intellect_jax.coordinator.protocol import PROTOCOL, CoordinatorConfig, RegistrationRefused, Resume, StaleSession
from intellect_jax.coordinator.schema import Report
from intellect_jax.coordinator.server import HandlerCaps
from intellect_jax.coordinator.service import CoordinatorService
from intellect_jax.coordinator.server import Coordinator
from intellect_jax.coordinator.wire import SocketWire
from intellect_jax.net import Authority, Credentials, TransportConfig, recv_msg
from intellect_jax.net.evidence import evidence, raw_signature, seal, statement
from intellect_jax.net.identity import vote
from intellect_jax.testing.identities import credentials
from helpers import FP, ManualClock as _ManualClock, Run, coord_client, coord_config, coord_transport, free_port, wait_for


def _reg(node: str, i: int) -> dict[str, Any]:
    return {"op": "register", "node": node, "addr": f"127.0.0.1:{9000 + i}", "devices": 1, "protocol": PROTOCOL,
            "fingerprint": FP, "founder": True, "resume": None}


def _service(clock: Any = None, nodes: str = "ab", **conf: Any) -> tuple[CoordinatorService, dict[str, str]]:
    kw: dict[str, Any] = {"min_nodes": len(nodes), "join_window": 0.0, "heartbeat_timeout": 60.0,
                          "keepalive_interval": 0.01} | conf
    svc = CoordinatorService(CoordinatorConfig(**kw), **({"clock": clock} if clock else {})).start()
    sess = {}
    for i, n in enumerate(nodes):
        reply = svc.handle(_reg(n, i), identity=n)
        assert reply["ok"], reply
        sess[n] = reply["session"]
    return svc, sess


def _sync_round(svc: CoordinatorService, sess: dict[str, str], step: int, h: str) -> dict[str, dict]:
    """Every node of ``sess`` syncs at ``step`` with hash ``h`` at once; their replies."""
    replies: dict[str, dict] = {}

    def go(n: str) -> None:
        replies[n] = svc.handle({"op": "sync", "node": n, "session": sess[n], "step": step, "state_hash": h},
                                deadline=time.monotonic() + 10.0, identity=n)

    ts = [threading.Thread(target=go, args=(n,)) for n in sess]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    return replies


def _stable(status: dict[str, Any]) -> dict[str, Any]:
    """A status without the clock-dependent parts."""
    return {**status, "nodes": [{k: v for k, v in n.items() if k != "heartbeat_age"} for n in status["nodes"]]}


# ---------------------------------------------------------------------------------------------
# identity
# ---------------------------------------------------------------------------------------------
def test_acting_in_another_nodes_name_is_refused_for_every_request_and_changes_nothing() -> None:
    svc, sess = _service(_ManualClock(), nodes="abc")
    a, b = sess["a"], sess["b"]
    before = _stable(svc.status())
    forged = [  # (request, the connection's session) sent by an authenticated "b"
        ({"op": "register", **{k: v for k, v in _reg("z", 9).items() if k != "op"}}, None),  # a new id not its own
        (_reg("a", 0), None),  # a's id: refused for identity, not as a duplicate
        ({"op": "hb"}, ("a", a)),  # a's session
        ({"op": "sync", "node": "a", "session": a, "step": 0, "state_hash": "h0"}, None),
        ({"op": "admit", "node": "a", "session": a, "requeue": True}, None),
        ({"op": "received", "node": "a", "session": a, "step": 1}, None),
        ({"op": "leave", "node": "a", "session": a}, None),
    ]
    for req, session in forged:
        reply = svc.handle(req, session, deadline=0.0, identity="b")
        assert reply["ok"] is False and reply["reason"] == "identity", (req, reply)
        assert "'a'" in reply["message"] or "'z'" in reply["message"], reply
        assert "\n" not in reply["message"]
    # b in its own name, with a's session token: the token is bound to a
    reply = svc.handle({"op": "leave", "node": "b", "session": a}, identity="b")
    assert reply["ok"] is False and reply["reason"] == "identity", reply
    # without an authenticated identity nothing but status is served
    assert svc.handle({"op": "leave", "node": "a", "session": a}, identity=None)["reason"] == "identity"
    assert svc.handle({"op": "status"}, identity=None)["ok"]
    assert svc.handle({"op": "status"}, identity="someone-else")["ok"]
    assert _stable(svc.status()) == before  # nothing changed: nobody left, arrived, registered
    assert svc.handle({"op": "hb"}, ("b", b), identity="b")["ok"]  # b in its own name still works
    assert svc.handle({"op": "leave", "node": "c", "session": sess["c"]}, identity="c")["ok"]
    assert [n["node_id"] for n in svc.status()["nodes"]] == ["a", "b"]


def test_session_tokens_are_random_and_bound_to_their_node() -> None:
    tokens = []
    for _ in range(2):  # two coordinator instances
        svc, sess = _service(_ManualClock(), nodes="abcdefgh")
        tokens += list(sess.values())
        inst = svc.membership.instance
        assert not any(inst in t for t in sess.values())
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in tokens)
    assert len({t[:8] for t in tokens}) == len(tokens)  # no shared prefix (e.g. an instance's)
    # another instance's token is stale (register again); another node's is refused
    r = Run()
    r.reg("a")
    with pytest.raises(StaleSession):
        r.m.heartbeat("a", tokens[0], 0.0)
    r.reg("b")
    with pytest.raises(Exception, match="another node's") as ei:
        r.m.heartbeat("a", r.s["b"], 0.0)
    assert getattr(ei.value, "reason", "") == "identity"


# ---------------------------------------------------------------------------------------------
# accusations
# ---------------------------------------------------------------------------------------------
NAN_PIECE = np.array([1e-3, np.nan, -2e-3, 4e-3], np.float32)


def _nan_evidence(step: int, epoch: int) -> dict[str, Any]:
    """Unsigned evidence of a non-finite piece (an in-process run signs nothing)."""
    return evidence(step=step, epoch=epoch, call=0, segment=0, piece=0, numel=4, mode="fp32", block=1,
                    payload=NAN_PIECE.tobytes(), signature=None)


def _arrive(r: Run, n: str, k: int, accuse: str | None = None, failed: bool = False, retry_of: int | None = None,
            ev: dict[str, Any] | None = None, h: str | None = None, vote: tuple[str, str] | None = None):
    if accuse and ev is None:
        ev = _nan_evidence(k - 1, r.m._last.epoch_id)  # type: ignore[union-attr]
    report = Report.model_validate({"avg_failed": failed, "accused": [accuse, "values 99x ours"] if accuse else None,
                                    "evidence": ev if accuse else None})
    return r.m.arrive(n, r.s[n], k, r.now, h or f"h{k}", retry_of, None, report, vote)


def test_a_made_up_accusation_evicts_nobody_and_counts_against_the_accuser() -> None:
    r = Run(min_nodes=4, strikes=2)
    for n in "abcd":
        r.reg(n)
    r.barrier(0, list("abcd"), "h0")  # ring [a, b, c, d]: a's successor is b
    for k in (1, 2):  # c accuses a in two rounds whose average everyone found bad
        for n in "abcd":
            _arrive(r, n, k, accuse="a" if n == "c" else None, failed=True)
        if k == 1:
            assert r.m._nodes["c"].false_accusations == 1 and r.m._nodes["a"].strikes == 0
    ev = r.m.status(r.now)["evictions"]
    assert [(e["node_id"], e["reason"].split(":")[0]) for e in ev] == [("c", "false accusations")]
    assert r.result("a").node_ids == ["a", "b", "d"]  # type: ignore[union-attr]  # the accused stays
    said = [ln for ln in r.m.drain_events() if "false accusation" in ln]
    assert said[0].startswith("WARNING false accusation: c accused a of a bad contribution (values 99x ours) but "
                              "is not its ring successor in epoch 1 ([a, b, c, d])")
    # the successor's blame still counts in failed rounds only
    r2 = Run(min_nodes=3, strikes=2)
    for n in "abc":
        r2.reg(n)
    r2.barrier(0, list("abc"), "h0")
    for k, failed in ((1, True), (2, False), (3, True)):
        for n in "abc":
            _arrive(r2, n, k, accuse="a" if n == "b" else None, failed=failed)
    assert [e["node_id"] for e in r2.m.status(r2.now)["evictions"]] == ["a"]
    assert r2.m._nodes["b"].false_accusations == 0


def test_an_accusation_is_judged_in_the_ring_whose_all_reduce_it_reports() -> None:
    """Barrier 1 forms [a, b, c, d], whose ring fails; b is gone and the retry forms [a, c, d]:
    that ring did step 2's all-reduce, and there c follows a."""
    r = Run(min_nodes=4, strikes=1)
    for n in "abcd":
        r.reg(n)
    r.barrier(0, list("abcd"), "h0")
    e1 = r.barrier(1, list("abcd"), "h1")["a"]
    r.m.leave("b", r.s["b"], r.now)
    for n in "acd":
        _arrive(r, n, 1, retry_of=e1.epoch_id)
    assert r.result("a").node_ids == ["a", "c", "d"]  # type: ignore[union-attr]
    for n in "acd":
        _arrive(r, n, 2, accuse="a" if n == "c" else None, failed=True)
    assert [e["node_id"] for e in r.m.status(r.now)["evictions"] if not e["graceful"]] == ["a"]
    assert r.m._nodes["c"].false_accusations == 0


def _signed(signer: str | None, values: np.ndarray, *, run_id: str, step: int, epoch: int,
            opening: dict[str, Any] | None, to: str = "b") -> dict[str, Any]:
    """Evidence of ``values`` as a's own piece sent to ``to``, signed by ``signer`` with its own
    certificate (None: unsigned)."""
    payload = values.astype(np.float32).tobytes()
    sig = cert = None
    if signer is not None:
        said = statement(run_id, step, epoch, 0, "a", to, 2, 0, values.size, "fp32", 1, payload)
        sig, cert = raw_signature(credentials(signer).sign(said)), credentials(signer).cert_der
    return {**evidence(step=step, epoch=epoch, call=0, segment=2, piece=0, numel=values.size, mode="fp32", block=1,
                       payload=payload, signature=sig, cert=cert), "opening": opening}


OPENING = {"core": "ab" * 16, "numel": 1000, "scale": 10.0}  # the outer params' RMS: 10 / sqrt(1000) = 0.316
HONEST, OUTSIZED = np.full(64, 0.05, np.float32), np.full(64, 5.0, np.float32)  # 0.16x and 16x that RMS
EVIDENCE = {  # name: (signer, values, outer step signed, opening) -> whether a is found guilty
    "no evidence": (None, None, 0, None, False),
    "signed by the accuser": ("b", NAN_PIECE, 0, None, False),
    "unsigned in a signed run": (None, NAN_PIECE, 0, None, False),
    "an honest piece": ("a", HONEST, 0, OPENING, False),
    "a scale that opens no recorded hash": ("a", OUTSIZED, 0, {**OPENING, "scale": 0.01}, False),
    "a piece of another outer step": ("a", NAN_PIECE, 5, None, False),
    "a non-finite piece": ("a", NAN_PIECE, 0, None, True),
    "an outsized piece, its scale opened": ("a", OUTSIZED, 0, OPENING, True),
}


@pytest.mark.parametrize("case", list(EVIDENCE))
def test_an_accusation_stands_only_on_the_accused_s_own_signed_piece(case: str) -> None:
    """b, a's ring successor, accuses a in a round whose average everyone found bad: a is
    blamed only when b shows a piece a signed for that all-reduce which is bad by the
    coordinator's own verdict (against a scale that opens the recorded hash); otherwise the
    accusation counts against b."""
    signer, values, step, opening, guilty = EVIDENCE[case]
    r = Run(min_nodes=3, strikes=2)
    r.m.police.ca = credentials("a").ca_der  # a run with identities: pieces must be signed under its authority
    for n in "abc":
        r.reg(n)
    r.barrier(0, list("abc"), seal(OPENING["core"], OPENING["numel"], OPENING["scale"]))  # ring [a, b, c]
    epoch, run_id = r.m._last.epoch_id, r.m.record.run_id  # type: ignore[union-attr]
    ev = None if values is None else _signed(signer, values, run_id=run_id, step=step, epoch=epoch, opening=opening)
    for n in "abc":  # (a sends no hash and no vote: evidence does not depend on them)
        report = Report.model_validate({"avg_failed": True, "accused": ["a", "its piece"] if n == "b" else None,
                                        "evidence": ev if n == "b" else None})
        r.m.arrive(n, r.s[n], 1, r.now, None if n == "a" else "h1", None, None, report)
    assert r.result("b") is not None
    a, b = r.m._nodes["a"], r.m._nodes["b"]
    assert (a.strikes, b.false_accusations) == ((1, 0) if guilty else (0, 1))
    said = [ln for ln in r.m.drain_events() if "false accusation" in ln]
    assert bool(said) is not guilty, said


def test_a_signed_piece_shown_by_any_receiver_is_a_strike_even_when_the_average_passed() -> None:
    """In the butterfly exchange a's pieces go to every segment's owner, c among them (not a's
    ring successor), and a robust owner drops a bad row, so the average passes: c's evidence,
    signed by a to c, still strikes a, and two such rounds evict a, the evidence logged. The
    same piece signed to b and shown by c is a false accusation (c did not receive it)."""
    r = Run(min_nodes=3, strikes=2)
    r.m.police.ca = credentials("a").ca_der
    for n in "abcd":
        r.reg(n)
    r.barrier(0, list("abcd"), "h0")
    epoch, run_id = r.m._last.epoch_id, r.m.record.run_id  # type: ignore[union-attr]
    to_b = _signed("a", NAN_PIECE, run_id=run_id, step=0, epoch=epoch, opening=None, to="b")
    for n in "abcd":
        _arrive(r, n, 1, accuse="a" if n == "c" else None, ev=to_b if n == "c" else None)
    assert (r.m._nodes["a"].strikes, r.m._nodes["c"].false_accusations) == (0, 1)
    for k in (2, 3):
        epoch = r.m._last.epoch_id  # type: ignore[union-attr]
        to_d = _signed("a", NAN_PIECE, run_id=run_id, step=k - 1, epoch=epoch, opening=None, to="d")
        for n in "abcd":
            _arrive(r, n, k, accuse="a" if n == "d" else None, ev=to_d if n == "d" else None)
        if k == 2:
            assert r.m._nodes["a"].strikes == 1 and r.m._nodes["d"].false_accusations == 0
    events = r.m.drain_events()
    assert any("d shows a's own piece 0 of segment 2 (call 0) in outer step 1's all-reduce, signed by a: "
               "non-finite values" in ln for ln in events), events
    ev = r.m.status(r.now)["evictions"]
    assert [(e["node_id"], e["reason"].split(" (")[0]) for e in ev] == [
        ("a", "poisoned contributions: shown in 2 rounds with its own signed pieces")]


def test_a_clear_cut_verdict_is_not_undone_by_a_later_magnitude_one() -> None:
    """a sends a NaN piece to owner b and an outsized one to owner c in a round whose average
    passed: b's evidence (clear-cut) strikes a, whatever c shows after it; c's alone would not."""
    for shown in ("bc", "c"):
        r = Run(min_nodes=3, strikes=2)
        r.m.police.ca = credentials("a").ca_der
        for n in "abc":
            r.reg(n)
        r.barrier(0, list("abc"), seal(OPENING["core"], OPENING["numel"], OPENING["scale"]))
        epoch, run_id = r.m._last.epoch_id, r.m.record.run_id  # type: ignore[union-attr]
        ev = {"b": _signed("a", NAN_PIECE, run_id=run_id, step=0, epoch=epoch, opening=None, to="b"),
              "c": _signed("a", OUTSIZED, run_id=run_id, step=0, epoch=epoch, opening=OPENING, to="c")}
        for n in "abc":
            accuse = n in shown and n != "a"
            report = Report.model_validate({"avg_failed": False, "accused": ["a", "its piece"] if accuse else None,
                                            "evidence": ev[n] if accuse else None})
            r.m.arrive(n, r.s[n], 1, r.now, None if n == "a" else "h1", None, None, report)
        assert r.m._nodes["a"].strikes == (1 if "b" in shown else 0), shown
        assert r.m._nodes["b"].false_accusations == r.m._nodes["c"].false_accusations == 0


# ---------------------------------------------------------------------------------------------
# history by quorum
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("honest", [1, 2])
def test_a_joiner_s_received_state_is_checked_by_the_members_quorum_not_counted_in_it(honest: int) -> None:
    """Donor a serves joiner j a bogus state X and claims X itself at the next barrier: j's
    hash is no vote (it holds a state it received), so with one honest member the barrier ties
    and waits, evicting nobody; with two, the honest hash is recorded and a and j are evicted
    as diverged. Counted as votes, a and j would have outvoted the honest member."""
    names = "abc"[: honest + 1]
    r = Run(min_nodes=len(names))
    for n in names:
        r.reg(n)
    r.barrier(0, list(names), "h0")
    r.reg("j")
    r.barrier(1, list(names), "h1")  # admits j, donor a
    assert r.m.admission_for("j", r.s["j"]).donor_id == "a"  # type: ignore[union-attr]
    assert r.m.state_received("j", r.s["j"], 2, r.now)
    for n in ["j", *names]:
        r.arrive(n, 2, "X" if n in "aj" else "h2")
    status = r.m.status(r.now)
    if honest == 1:
        assert r.result("b") is None and status["evictions"] == []
        assert "no quorum for outer step 2" in status["waiting"] and "of 2 members" in status["waiting"]
        assert 2 not in r.m.record.hashes
    else:
        assert r.m.record.hashes[2] == "h2" and r.result("b").node_ids == ["b", "c"]  # type: ignore[union-attr]
        assert sorted(e["node_id"] for e in status["evictions"]) == ["a", "j"]
        assert all(e["reason"].startswith("diverged") for e in status["evictions"])


def test_a_two_node_tie_records_nothing_evicts_nobody_and_waits_until_one_leaves() -> None:
    r = Run(min_nodes=2)
    r.reg("a"), r.reg("b")
    r.barrier(0, ["a", "b"], "h0")
    assert r.arrive("a", 1, "h1") is None and r.arrive("b", 1, "h2") is None
    r.tick(10.0)
    r.tick(10.0)
    st = r.m.status(r.now)
    assert st["evictions"] == [] and 1 not in r.m.record.hashes and r.result("a") is None
    assert st["waiting"].startswith("no quorum for outer step 1: hash h1.. by [a], hash h2.. by [b]")
    assert [ln for ln in r.m.drain_events() if "no quorum" in ln] == ["WARNING " + st["waiting"]]  # said once
    r.m.leave("b", r.s["b"], r.now)  # one side leaves: a is a majority of the new membership
    assert r.result("a").node_ids == ["a"] and r.m.record.hashes[1] == "h1"  # type: ignore[union-attr]
    assert r.m.status(r.now)["waiting"] is None


def test_a_tie_in_a_rebuild_is_resolved_by_a_member_that_arrives() -> None:
    first = Run(min_nodes=1)
    first.reg("a")
    first.barrier(0, ["a"], "h0")
    r = Run(record=RunRecord.from_json(first.m.record.to_json()), join_window=5.0)
    for n, h in (("a", "x1"), ("b", "x2")):  # both claim outer step 1, unrecorded, with other bytes
        assert r.reg(n, resume=Resume(1, 1, "ab".index(n), h)).member
        r.m.arrive(n, r.s[n], 1, r.now, h)
    r.tick(6.0)
    assert "no quorum for outer step 1" in r.m.status(r.now)["waiting"] and not r.m.started
    assert r.reg("c", resume=Resume(1, 1, 2, "x1")).member
    r.m.arrive("c", r.s["c"], 1, r.now, "x1")
    assert r.result("a").node_ids == ["a", "c"] and r.m.record.hashes[1] == "x1"  # type: ignore[union-attr]
    assert [e["node_id"] for e in r.m.status(r.now)["evictions"]] == ["b"]


# ---------------------------------------------------------------------------------------------
# nothing kills the ticker or escapes handle
# ---------------------------------------------------------------------------------------------
def test_malformed_sync_fields_get_a_one_line_reply_and_the_ticker_lives_on() -> None:
    svc, sess = _service(nodes="abs", heartbeat_timeout=0.5, tick_interval=0.02)
    try:
        for bad, field in (({"report": {"avg_failed": True, "accused": ["b"]}}, "report.accused"),
                           ({"state_hash": 1234}, "state_hash")):
            req = {"op": "sync", "node": "a", "session": sess["a"], "step": 0} | bad
            reply = svc.handle(req, identity="a", deadline=time.monotonic())
            assert reply["ok"] is False and reply["error"] == "ProtocolError", reply
            assert reply["message"].startswith(f"malformed 'sync' request: {field}: "), reply
        end = time.monotonic() + 5.0
        while time.monotonic() < end and "s" in {n["node_id"] for n in svc.status()["nodes"]}:
            for n in "ab":
                svc.handle({"op": "hb"}, (n, sess[n]), identity=n)
            time.sleep(0.05)
        ev = {e["node_id"]: e["reason"] for e in svc.status()["evictions"]}
        assert list(ev) == ["s"] and ev["s"].startswith("no heartbeat"), ev  # the silent node timed out
    finally:
        svc.stop()


def test_the_ticker_survives_a_failing_tick(caplog: pytest.LogCaptureFixture) -> None:
    svc, sess = _service(nodes="as", heartbeat_timeout=0.5, tick_interval=0.01)
    real, fails = svc.membership.tick, [0]

    def flaky(now: float) -> None:
        if fails[0] < 5:
            fails[0] += 1
            raise IndexError("a bug in tick")
        real(now)

    svc.membership.tick = flaky  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.INFO, "intellect_jax.coordinator"):
            end = time.monotonic() + 5.0
            while time.monotonic() < end and not svc.status()["evictions"]:
                svc.handle({"op": "hb"}, ("a", sess["a"]), identity="a")
                time.sleep(0.05)
        assert [e["node_id"] for e in svc.status()["evictions"]] == ["s"]
        failed = [rec for rec in caplog.records if "tick failed" in rec.getMessage()]
        assert failed[0].exc_info and failed[0].exc_info[0] is IndexError  # with its traceback, once
        assert [rec.getMessage() for rec in failed[1:]] == [
            f"the membership tick failed {n} times so far (last: IndexError: a bug in tick)" for n in (2, 4)]
        assert not any(rec.exc_info for rec in failed[1:])
    finally:
        svc.stop()


def test_an_exception_inside_a_request_is_logged_and_answered(caplog: pytest.LogCaptureFixture) -> None:
    svc, sess = _service(_ManualClock())
    m = svc.membership

    def broken(*a: Any) -> None:
        raise AttributeError("'NoneType' object has no attribute 'step'")

    m.heartbeat = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, "intellect_jax.coordinator"):
        reply = svc.handle({"op": "hb"}, ("a", sess["a"]), identity="a")
    assert reply["ok"] is False and reply["reason"] == "internal" and reply["error"] == "CoordinatorError", reply
    assert "internal error answering a 'hb' request" in reply["message"]
    (rec,) = [r for r in caplog.records if r.exc_info]
    assert rec.exc_info[0] is AttributeError and "identity a" in rec.getMessage()  # type: ignore[index]
    del m.heartbeat
    assert svc.handle({"op": "hb"}, ("a", sess["a"]), identity="a")["ok"]


# ---------------------------------------------------------------------------------------------
# handler caps, admissions
# ---------------------------------------------------------------------------------------------
def test_handler_caps_per_identity_and_in_all(caplog: pytest.LogCaptureFixture) -> None:
    caps = HandlerCaps(CoordinatorConfig(max_handlers=3, handlers_per_identity=2))
    with caplog.at_level(logging.WARNING, "intellect_jax.coordinator"):
        assert caps.acquire("a") is None and caps.acquire("a") is None
        for _ in range(3):
            assert "a has 2 connections served already" in str(caps.acquire("a"))
        assert caps.acquire("b") is None
        assert "serves 3 connections already" in str(caps.acquire("c"))
        caps.release("a")
        assert caps.acquire("c") is None
    assert caps.refused == {"a": 3, "c": 1} and caps.total == 3 and caps.by_identity == {"a": 1, "b": 1, "c": 1}
    said = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith("refusing connections of a")  # once per identity
    with pytest.raises(ValueError, match="max_handlers"):
        CoordinatorConfig(handlers_per_identity=0)


def test_an_admission_carries_the_hash_the_run_recorded_for_its_step() -> None:
    assert PROTOCOL >= 5  # (the admission has carried the hash since protocol 5)
    first = Run(min_nodes=1)
    first.reg("a")
    for k in range(4):
        first.barrier(k, ["a"], f"h{k}")
    r = Run(record=RunRecord.from_json(first.m.record.to_json()))
    assert r.reg("a", resume=Resume(3, 1, 0, "h3")).member
    adm = r.m.admission_for("a", r.s["a"])
    assert adm is not None and (adm.donor_id, adm.outer_step, adm.state_hash) == ("a", 3, "h3")
    r.barrier(3, ["a"], "h3")
    r.reg("j")
    r.barrier(4, ["a"], "h4")
    adm = r.m.admission_for("j", r.s["j"])  # the state of step 5 is not recorded yet
    assert adm is not None and (adm.donor_id, adm.outer_step, adm.state_hash) == ("a", 5, None)
    r.m.record.record(5, "h5", 10)  # (as if a barrier of step 5 had recorded it)
    assert r.m.admission_for("j", r.s["j"]).state_hash == "h5"  # type: ignore[union-attr]


def test_over_sockets_a_request_acts_only_for_its_certificate_and_connections_are_capped(coordinator) -> None:
    coord = coordinator(min_nodes=1, handlers_per_identity=2)
    a = coord_client(coord.address, "a", free_port())
    impostor = coord_client(coord.address, "a", free_port(), transport=coord_transport("mallory"))
    held = None
    try:
        with pytest.raises(RegistrationRefused, match="register in the name of node 'a' from a connection "
                                                      "authenticated as 'mallory'") as ei:
            impostor.register()
        assert ei.value.reason == "identity" and coord.status()["nodes"] == []
        assert a.register().member  # a's session: one handler of identity a
        wire = SocketWire(coord.address, coord_transport("a"))
        held, reply = wire.open({"op": "status"}, 5.0)  # a second one, kept open
        assert reply["ok"] and held is not None
        third = wire._connect(5.0)  # a third: over the cap (answered before it sends anything, then closed)
        try:
            busy = recv_msg(third, time.monotonic() + 5.0)
        finally:
            third.close()
        assert busy["ok"] is False and busy["reason"] == "busy" and "a has 2 connections" in busy["message"], busy
        assert coord.caps.refused == {"a": 1}
        wire.close(held)
        held = None
        wait_for(lambda: coord.caps.by_identity["a"] == 1, what="the held connection's handler to end")
        assert wire.request({"op": "status"}, time.monotonic() + 5.0, 5.0)["ok"]
        assert [n["node_id"] for n in a.status()["nodes"]] == ["a"]
    finally:
        if held is not None:
            held.close()
        a.close(), impostor.close()


# ---------------------------------------------------------------------------------------------
# revocation and signed votes (over sockets, with a run authority of the test's own)
# ---------------------------------------------------------------------------------------------
def _authority(tmp_path: Any, *nodes: str) -> tuple[Authority, Any]:
    auth = Authority.init(tmp_path / "keys", "coord-test")
    for n in nodes:
        auth.issue(n)
    return auth, lambda n: TransportConfig("coord-test", Credentials.load(tmp_path / "keys", n), io_timeout=5.0,
                                           connect_timeout=5.0, handshake_timeout=5.0)


def _syncs(clients: list[Any], step: int, h: str) -> list[Any]:
    with ThreadPoolExecutor(len(clients)) as ex:
        return [f.result(20) for f in [ex.submit(c.sync, step, h) for c in clients]]


def test_a_revoked_member_is_evicted_and_refused(tmp_path: Any) -> None:
    auth, cfg = _authority(tmp_path, "a", "b", "c")
    mine = cfg("c")  # loaded before the revocation: c still holds its files
    with Coordinator(cfg("coordinator"), config=coord_config(min_nodes=3)) as coord:
        cs = [coord_client(coord.address, n, free_port(), transport=mine if n == "c" else cfg(n)) for n in "abc"]
        try:
            for c in cs:
                c.register()
            assert _syncs(cs, 0, "h0")[0].node_ids == ["a", "b", "c"]
            auth.revoke("c")  # the operator, during the run
            wait_for(lambda: any(e["node_id"] == "c" for e in coord.status()["evictions"]), 10, "c's eviction")
            ev = next(e for e in coord.status()["evictions"] if e["node_id"] == "c")
            assert ev["reason"] == "identity revoked by the run's operator" and not ev["graceful"]
            again = coord_client(coord.address, "c", free_port(), transport=mine, reconnect_timeout=1.0)
            with pytest.raises(RegistrationRefused, match="identity c is revoked") as ei:
                again.register()
            assert ei.value.reason == "auth"
            again.close()
            eps = _syncs(cs[:2], 1, "h1")  # the others go on, with one history
            assert eps[0].node_ids == ["a", "b"] and coord.status()["high_water_mark"]["hash"] == "h1"
            assert [e["node_id"] for e in coord.status()["evictions"]] == ["c"]
        finally:
            for c in cs:
                c.close()


@pytest.mark.slow
def test_votes_are_signed_and_the_journal_proves_each_recorded_hash(tmp_path: Any) -> None:
    """Over sockets every sync's hash carries the node's signature; the journal keeps them, and
    ``--verify-journal`` checks a quorum of them for every recorded step; an unsigned or
    mis-signed vote is refused, and a journal whose hash was edited afterwards fails the check."""
    import json
    import subprocess
    import sys

    from helpers import ROOT

    _, cfg = _authority(tmp_path, "a", "b", "c")
    journal = tmp_path / "run.journal"
    with Coordinator(cfg("coordinator"), config=coord_config(min_nodes=3), journal=str(journal)) as coord:
        cs = [coord_client(coord.address, n, free_port(), transport=cfg(n)) for n in "abc"]
        try:
            for c in cs:
                c.register()
            for k in range(3):
                _syncs(cs, k, f"h{k}")
            wire = SocketWire(coord.address, cfg("a"))
            forged = {"op": "sync", "node": "a", "session": cs[0]._session, "step": 3, "state_hash": "h3"}
            for bad in ({}, {"vote": cfg("b").identity.sign(vote("coord-test", 3, "h3")).hex()},
                        {"vote": cfg("a").identity.sign(vote("coord-test", 3, "other")).hex()}):
                reply = wire.request({**forged, **bad}, time.monotonic() + 5.0, 5.0)
                assert reply["ok"] is False and reply["reason"] == "identity", reply
                assert "not signed by its certificate" in reply["message"]
        finally:
            for c in cs:
                c.close()
    rec = json.loads(journal.read_text())
    assert sorted(rec["hashes"]) == sorted(rec["votes"]) == ["0", "1", "2"]
    assert all(sorted(v["signed"]) == ["a", "b", "c"] and v["members"] == 3 for v in rec["votes"].values())

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "intellect_jax.coordinator", "--verify-journal", str(journal),
                               "--keys", str(tmp_path / "keys")], capture_output=True, text=True, cwd=ROOT,
                              timeout=60)

    r = check()
    assert r.returncode == 0 and "3 recorded steps (0..2), each signed by a quorum" in r.stdout, r.stderr
    Authority.load(tmp_path / "keys").issue("a")  # a's certificate is renewed: its old votes still hold
    r = check()
    assert r.returncode == 0, r.stderr
    rec["hashes"]["1"] = "forged"  # someone edits the record afterwards
    signed = rec["votes"]["2"]["signed"]
    signed["b"] = signed["c"] = signed["a"]  # or passes a's signature off as b's and c's
    journal.write_text(json.dumps(rec))
    r = check()
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert "2 of 3 recorded steps not signed by a quorum: outer step 1: 0 valid signatures of 3 members" in err[0]
    assert "outer step 2: 1 valid signatures of 3 members (a)" in err[0]


def test_malformed_votes_and_journals_are_one_line_errors(tmp_path: Any) -> None:
    import json
    import subprocess
    import sys

    from intellect_jax.coordinator.journal import Journal, JournalError
    from intellect_jax.coordinator.schema import parse_request
    from intellect_jax.coordinator.protocol import ProtocolError
    from helpers import ROOT

    sync = {"op": "sync", "node": "a", "session": "s", "step": 0, "state_hash": "h"}
    for bad in ("a" * 17, "zz" * 10, "ab"):  # odd length, not hex, too short
        with pytest.raises(ProtocolError, match="malformed 'sync' request: vote"):
            parse_request({**sync, "vote": bad})
    path = tmp_path / "j"
    path.write_text(json.dumps({"version": 1, "run_id": "r", "votes": []}))
    with pytest.raises(JournalError, match="unreadable"):
        Journal(path).load("r")
    Authority.init(tmp_path / "keys", "r")
    path.write_text(json.dumps({"version": 1, "run_id": "r", "hashes": {"1": "h"}, "votes": {"1": {"members": 3}}}))
    r = subprocess.run([sys.executable, "-m", "intellect_jax.coordinator", "--verify-journal", str(path), "--keys",
                        str(tmp_path / "keys")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "outer step 1: malformed votes" in err[0], r.stderr


def test_a_member_proven_a_forger_is_banned_and_the_ban_outlives_a_restart(tmp_path) -> None:
    """A ban (an audit's case evicted the member on its own signatures) is in the journal: the
    member is refused at registration, also by a coordinator restarted from that journal; a
    journal whose ban list is malformed is refused in one line."""
    from intellect_jax.coordinator.admission import check_registration
    from intellect_jax.coordinator.journal import Journal, JournalError

    rec = RunRecord(run_id="r", banned={"mallory": "its aggregate of piece 0 of segment 1 is not the mean of ..."})
    journal = Journal(tmp_path / "j.json")
    journal.save(rec)
    again = journal.load("r")
    assert again.banned == rec.banned
    with pytest.raises(RegistrationRefused, match="mallory is banned from this run: its aggregate") as e:
        check_registration("mallory", "127.0.0.1:1", PROTOCOL, FP, None, {}, again)
    assert e.value.reason == "banned"
    check_registration("alice", "127.0.0.1:1", PROTOCOL, FP, None, {}, again)  # anyone else registers
    bad = again.to_json() | {"banned": ["mallory"]}
    with pytest.raises(JournalError, match="banned is not a map"):
        RunRecord.from_json(bad)
