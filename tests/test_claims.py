"""Barrier records signed by the coordinator (coordinator/claims.py): a coordinator that lost
the run's history takes a registration's claim only with the record that proves it, so that no
single member can make itself the run's history by claiming a later step and an epoch of its own."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from intellect_jax.coordinator.claims import KEEP, Notary, RecordBook, best, proven
from intellect_jax.coordinator.protocol import Resume
from intellect_jax.net.identity import COORDINATOR
from intellect_jax.testing.identities import credentials

from helpers import Run, coord_client as _client

RUN = "coord-test"


def _notary(name: str = COORDINATOR, run_id: str = RUN) -> Notary:
    c = credentials(name)
    return Notary(run_id, c.sign, c.cert_der, c.ca_der)


def test_a_claim_is_proven_by_the_record_of_its_step_or_the_step_before() -> None:
    n = _notary()
    r = n.sign(7, "h7", 4, ["a", "b", "c"])
    ok = [Resume(7, state_hash="h7", record=r), Resume(7, 4, 1, "h7", ("a", "b", "c"), r),
          Resume(8, 4, 1, "h8-any", ("a", "b", "c"), r)]  # (the step after: its hash is the quorum's to settle)
    assert [n.unproven(c, "b") for c in ok] == ["", "", ""]
    assert proven(ok[0], "b") == Resume(7, 4, 1, "h7", ("a", "b", "c"), r)  # the record's epoch, members, rank
    bad = {
        "no record": Resume(7, state_hash="h7"),
        "another hash": Resume(7, state_hash="h7x", record=r),
        "two steps on": Resume(9, state_hash="h9", record=r),
        "a step behind": Resume(6, state_hash="h6", record=r),
        "an epoch of its own": Resume(8, 9, 0, "h8", ("a",), r),
        "other members": Resume(7, 4, 0, "h7", ("a", "b"), r),
        "a record of another run": Resume(7, state_hash="h7", record=_notary(run_id="other").sign(7, "h7", 4, ["a"])),
        "signed by a member": Resume(7, state_hash="h7", record=_notary("node1").sign(7, "h7", 4, ["a", "b", "c"])),
        "its step altered": Resume(9, state_hash="h9", record=replace(r, outer_step=9, state_hash="h9")),
        "its members altered": Resume(7, 4, 0, "h7", ("a",), replace(r, members=("a",))),
        "a bad signature": Resume(7, state_hash="h7", record=replace(r, signature="00" * 70)),
        "no certificate": Resume(7, state_hash="h7", record=replace(r, cert="zz")),
        "a huge epoch and no members": Resume(8, 2**53, 0, "h8", (), r),
    }
    why = {k: n.unproven(c, "a") for k, c in bad.items()}
    why["not a member of its epoch"] = n.unproven(Resume(7, state_hash="h7", record=r), "m")
    revoking = Notary(RUN, n._sign, n.cert, n.ca, revoked=lambda serial: True)
    why["a revoked coordinator's"] = revoking.unproven(Resume(7, state_hash="h7", record=r), "a")
    assert all(why.values()), why
    assert "not of its state of step 9" in why["two steps on"] and "epoch 9" in why["an epoch of its own"]
    assert why["signed by a member"] == "its record does not carry the signature of a coordinator of this run"


def test_best_finds_the_record_of_a_state_or_of_the_step_before() -> None:
    n = _notary()
    rs = [n.sign(5, "h5", 3, ["a"]), n.sign(6, "h6", 3, ["a"]), n.sign(6, "h6", 4, ["a", "b"])]
    assert best(rs, 6, "h6") == rs[2]  # the newest of that step and hash (a retry formed epoch 4)
    assert best(rs, 7, "h7") == rs[2]  # after the all-reduce of step 7, before its barrier
    assert best(rs, 6, "other") == rs[0]  # not its hash: the step before's
    assert best(rs, 9, "h9") is None and best([], 1, "h1") is None


def test_a_record_book_survives_a_restart_keeps_the_newest_and_forgets_a_rolled_back_future(tmp_path) -> None:
    n, path = _notary(), tmp_path / "records.json"
    book = RecordBook(path)
    for k in range(KEEP + 5):
        book.keep(n.sign(k, f"h{k}", 1, ["a"]))
    again = RecordBook(path)
    assert [r.outer_step for r in again.records] == list(range(5, KEEP + 5)) and again.records == book.records
    again.keep(n.sign(10, "h10b", 2, ["a"]))  # the run rolled back to 10: records past it are of no history
    assert [r.outer_step for r in RecordBook(path).records] == list(range(5, 11))
    path.write_text("{not json")
    assert RecordBook(path).records == []  # unreadable: a record only ever helps, so start afresh
    path.write_text(json.dumps([{**json.loads(json.dumps(again.records[0].__dict__)), "outer_step": "5"}]))
    assert RecordBook(path).records == []  # a value of another type: parsed like a peer's message
    assert not list(tmp_path.glob("*.tmp*"))


def _run_with_notary(join_window: float = 1.0) -> Run:
    r = Run(join_window=join_window)
    r.m.notary = _notary(run_id=r.m.record.run_id)
    return r


def test_without_history_a_signing_coordinator_takes_only_proven_claims() -> None:
    """The old coordinator (no journal) had recorded h11 at step 11 and formed epoch 9 of [a, b],
    whose all-reduce of step 12 was done when it died. m registers first claiming step 40 and an
    epoch of its own: without a record it joins, and so does m2 with a record of its making; a
    and b show the record of step 11 and rebuild the run at 12."""
    r = _run_with_notary()
    old = r.m.notary.sign(11, "h11", 9, ["a", "b"])  # type: ignore[union-attr]
    m = r.reg("m", resume=Resume(40, 77, 0, "h40", ("m",)))
    assert not m.member and "claim of outer step 40 is not proven (it carries no record" in m.note
    forged = r.reg("m2", resume=Resume(40, 77, 0, "h40", ("m2",), replace(old, outer_step=40, epoch_id=77,
                                                                               members=("m2",), state_hash="h40")))
    assert not forged.member and "signature of a coordinator" in forged.note
    assert r.reg("a", resume=Resume(12, 9, 0, "h12", ("a", "b"), old)).member
    assert r.reg("b", resume=Resume(12, 0, 0, "h12", (), old)).member  # (a restarted process names no epoch)
    r.arrive("a", 12, "h12"), r.arrive("b", 12, "h12")
    r.tick(2.0)  # (past the join window)
    eps = {n: r.result(n) for n in ("a", "b")}
    assert {e.outer_step for e in eps.values()} == {12} and eps["a"].node_ids == ["a", "b"], eps
    assert r.m.record.hwm_step == 12
    roles = {n["node_id"]: n["role"] for n in r.m.status(r.now)["nodes"]}
    assert roles["m"] != "member" and roles["m2"] != "member", roles


def test_with_history_no_record_is_asked_for() -> None:
    """A coordinator with its history (here: it recorded step 0 itself) judges claims by it."""
    r = _run_with_notary(join_window=0.0)
    for n in ("a", "b"):
        r.reg(n)
    eps = r.barrier(0, ["a", "b"], "h0")
    assert {e.epoch_id for e in eps.values()} == {1} and r.m.record.hwm_step == 0
    rec = eps["a"].record
    assert rec is not None and (rec.outer_step, rec.state_hash, rec.members) == (0, "h0", ("a", "b"))
    assert r.m.notary.unproven(Resume(0, 1, 0, "h0", ("a", "b"), rec), "a") == ""  # type: ignore[union-attr]


def test_over_sockets_members_keep_records_and_a_coordinator_without_history_takes_only_theirs(coordinator) -> None:
    """Two members sync to step 2 with a socket coordinator (no journal); it dies. A new one,
    which knows nothing of the run, takes their claims (each with the record its sync replies
    carried) and not that of m, who claims step 50 with a record of its own making; the run
    goes on at step 2 with a and b."""
    first = coordinator(min_nodes=2)
    a, b = (_client(first.address, n, 9000 + i) for i, n in enumerate("ab"))
    try:
        a.register(), b.register()
        with ThreadPoolExecutor(2) as ex:
            for k in range(3):
                eps = [f.result(10) for f in [ex.submit(c.sync, k, f"h{k}") for c in (a, b)]]
                assert all(e.record is not None and e.record.outer_step == k for e in eps)
        assert a.record is not None and (a.record.outer_step, a.record.state_hash) == (2, "h2")
        claims = {c.node_id: c._claim for c in (a, b)}  # what each would claim with a restarted coordinator
        assert claims["a"].outer_step == 2 and claims["a"].record == a.record
    finally:
        a.close(), b.close()
    first.stop()
    second = coordinator(min_nodes=2)
    a2, b2, m = (_client(second.address, n, 9100 + i) for i, n in enumerate("abm"))
    try:
        fake = _notary(name="m", run_id=RUN).sign(50, "h50", 99, ["m"])
        rm = m.register(Resume(50, 99, 0, "h50", ("m",), fake))  # (as a restarted process: "founder")
        assert not rm.member and "signature of a coordinator of this run" in rm.note
        assert a2.register(claims["a"]).member and b2.register(claims["b"]).member
        with ThreadPoolExecutor(2) as ex:
            fa, fb = ex.submit(a2.sync, 2, "h2"), ex.submit(b2.sync, 2, "h2")
            ea, eb = fa.result(10), fb.result(10)
        assert ea.outer_step == 2 and ea.node_ids == ["a", "b"] == eb.node_ids
        assert second.status()["high_water_mark"]["outer_step"] == 2
    finally:
        for c in (a2, b2, m):
            c.close()


def test_a_record_book_file_is_json_of_the_records(tmp_path) -> None:
    book = RecordBook(tmp_path / "r.json")
    r = _notary().sign(3, "h3", 2, ["a", "b"])
    book.keep(r)
    book.keep(r)  # (the same record again: nothing new to write)
    raw = json.loads((tmp_path / "r.json").read_text())
    assert raw == [{"outer_step": 3, "state_hash": "h3", "epoch_id": 2, "members": ["a", "b"],
                    "signature": r.signature, "cert": r.cert}]


def test_a_resumed_client_keeps_its_record_in_the_claims_that_follow(coordinator) -> None:
    """A node restarted from its checkpoint registers with the record that proves it; the
    claims its client makes afterwards (hold, re-registration with a lost coordinator) keep it."""
    coord = coordinator(min_nodes=1)
    rec = _notary().sign(4, "h4", 3, ["a"])
    a = _client(coord.address, "a", 9300)
    try:
        a.register(Resume(4, state_hash="h4", record=rec))
        a.hold(5, "h5")
        assert a._claim.record == rec and a.record == rec  # (step 5: proven by the record of 4)
    finally:
        a.close()
