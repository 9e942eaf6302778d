"""Coordinator: the membership state machine (deterministic, no sockets), then the server and client."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from intellect_jax.coordinator.client import coordinator_status
from intellect_jax.coordinator.server import Coordinator
from intellect_jax.coordinator.journal import Journal, JournalError, RunRecord
from intellect_jax.coordinator.membership import Membership
from intellect_jax.coordinator.protocol import (
    PROTOCOL,
    CoordinatorConfig,
    Evicted,
    ProtocolError,
    RegistrationRefused,
    Resume,
    RunCompleted,
    StaleSession,
)
from intellect_jax.net import Authority, Credentials, TransportConfig

from helpers import FP, ROOT, Run, coord_client as _client, coord_config as _conf, coord_env as _env, \
    coord_transport as _tcfg, wait_for as _wait_for



# ---------------------------------------------------------------------------------------------
# state machine
# ---------------------------------------------------------------------------------------------
def test_founding_members_form_epoch_1_at_boundary_0() -> None:
    r = Run(min_nodes=3)
    for n in ("c", "a", "b"):
        assert r.reg(n).member
    assert r.arrive("a", 0) is None and r.arrive("c", 0) is None
    ep = r.arrive("b", 0)
    assert ep is not None and ep.epoch_id == 1 and ep.outer_step == 0
    assert ep.node_ids == ["a", "b", "c"] and ep.rank == 1  # deterministic ring order
    assert [r.result(n).rank for n in "abc"] == [0, 1, 2]  # type: ignore[union-attr]
    # same membership next boundary -> same epoch id
    eps = r.barrier(1, ["a", "b", "c"])
    assert {e.epoch_id for e in eps.values()} == {1} and not eps["a"].changed
    assert "registered a" in " ".join(r.m.drain_events())


def test_first_barrier_waits_for_min_nodes_and_join_window() -> None:
    r = Run(min_nodes=2, join_window=2.0)
    r.reg("a")
    assert r.arrive("a", 0) is None
    r.tick(3.0)
    assert r.result("a") is None  # only 1 of min 2
    r.reg("b")
    assert r.arrive("b", 0) is not None  # join window long passed, 2 nodes
    r2 = Run(join_window=2.0)
    r2.reg("a")
    assert r2.arrive("a", 0) is None
    r2.tick(1.0)
    assert r2.result("a") is None
    r2.tick(1.5)
    assert r2.result("a") is not None and r2.result("a").members == (("a", "10.0.0.1:7000"),)  # type: ignore[union-attr]


def test_joiner_admitted_at_boundary_with_donor_then_member_next() -> None:
    r = Run(min_nodes=2)
    r.reg("a"), r.reg("b")
    r.barrier(0, ["a", "b"])
    j = r.reg("j")
    assert not j.member and j.outer_step == 1
    with pytest.raises(ProtocolError, match="waiting for admission"):
        r.arrive("j", 1)
    assert r.m.request_admission("j", r.s["j"], r.now) is None  # not admitted mid-step
    r.tick(1.0)
    assert r.m.admission_for("j", r.s["j"]) is None
    eps = r.barrier(1, ["a", "b"])  # boundary 1 admits j; ring of step 2 is still [a, b]
    assert eps["a"].node_ids == ["a", "b"] and eps["a"].epoch_id == 1
    adm = r.m.admission_for("j", r.s["j"])
    assert adm is not None and adm.donor_id == "a" and adm.admitted_at == 1 and adm.outer_step == 2
    assert eps["a"].serve == (("j", r.m._nodes["j"].addr),) and eps["b"].serve == ()
    assert r.m.state_received("j", r.s["j"], 2, r.now)
    assert r.arrive("j", 2) is None  # j is expected at boundary 2...
    r.arrive("a", 2)
    ep = r.arrive("b", 2)
    assert ep is not None and ep.node_ids == ["a", "b", "j"] and ep.epoch_id == 2 and ep.changed  # ...and in it
    assert r.m.status(r.now)["joiners"] == []


def test_a_joiner_admitted_again_gets_the_next_donor() -> None:
    """Donors rotate over the run's admissions: a joiner whose transfer failed is admitted at
    the next boundary from another member, so one slow or lying donor cannot keep it out."""
    r = Run(min_nodes=2)
    r.reg("a"), r.reg("b"), r.barrier(0, ["a", "b"]), r.reg("j")
    r.barrier(1, ["a", "b"])
    assert r.m.admission_for("j", r.s["j"]).donor_id == "a"  # type: ignore[union-attr]
    assert r.m.request_admission("j", r.s["j"], r.now, requeue=True) is None  # a's transfer failed
    r.barrier(2, ["a", "b"])
    assert r.m.admission_for("j", r.s["j"]).donor_id == "b"  # type: ignore[union-attr]


def test_a_second_joiner_cannot_pin_a_joiner_to_its_donor() -> None:
    """Two joiners admitted at every boundary of a two-member run would put each back on the same
    donor by the run's counter alone; a joiner's own past donors are skipped."""
    r = Run(min_nodes=2)
    r.reg("a"), r.reg("b"), r.barrier(0, ["a", "b"]), r.reg("j1"), r.reg("j2")
    r.barrier(1, ["a", "b"])
    assert [r.m.admission_for(n, r.s[n]).donor_id for n in ("j1", "j2")] == ["a", "b"]  # type: ignore[union-attr]
    for n in ("j1", "j2"):
        assert r.m.request_admission(n, r.s[n], r.now, requeue=True) is None
    r.barrier(2, ["a", "b"])
    assert [r.m.admission_for(n, r.s[n]).donor_id for n in ("j1", "j2")] == ["b", "a"]  # type: ignore[union-attr]


def test_donor_death_requeues_joiner_with_new_donor() -> None:
    r = Run(min_nodes=2)
    r.reg("a"), r.reg("b"), r.barrier(0, ["a", "b"]), r.reg("j")
    r.barrier(1, ["a", "b"])
    assert r.m.admission_for("j", r.s["j"]).donor_id == "a"  # type: ignore[union-attr]
    r.m.disconnect("a", r.s["a"], r.now)  # donor dies before j has the state
    assert r.m.admission_for("j", r.s["j"]) is None
    # the transfer had in fact finished before the donor died: j keeps its place at boundary 2
    assert r.m.state_received("j", r.s["j"], 2, r.now)
    assert r.arrive("j", 2) is None and r.arrive("b", 2).node_ids == ["b", "j"]  # type: ignore[union-attr]
    r2 = Run(min_nodes=2)
    r2.reg("a"), r2.reg("b"), r2.barrier(0, ["a", "b"]), r2.reg("j")
    r2.barrier(1, ["a", "b"])
    r2.m.disconnect("a", r2.s["a"], r2.now)
    assert r2.m.request_admission("j", r2.s["j"], r2.now, requeue=True) is None
    ep = r2.arrive("b", 1, retry_of=1)  # b's all-reduce failed too: the retry barrier re-admits j
    assert ep is not None and ep.node_ids == ["b"] and ep.epoch_id == 2 and ep.serve == (("j", r2.m._nodes["j"].addr),)
    assert r2.m.admission_for("j", r2.s["j"]).donor_id == "b"  # type: ignore[union-attr]


def test_eviction_by_disconnect_heartbeat_and_boundary_deadline() -> None:
    r = Run(min_nodes=4, heartbeat_timeout=5.0, boundary_timeout=30.0)
    for n in "abcd":
        r.reg(n)
    r.barrier(0, list("abcd"))
    r.arrive("a", 1)
    r.m.disconnect("b", r.s["b"], r.now)  # connection lost: evicted at once
    r.silent = {"c"}
    r.tick(6.0)  # c: no heartbeat for 6 s
    assert set(r.m._nodes) == {"a", "d"} and r.result("a") is None
    r.tick(20.0)
    assert r.result("a") is None  # d alive but not at the barrier; deadline is 30 s after a's arrival
    r.tick(10.0)
    ep = r.result("a")
    assert ep is not None and ep.node_ids == ["a"] and ep.epoch_id == 2
    reasons = {e["node_id"]: e["reason"] for e in r.m.status(r.now)["evictions"]}
    assert reasons["b"] == "connection lost" and "no heartbeat" in reasons["c"] and "missed boundary 1" in reasons["d"]
    with pytest.raises(Evicted, match="missed boundary"):
        r.arrive("d", 1)
    events = " ".join(r.m.drain_events())
    assert "epoch 2: members [a] at boundary 1 (evicted b: connection lost; evicted c" in events


def test_a_founder_registering_past_the_boundary_deadline_has_its_own_time_to_sync() -> None:
    """b waits at boundary 0 for a second founder (min_nodes 2); a registers 45 s later, past
    b's 30 s deadline (under load its start took that long). It is not evicted before it could
    sync, and the run starts with both. Before, each registration of a was evicted at the
    next tick, so a registered again, forever, and the run never started."""
    r = Run(min_nodes=2, boundary_timeout=30.0)
    r.reg("b")
    assert r.arrive("b", 0) is None
    r.tick(45.0)
    assert r.result("b") is None and set(r.m._nodes) == {"b"}  # nobody to evict, nobody to start with
    assert r.reg("a").member
    r.tick(0.5)
    assert set(r.m._nodes) == {"a", "b"}
    ep = r.arrive("a", 0)
    assert ep is not None and ep.node_ids == ["a", "b"] and r.result("b") is not None
    # ... but its time is its own: a late founder that never syncs is evicted boundary_timeout after it came
    r2 = Run(min_nodes=2, boundary_timeout=30.0)
    r2.reg("b"), r2.arrive("b", 0), r2.tick(45.0), r2.reg("a")
    r2.tick(29.0)
    assert set(r2.m._nodes) == {"a", "b"}
    r2.tick(2.0)
    assert set(r2.m._nodes) == {"b"}
    reasons = {e["node_id"]: e["reason"] for e in r2.m.status(r2.now)["evictions"]}
    assert reasons["a"] == "missed boundary 0 (30s after the first arrival or since it became a member)", reasons


def test_founders_that_come_back_in_turn_cannot_hold_the_first_barrier() -> None:
    """b and c wait at boundary 0; founders x (at 10 s) and y (at 35 s) registered and never sync,
    and each registers again as soon as it is evicted. A member's time at a barrier counts from
    its first registration there: both are out by 65 s and the run starts with b and c. (Had each
    registration brought a fresh 30 s, one of the two would always be inside its window.)"""
    r = Run(min_nodes=2, boundary_timeout=30.0)
    r.reg("b"), r.arrive("b", 0)
    r.tick(10.0), r.reg("x")
    r.tick(10.0), r.reg("c"), r.arrive("c", 0)
    r.tick(15.0), r.reg("y")
    while r.now < 200.0 and r.result("b") is None:
        r.tick(0.5)
        for n in ("x", "y"):
            if n not in r.m._nodes:
                r.reg(n)
    assert r.result("b") is not None and r.result("b").node_ids == ["b", "c"], r.now  # type: ignore[union-attr]
    assert r.now <= 66.0, r.now


def test_retry_after_failed_all_reduce_gives_new_epoch_without_dead_node() -> None:
    r = Run(min_nodes=3)
    for n in "abc":
        r.reg(n)
    e1 = r.barrier(0, list("abc"))["a"]
    assert r.arrive("a", 0, retry_of=e1.epoch_id) is None  # a's ring failed (c died mid-reduction)
    assert r.arrive("b", 0, retry_of=e1.epoch_id) is None  # c still looks alive: wait for it
    r.m.disconnect("c", r.s["c"], r.now)
    ep = r.result("a")
    assert ep is not None and ep.epoch_id == 2 and ep.node_ids == ["a", "b"] and ep.outer_step == 0
    # a re-issued retry of the old epoch returns the new one (idempotent)
    assert r.arrive("b", 0, retry_of=1) == r.result("b")
    # retry with unchanged membership (transient failure) still gets a fresh epoch id
    r.arrive("a", 0, retry_of=2)
    assert r.arrive("b", 0, retry_of=2).epoch_id == 3  # type: ignore[union-attr]


def test_partial_success_evicts_the_node_that_failed() -> None:
    r = Run(min_nodes=3)
    for n in "abc":
        r.reg(n)
    r.barrier(0, list("abc"))
    r.arrive("a", 0, retry_of=1)  # a's all-reduce failed...
    assert r.arrive("b", 1) is None  # ...but b's completed: a is behind
    with pytest.raises(Evicted, match="behind"):
        r.m.epoch_for("a", r.s["a"])
    assert r.arrive("c", 1).node_ids == ["b", "c"]  # type: ignore[union-attr]


def test_graceful_leave() -> None:
    r = Run(min_nodes=2)
    r.reg("a"), r.reg("b")
    r.barrier(0, ["a", "b"])
    r.arrive("a", 1)
    r.m.leave("b", r.s["b"], r.now)
    ep = r.result("a")
    assert ep is not None and ep.node_ids == ["a"] and ep.epoch_id == 2
    assert r.m.status(r.now)["evictions"][-1] | {"time": 0} == {
        "node_id": "b", "reason": "left", "outer_step": 1, "time": 0, "graceful": True}


def test_refusals_fingerprint_protocol_duplicate_invalid() -> None:
    r = Run(min_nodes=2)
    r.reg("a")
    with pytest.raises(RegistrationRefused, match="model config fingerprint abc != run's " + FP):
        r.reg("x", fp="abc")
    with pytest.raises(RegistrationRefused, match=f"protocol version {PROTOCOL + 1} != coordinator's {PROTOCOL}"):
        r.reg("y", protocol=PROTOCOL + 1)
    with pytest.raises(RegistrationRefused, match="node id 'a' is already registered") as ei:
        r.reg("a")
    assert ei.value.reason == "duplicate"
    for node, addr in (("", "10.0.0.9:7000"), ("n" * 129, "10.0.0.9:7000"), ("z", ""), ("z", "h:1 x"),
                       ("z", "h" * 252 + ":7000")):
        with pytest.raises(RegistrationRefused, match="invalid node id") as ei:
            r.m.register(node, addr, 8, PROTOCOL, FP, r.now, None, True)
        assert ei.value.reason == "invalid"
    r.reg("b")
    assert r.barrier(0, ["a", "b"])["a"].node_ids == ["a", "b"]  # the run is unaffected
    preset = Membership(CoordinatorConfig(fingerprint="def"))
    with pytest.raises(RegistrationRefused, match="fingerprint abc != run's def"):
        preset.register("a", "h:1", 1, PROTOCOL, "abc", 0.0)


def test_diverged_member_evicted_majority_hash_recorded() -> None:
    r = Run(min_nodes=3)
    for n in "abc":
        r.reg(n)
    r.arrive("a", 0, "h1"), r.arrive("b", 0, "h1")
    assert r.arrive("c", 0, "h2") is None  # c's state differs from the majority's: not in the epoch
    with pytest.raises(Evicted, match="diverged: state hash h2 at outer step 0, the run's is h1"):
        r.result("c")
    ep = r.result("a")
    assert ep is not None and ep.node_ids == ["a", "b"]
    assert ep.hash_mismatch == (("a", "h1"), ("b", "h1"), ("c", "h2"))
    assert "state hash mismatch at outer step 0: a=h1, b=h1, c=h2" in " ".join(r.m.drain_events())
    rec = r.m.status(r.now)["hashes"]["0"]
    assert rec["hashes"] == {"a": "h1", "b": "h1", "c": "h2"} and rec["mismatch"]
    assert r.m.record.hashes[0] == "h1" and r.m.record.hwm_step == 0
    # the recorded hash wins over a later majority: at a retry barrier of step 0 both remaining
    # members claiming h3 are evicted
    r.arrive("a", 0, "h3", retry_of=ep.epoch_id)
    assert r.arrive("b", 0, "h3", retry_of=ep.epoch_id) is None
    assert not r.m.started  # nobody holds the recorded state any more: rebuild from checkpoints


def test_rebuild_after_restart_keeps_epochs_monotonic_and_outer_step() -> None:
    old = Run(min_nodes=3)
    for n in "abc":
        old.reg(n)
    for k in range(3):
        old.barrier(k, list("abc"), f"h{k}")
    old.arrive("a", 3, "h3")
    old.m.leave("c", old.s["c"], old.now)
    assert old.m.epoch_id == 1
    old.arrive("b", 3, "h3")  # epoch 2 = [a, b] at boundary 3
    assert old.m.epoch_id == 2 and old.m.record.hwm_step == 3
    # the coordinator dies; a new one (another instance) reloads the journal and hears from the nodes
    r = Run(min_nodes=3, join_window=1.0, record=RunRecord.from_json(old.m.record.to_json()))
    r.m.instance = "i2"
    with pytest.raises(StaleSession):
        r.m.arrive("a", old.s["a"], 4, 0.0)
    assert r.reg("b", resume=Resume(3, 2, 1, "h3")).member  # b is mid-step 4 (last synced at 3)
    forked = r.reg("f", resume=Resume(3, 1, 0, "hX"))  # other bytes for a recorded step
    assert not forked.member and "diverged: state hash hX at outer step 3, the run's is h3" in forked.note
    stale = r.reg("s", resume=Resume(2, 1, 0, "h2"))  # restarted from an older checkpoint: behind the journal
    assert not stale.member and "behind: state from outer step 2, the run has reached 3" in stale.note
    assert r.reg("a", resume=Resume(4, 2, 0, "h4")).outer_step == 4  # a already waits at boundary 4
    assert r.reg("n").member is False  # a brand-new node joins; it does not found a new run
    r.arrive("a", 4, "h4")
    assert r.result("a") is None  # b not arrived yet, join window open
    r.arrive("b", 4, "h4")
    r.tick(1.1)
    ep = r.result("a")
    assert ep is not None and ep.epoch_id == 3 and ep.outer_step == 4 and ep.node_ids == ["a", "b"]
    assert r.m.admission_for("n", r.s["n"]).outer_step == 5  # type: ignore[union-attr]
    late = r.reg("c", resume=Resume(3, 2, 0, "h3"))  # late resume after the run continued: joins
    assert not late.member and "in progress" in late.note


def test_a_claim_ahead_of_the_journal_joins_and_evicts_nobody() -> None:
    """A restarted coordinator with its journal takes no claim past the step after its newest
    recorded one, nor an epoch it never made: such a node joins, and the members waiting at
    the real boundary stay (an unsigned claim of outer step 10**6 with a huge epoch used to
    evict them as behind and record the claimant's hash alone)."""
    old = Run(min_nodes=2)
    old.reg("a"), old.reg("b")
    for k in range(3):
        old.barrier(k, ["a", "b"], f"h{k}")
    assert old.m.record.hwm_step == 2
    r = Run(min_nodes=2, join_window=1.0, record=RunRecord.from_json(old.m.record.to_json()))
    r.m.instance = "i2"
    assert r.reg("a", resume=Resume(3, 1, 0, "h3")).member  # computed step 3, not yet recorded
    r.arrive("a", 3, "h3")
    far = r.reg("evil", resume=Resume(10**6, 1, 0, "x", ("evil",)))
    assert not far.member and "ahead of the run's journal: state from outer step 1000000" in far.note
    epoch = r.reg("evil2", resume=Resume(3, 2**53, 0, "h3", ("evil2",)))
    assert not epoch.member and "ahead of the run's journal: epoch" in epoch.note
    assert r.m.record.next_epoch < 10 and r.m.status(r.now)["evictions"] == []
    assert r.reg("b", resume=Resume(3, 1, 1, "h3")).member
    r.arrive("b", 3, "h3")
    r.tick(1.1)
    ep = r.result("a")
    assert ep is not None and ep.outer_step == 3 and ep.node_ids == ["a", "b"] and r.m.record.hashes[3] == "h3"


def test_rebuild_evicts_nodes_behind_and_demotes_fresh_founders() -> None:
    r = Run(min_nodes=3, join_window=1.0)
    r.reg("fresh"), r.reg("fresh2")  # registered first, as if the run were new
    r.arrive("fresh", 0), r.arrive("fresh2", 0)
    r.tick(1.5)  # join window over, but only 2 of 3 founders
    r.reg("a", resume=Resume(6, 5))
    for n in ("fresh", "fresh2"):
        with pytest.raises(Evicted, match="nodes without state join"):
            r.m.heartbeat(n, r.s[n], r.now)
    assert not r.m.started  # demoting the fresh founders completed no barrier
    r.reg("b", resume=Resume(6, 5, 1))
    c = r.reg("c", resume=Resume(5, 5, 2))
    assert not c.member and "behind: state from outer step 5, the run has reached 6" in c.note
    r.arrive("b", 6)  # b's all-reduce of step 7 failed...
    ep = r.arrive("a", 7)  # ...but a's completed: b is behind
    with pytest.raises(Evicted, match="behind: at outer step 6, the run resumes at 7"):
        r.m.epoch_for("b", r.s["b"])
    assert ep is not None and ep.epoch_id == 6 and ep.outer_step == 7 and ep.node_ids == ["a"]


def test_completed_run_stays_completed_and_admits_no_joiner_for_the_last_step() -> None:
    r = Run(min_nodes=2, outer_steps=3)
    r.reg("a"), r.reg("b")
    for k in range(2):
        r.barrier(k, ["a", "b"], f"h{k}")
    r.reg("j")
    r.barrier(2, ["a", "b"], "h2")  # boundary 2 = the last step's: nobody is admitted for it
    assert r.m.admission_for("j", r.s["j"]) is None
    r.barrier(3, ["a", "b"], "h3")  # the final barrier completes the run
    assert r.m.record.completed and r.m.record.hwm_step == 3
    with pytest.raises(RunCompleted):
        r.m.admission_for("j", r.s["j"])  # the waiting joiner learns it
    for n in ("a", "b"):
        r.m.leave(n, r.s[n], r.now)
    assert "no live node holds" not in " ".join(r.m.drain_events())
    with pytest.raises(RunCompleted, match="all 3 outer steps are done"):
        r.reg("late", resume=Resume(1, 1, 0, "h1"))
    # ... also after a restart that reloads the journal
    r2 = Membership(CoordinatorConfig(), "i2", RunRecord.from_json(r.m.record.to_json()))
    with pytest.raises(RunCompleted):
        r2.register("x", "h:1", 1, PROTOCOL, FP, 0.0)
    with pytest.raises(RegistrationRefused, match="run length 5 outer steps != run's 3"):
        r2.register("y", "h:1", 1, PROTOCOL, FP, 0.0, outer_steps=5)


def test_rollback_only_when_the_operator_allows_it() -> None:
    r = Run(min_nodes=1)
    r.reg("a")
    for k in range(4):
        r.barrier(k, ["a"], f"h{k}")
    rec = RunRecord.from_json(r.m.record.to_json())  # the newest state (step 3) is then lost for good
    strict = Run(record=RunRecord.from_json(rec.to_json()))
    assert "behind" in strict.reg("a", resume=Resume(1, 0, 0, "h1")).note  # waits for step 3's state
    ok = Run(allow_rollback_to=1, record=RunRecord.from_json(rec.to_json()))
    assert ok.reg("a", resume=Resume(1, 0, 0, "h1")).member
    ep = ok.barrier(1, ["a"], "h1")["a"]
    assert ep.outer_step == 1
    assert ok.m.record.hwm_step == 1 and 2 not in ok.m.record.hashes and ok.m.record.rollbacks == [
        {"from": 3, "to": 1, "by": "operator: allow_rollback_to=1"}]
    assert "rolled the run back from outer step 3 to 1" in " ".join(ok.m.drain_events())
    wrong = Run(allow_rollback_to=1, record=RunRecord.from_json(rec.to_json()))
    assert "diverged" in wrong.reg("b", resume=Resume(1, 0, 0, "hX")).note  # recorded hashes still hold


def test_journal_file_atomic_and_reloaded(tmp_path: Path) -> None:
    j = Journal(tmp_path / "run.journal")
    rec = j.load("run-1")
    rec.record(0, "h0", keep=10)
    rec.record(1, "h1", keep=10)
    assert j.save(rec) and not j.save(rec)  # unchanged: not rewritten
    assert [p.name for p in tmp_path.iterdir()] == ["run.journal"]  # no temporary file left behind
    back = Journal(tmp_path / "run.journal").load("run-1")
    assert (back.hwm_step, back.hwm_hash, back.hashes) == (1, "h1", {0: "h0", 1: "h1"})
    with pytest.raises(JournalError, match="belongs to run 'run-1'"):
        Journal(tmp_path / "run.journal").load("other")
    (tmp_path / "bad.journal").write_text("{not json")
    with pytest.raises(JournalError, match="unreadable"):
        Journal(tmp_path / "bad.journal").load("run-1")


# ---------------------------------------------------------------------------------------------
# server + client over real sockets (127.0.0.1, port 0)
# ---------------------------------------------------------------------------------------------
def _waiting(status: dict[str, Any], k: int) -> set[str]:
    return {n["node_id"] for n in status["nodes"] if n["waiting_at"] == k}


def test_three_clients_barrier_together_and_status(coordinator) -> None:
    coord = coordinator()
    clients = [_client(coord.address, n, 9000 + i) for i, n in enumerate("abc")]
    try:
        assert all(c.register().member for c in clients)
        with ThreadPoolExecutor(3) as ex:
            eps = list(ex.map(lambda c: c.sync(0, state_hash="h0"), clients))
            assert [e.epoch_id for e in eps] == [1, 1, 1] and [e.rank for e in eps] == [0, 1, 2]
            assert eps[0].addresses == ["127.0.0.1:9000", "127.0.0.1:9001", "127.0.0.1:9002"]
            eps = list(ex.map(lambda c: c.sync(1, state_hash="h1"), clients))
        assert [e.epoch_id for e in eps] == [1, 1, 1] and not eps[0].changed
        st = coordinator_status(coord.address, _tcfg())
        assert st["epoch"]["members"] == [["a", "127.0.0.1:9000"], ["b", "127.0.0.1:9001"],
                                          ["c", "127.0.0.1:9002"]]
        assert st["outer_step"] == 2 and st["hashes"]["1"]["hashes"] == {"a": "h1", "b": "h1", "c": "h1"}
        assert clients[0].status()["nodes"][0]["devices"] == 2
    finally:
        for c in clients:
            c.close()


def test_foreign_certificate_rejected_before_registration(coordinator, tmp_path) -> None:
    coord = coordinator()
    Authority.init(tmp_path, "coord-test").issue("mallory")  # a certificate of another run's authority
    foreign = TransportConfig("coord-test", Credentials.load(tmp_path, "mallory"), connect_timeout=5.0)
    bad = _client(coord.address, "mallory", 9100, transport=foreign)
    with pytest.raises(RegistrationRefused, match="no authenticated connection between coordinator .* and node mallory: .*certificate not of this run") as ei:
        bad.register()
    assert ei.value.reason == "auth"
    bad.close()
    assert coord.status()["nodes"] == []
    assert coordinator_status(coord.address, _tcfg())["nodes"] == []


def test_fingerprint_mismatch_refused_run_unaffected(coordinator) -> None:
    coord = coordinator(min_nodes=2)
    a, b = _client(coord.address, "a", 9000), _client(coord.address, "b", 9001)
    bad = _client(coord.address, "x", 9002, fp="fp-other")
    try:
        a.register(), b.register()
        with ThreadPoolExecutor(2) as ex:
            fa = ex.submit(a.sync, 0)
            _wait_for(lambda: _waiting(coord.status(), 0) == {"a"}, what="a at the barrier")
            with pytest.raises(RegistrationRefused, match=f"model config fingerprint fp-other != run's {FP}"):
                bad.register()
            fb = ex.submit(b.sync, 0)
            assert fa.result(10).node_ids == ["a", "b"] == fb.result(10).node_ids
        assert [n["node_id"] for n in coord.status()["nodes"]] == ["a", "b"]
    finally:
        for c in (a, b, bad):
            c.close()


def test_a_heartbeat_under_way_as_its_node_leaves_does_not_register_it_again(coordinator) -> None:
    """A heartbeat that took the session's connection just before its node left fails on the
    connection the leave closed; it must not take that for a lost coordinator and register the
    node again (it then showed up once more and was evicted as "connection lost" when the client
    closed: the flake of ``test_joiner_admission_serve_and_leave_over_sockets`` under load)."""
    coord = coordinator(min_nodes=1)
    b = _client(coord.address, "b", 9001)
    took, left = threading.Event(), threading.Event()
    beat = b._beat

    def slow_beat(conn: Any) -> None:  # (the beat holds its connection until the leave is done)
        took.set()
        left.wait(10)
        beat(conn)

    try:
        b.register()
        b._beat = slow_beat
        assert took.wait(10)
        b.leave()
        left.set()
        time.sleep(1.0)  # (several heartbeat intervals: a re-registration would be done by now)
        assert [n["node_id"] for n in coord.status()["nodes"]] == [], coord.status()["nodes"]
        assert [e["reason"] for e in coord.status()["evictions"]] == ["left"], coord.status()["evictions"]
    finally:
        left.set()
        b.close()


def test_joiner_admission_serve_and_leave_over_sockets(coordinator) -> None:
    coord = coordinator(min_nodes=2)
    said: list[str] = []  # b's warnings: a leave it could not deliver is one
    a, b, j = (_client(coord.address, n, 9000 + i, **({"say": said.append} if n == "b" else {}))
               for i, n in enumerate("abj"))
    try:
        a.register(), b.register()
        with ThreadPoolExecutor(3) as ex:
            fa, fb = ex.submit(a.sync, 0), ex.submit(b.sync, 0)
            assert fa.result(10).epoch_id == fb.result(10).epoch_id == 1
            reply = j.register(Resume(7, state_hash="h7"))  # its own checkpoint: the running run makes it join
            assert not reply.member and reply.outer_step == 1 and reply.epoch_id == 1 and "in progress" in reply.note
            fj = ex.submit(j.wait_admission)
            time.sleep(0.3)
            assert not fj.done()  # admitted only at a boundary
            fa, fb = ex.submit(a.sync, 1), ex.submit(b.sync, 1)
            ea, eb, adm = fa.result(10), fb.result(10), fj.result(10)
            assert ea.node_ids == ["a", "b"] and ea.serve == (("j", "127.0.0.1:9002"),) and eb.serve == ()
            assert (adm.donor_id, adm.donor_addr, adm.admitted_at, adm.outer_step) == ("a", "127.0.0.1:9000", 1, 2)
            assert j.state_received(2)
            eps = [f.result(10) for f in [ex.submit(c.sync, 2) for c in (a, b, j)]]
            assert {e.epoch_id for e in eps} == {2} and eps[2].node_ids == ["a", "b", "j"] and eps[2].rank == 2
            b.leave()
            eps = [f.result(10) for f in [ex.submit(c.sync, 3) for c in (a, j)]]
            assert eps[0].epoch_id == 3 and eps[0].node_ids == ["a", "j"]
        # b left gracefully, unless its leave could not be delivered (a loaded machine: the client
        # then says so and closes its session, which removes it too). A "connection lost" after
        # "left" was a heartbeat under way that registered b again (fixed: the test above)
        evictions = coord.status()["evictions"]
        assert evictions[-1]["reason"] == "left" or any("could not tell" in w for w in said), (evictions, said)
        assert evictions[-1]["node_id"] == "b", evictions
    finally:
        for c in (a, b, j):
            c.close()


def test_stalled_node_evicted_then_rejoins_as_joiner(coordinator) -> None:
    coord = coordinator(min_nodes=2, heartbeat_timeout=0.6)
    a = _client(coord.address, "a", 9000, heartbeat_interval=60.0)  # its heartbeats stall
    b = _client(coord.address, "b", 9001)
    try:
        a.register(), b.register()
        with ThreadPoolExecutor(2) as ex:
            assert {f.result(10).epoch_id for f in [ex.submit(c.sync, 0, "h0") for c in (a, b)]} == {1}
        _wait_for(lambda: [n["node_id"] for n in coord.status()["nodes"]] == ["b"],
                  what="eviction by heartbeat timeout")
        with pytest.raises(Evicted, match="node a was evicted \\(no heartbeat for"):
            a.sync(1, "h1")
        assert not a.member
        reply = a.register()  # b holds the run's state: a re-registers as a joiner
        assert not reply.member and "in progress" in reply.note
    finally:
        a.close(), b.close()


def test_lone_member_evicted_resumes_with_its_own_state(coordinator) -> None:
    """If the evicted node was the only one holding the run's newest state, it resumes with it."""
    coord = coordinator(min_nodes=1, heartbeat_timeout=0.6)
    a = _client(coord.address, "a", 9000, heartbeat_interval=60.0)
    try:
        assert a.register().member and a.sync(0, "h0").epoch_id == 1
        a.hold(1, "h1")  # applied outer step 1
        _wait_for(lambda: not coord.status()["nodes"], what="eviction by heartbeat timeout")
        with pytest.raises(Evicted):
            a.sync(1, "h1")
        assert a.register().member  # its claim (1, h1) is the newest state there is
        assert a.sync(1, "h1").outer_step == 1
        assert coord.status()["high_water_mark"] == {"outer_step": 1, "hash": "h1"}
    finally:
        a.close()


def test_quiet_session_judged_by_heartbeat_timeout_not_io_timeout() -> None:
    cfg = _tcfg(io_timeout=0.2)  # shorter than the heartbeat gap
    with Coordinator(cfg, config=_conf(min_nodes=1, heartbeat_timeout=2.0)) as coord:
        a = _client(coord.address, "a", 9000, heartbeat_interval=0.7)
        try:
            a.register()
            time.sleep(1.5)
            assert [n["node_id"] for n in coord.status()["nodes"]] == ["a"] and coord.status()["evictions"] == []
        finally:
            a.close()


def _restart_mid_barrier(start: Any, kill: Any) -> None:
    """3 members, 2 of them waiting at boundary 1 and a joiner waiting for admission when the
    coordinator dies; a new one on the same port takes over from what the nodes report."""
    addr = start(0)
    clients = [_client(addr, n, 9000 + i) for i, n in enumerate("abc")]
    joiner = _client(addr, "j", 9003)
    try:
        for c in clients:
            c.register()
        with ThreadPoolExecutor(4) as ex:
            assert {f.result(10).epoch_id for f in [ex.submit(c.sync, 0, "h0") for c in clients]} == {1}
            clients[2].hold(1, "h1")  # c applied outer step 1 and trains on (what it claims if it re-registers)
            assert not joiner.register().member
            fj = ex.submit(joiner.wait_admission)
            fa, fb = ex.submit(clients[0].sync, 1, "h1"), ex.submit(clients[1].sync, 1, "h1")
            _wait_for(lambda: _waiting(coordinator_status(addr, _tcfg()), 1) == {"a", "b"}, what="a, b waiting")
            kill()
            start(addr[1])  # same port; state is rebuilt from the nodes
            ec = clients[2].sync(1, "h1")
            ea, eb, adm = fa.result(20), fb.result(20), fj.result(20)
        assert ea.epoch_id == eb.epoch_id == ec.epoch_id == 2  # > 1: epoch ids stay monotonic
        assert ea.outer_step == 1 and ea.node_ids == ["a", "b", "c"] and ec.rank == 2
        assert (adm.donor_id, adm.admitted_at, adm.outer_step) == ("a", 1, 2) and ea.serve == (("j", "127.0.0.1:9003"),)
        st = coordinator_status(addr, _tcfg())
        assert st["epoch"]["epoch_id"] == 2 and st["hashes"]["1"]["hashes"] == {"a": "h1", "b": "h1", "c": "h1"}
        assert st["evictions"] == []
    finally:
        for c in (*clients, joiner):
            c.close()


def test_coordinator_stopped_and_restarted_mid_barrier() -> None:
    coords: list[Coordinator] = []

    def start(port: int) -> Any:
        conf = _conf() if not coords else _conf(join_window=1.5)
        coords.append(Coordinator(_tcfg(), "127.0.0.1", port, conf).start())
        return coords[-1].address

    try:
        _restart_mid_barrier(start, lambda: coords[0].stop())
    finally:
        for c in coords:
            c.stop()


@pytest.mark.processes
def test_coordinator_process_sigkilled_and_restarted_mid_barrier() -> None:
    procs: list[subprocess.Popen[str]] = []

    def start(port: int) -> Any:
        extra = ["--join-window", "1.5"] if procs else ["--join-window", "0", "--min-nodes", "3"]
        p = subprocess.Popen([sys.executable, "-m", "intellect_jax.coordinator", "--host", "127.0.0.1",
                              "--port", str(port), "--run-id", "coord-test", "--heartbeat-timeout", "3", "--no-journal",
                              *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(), cwd=ROOT)
        procs.append(p)
        line = p.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("coordinator listening on"), line
        host, _, port_s = line.split()[-1].rpartition(":")
        return host, int(port_s)

    def kill() -> None:
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)

    try:
        _restart_mid_barrier(start, kill)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


VICTIM = """
import sys, time
from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.testing.identities import transport_config
cfg = transport_config("victim", "coord-test", io_timeout=5.0)
c = CoordinatorClient(sys.argv[1], cfg, "victim", "127.0.0.1:9009", fingerprint=sys.argv[2], heartbeat_interval=0.2)
c.register()
print(c.sync(0).epoch_id, flush=True)
time.sleep(600)
"""


@pytest.mark.processes
def test_sigkilled_client_evicted_at_once_survivors_get_new_epoch(coordinator) -> None:
    # heartbeat and boundary timeouts far above the test's duration: only the lost connection can evict
    coord = coordinator(heartbeat_timeout=30.0, boundary_timeout=60.0)
    host, port = coord.address
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, f"{host}:{port}", FP], stdout=subprocess.PIPE,
                              text=True, env=_env("victim"), cwd=ROOT)
    a, b = _client(coord.address, "a", 9000), _client(coord.address, "b", 9001)
    try:
        a.register(), b.register()
        with ThreadPoolExecutor(2) as ex:
            fa, fb = ex.submit(a.sync, 0), ex.submit(b.sync, 0)
            assert victim.stdout.readline().strip() == "1"  # type: ignore[union-attr]
            assert fa.result(20).node_ids == ["a", "b", "victim"]
            fb.result(1)
            fa, fb = ex.submit(a.sync, 1), ex.submit(b.sync, 1)
            _wait_for(lambda: _waiting(coord.status(), 1) == {"a", "b"}, what="a, b waiting")
            t0 = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            ea, eb = fa.result(10), fb.result(10)
            elapsed = time.monotonic() - t0
        assert ea.epoch_id == eb.epoch_id == 2 and ea.node_ids == ["a", "b"] and elapsed < 5.0
        ev = coord.status()["evictions"]
        assert [(e["node_id"], e["reason"]) for e in ev] == [("victim", "connection lost")]
    finally:
        victim.kill()
        victim.wait(10)
        a.close(), b.close()


def test_a_waiting_registration_says_each_new_cause_once_in_a_while() -> None:
    """A node that waits for its coordinator says why at once, then again whenever the cause
    changes (timeouts and ports aside), at most every 5 s: an operator sees a coordinator that
    went away, not only the first cause and the last."""
    from intellect_jax.coordinator.client import CoordinatorClient
    from intellect_jax.net import PeerClosed, PeerTimeout

    from helpers import ManualClock

    class Clock(ManualClock):
        def sleep(self, seconds: float) -> None:
            self.t += seconds

    clock, said = Clock(), []
    causes = [PeerTimeout(f"no data for {t}s while receiving a frame header") for t in (10.0, 9.5, 3.2)] + \
        [OSError("[Errno 111] Connection refused")] * 10 + [PeerClosed("coordinator closed the connection")] + \
        [PeerTimeout("no data for 10.0s while receiving a frame header")] * 2

    class Wire:
        name = "coordinator c:1"

        def open(self, msg: dict, timeout: float) -> Any:
            clock.t += 2.0
            if causes:
                raise causes.pop(0)
            return None, {"ok": False, "error": "RegistrationRefused", "message": "fingerprint x != run's y",
                          "reason": "fingerprint"}

    client = CoordinatorClient(None, None, "a", "h:1", fingerprint=FP, wire=Wire(), clock=clock,  # type: ignore[arg-type]
                               say=said.append, register_timeout=600.0)
    with pytest.raises(RegistrationRefused, match="fingerprint"):
        client.register()
    assert [s.split("(")[1].split(")")[0] for s in said] == [
        "no data for 10.0s while receiving a frame header", "[Errno 111] Connection refused",
        "coordinator closed the connection", "no data for 10.0s while receiving a frame header"], said
    assert "retrying for up to 600s" in said[0] and all(s.startswith("node a: still waiting for coordinator c:1 after ")
                                                       for s in said[1:]), said


def test_a_session_replaced_by_a_newer_registration_is_stale_not_evicted() -> None:
    """A client re-registers (its connection broke) while one of its requests still carries the
    session it replaced: that request is told its session is stale, so the client re-issues it
    with the current one; before, it was told the node was evicted (the old session's
    "connection lost"), which is fatal, although the node was alive (a flake of
    test_coordinator_stopped_and_restarted_mid_barrier under load)."""
    r = Run(min_nodes=2)
    r.reg("a")
    r.reg("j")
    old = r.s["j"]
    r.m.disconnect("j", old, r.now)  # its session connection closed...
    r.reg("j")  # ... and it registered again
    with pytest.raises(StaleSession, match="replaced by its newer registration"):
        r.m.request_admission("j", old, r.now)
    r.m.request_admission("j", r.s["j"], r.now)  # the current session works
    r.m.disconnect("j", r.s["j"], r.now)
    with pytest.raises(Evicted, match="connection lost"):  # a node that is gone is still told so
        r.m.request_admission("j", old, r.now)
