"""The coordinator under its own faults: a stall it must not blame on the nodes, a restart
without its journal, the newest state lost for good, registrations that meet no coordinator,
and donors whose joiner is gone. State machine first, then real sockets and processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from intellect_jax.coordinator.server import Coordinator
from intellect_jax.coordinator.journal import MemoryJournal, RunRecord
from intellect_jax.coordinator.protocol import PROTOCOL, CoordinatorConfig, CoordinatorUnavailable, Resume
from intellect_jax.coordinator.service import CoordinatorService, ServiceStopped
from helpers import FP, ROOT, ManualClock as _ManualClock, Run, coord_client as _client, coord_config as _conf, coord_env as _env, \
    coord_transport as _tcfg, wait_for


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# state machine
# ---------------------------------------------------------------------------------------------
def test_a_stall_of_the_coordinator_moves_every_deadline() -> None:
    """Excused: the heartbeat and barrier clocks of everyone who was live. Not excused: a node
    that was silent before the stall began, nor one that stays silent after it."""
    r = Run(heartbeat_timeout=5.0, boundary_timeout=30.0)
    for n in "abc":
        r.reg(n)
    r.barrier(0, list("abc"))
    r.arrive("a", 1)  # a waits at boundary 1 (its barrier clock runs)
    r.silent.add("c")  # c stops heartbeating 4 s before the stall
    r.tick(4.0)
    r.m.extend(25.0)  # the coordinator could not act for 25 s
    r.now += 25.0
    r.m.tick(r.now)  # nobody heartbeat "during" the stall: all ages are 25 s + before
    assert [e["node_id"] for e in r.m.status(r.now)["evictions"]] == []
    r.tick(1.01)  # c: silent for 5.01 s of the coordinator's time -> evicted; a and b heartbeat
    assert [(e["node_id"], e["reason"][:15]) for e in r.m.status(r.now)["evictions"]] == [("c", "no heartbeat fo")]
    r.tick(25.0)  # a's barrier clock: 4 + 1.01 + 25 s since it arrived (the stall excused): b missed it
    assert [e["node_id"] for e in r.m.status(r.now)["evictions"]][1:] == ["b"]


def test_the_service_notices_its_own_stall_before_judging_anyone() -> None:
    clock, lines = _ManualClock(), []
    svc = CoordinatorService(CoordinatorConfig(heartbeat_timeout=5.0, tick_interval=0.1, join_window=0.0),
                             clock=clock, on_event=lines.append).start()
    for i, n in enumerate("ab"):
        reg = {"op": "register", "node": n, "addr": f"127.0.0.1:{9000 + i}", "devices": 1, "protocol": PROTOCOL,
               "fingerprint": FP, "founder": True, "resume": None}
        assert svc.handle(reg, identity=n)["ok"]
    for t in (0.1, 0.2, 0.3):  # the ticker runs every tick_interval
        clock.t = t
        svc.locked(svc.membership.tick)
    clock.t = 20.3  # 20 s without running (SIGSTOP): the next entry, whoever makes it, excuses it
    svc.locked(svc.membership.tick)
    assert svc.status()["evictions"] == [] and len(svc.stalls) == 1 and svc.stalls[0] == pytest.approx(19.9)
    assert [ln for ln in lines if "stalled" in ln] == [
        "WARNING coordinator stalled for 19.9s (it could not act): every heartbeat, barrier and admission "
        "deadline moved by as much"]
    for i in range(1, 56):  # ticks resume, but nobody heartbeats any more: evicted after 5 s as usual
        clock.t = 20.3 + 0.1 * i
        svc.locked(svc.membership.tick)
        if clock.t < 24.85:  # last heard at 0.0 + 19.9 s excused
            assert svc.status()["evictions"] == []
    assert {e["node_id"] for e in svc.status()["evictions"]} == {"a", "b"} and len(svc.stalls) == 1


def test_a_sync_whose_barrier_completes_before_it_waits_is_answered_at_once() -> None:
    """a's sync arrives, finds the barrier incomplete, and lets go of the lock; b completes the
    barrier before a waits (its wake-up reaches nobody). a is answered at once: it polls before it
    waits. Before, it slept until the next tick or keepalive (here 5 s; in a run, a tick, 0.1 s,
    which showed as a late barrier in the seeded simulation under load)."""
    import threading

    svc = CoordinatorService(CoordinatorConfig(min_nodes=2, join_window=0.0, heartbeat_timeout=60.0,
                                               tick_interval=5.0, keepalive_interval=5.0)).start()
    try:
        sess = {}
        for i, n in enumerate("ab"):
            reg = {"op": "register", "node": n, "addr": f"127.0.0.1:{9000 + i}", "devices": 1,
                   "protocol": PROTOCOL, "fingerprint": FP, "founder": True, "resume": None}
            sess[n] = svc.handle(reg, identity=n)["session"]
        locked, between, replies, at = svc.locked, threading.Event(), {}, {}

        def slow_first(fn):  # a, between its arrival and its wait
            r = locked(fn)
            if threading.current_thread().name == "a" and r is None and not between.is_set():
                between.set()
                time.sleep(0.5)
            return r

        svc.locked = slow_first  # type: ignore[method-assign]

        def sync(n: str) -> None:
            replies[n] = svc.handle({"op": "sync", "node": n, "session": sess[n], "step": 0},
                                    deadline=time.monotonic() + 30, identity=n)
            at[n] = time.monotonic()

        ta = threading.Thread(target=sync, args=("a",), name="a")
        ta.start()
        assert between.wait(10)
        t0 = time.monotonic()
        sync("b")
        ta.join(30)
        assert replies["a"]["ok"] and replies["b"]["ok"], replies
        assert at["a"] - t0 < 2.0, at["a"] - t0
    finally:
        svc.stop()


def test_a_malformed_sync_is_refused_and_the_run_goes_on() -> None:
    """A sync's state_hash and report are kept by the membership and read at every later barrier:
    a bad one is refused at once (a ProtocolError reply), and the ticker and the barrier live on."""
    clock = _ManualClock()
    svc = CoordinatorService(CoordinatorConfig(min_nodes=2, join_window=0.0, heartbeat_timeout=5.0), clock=clock).start()
    sess = {}
    for i, n in enumerate("ab"):
        reg = {"op": "register", "node": n, "addr": f"127.0.0.1:{9000 + i}", "devices": 1, "protocol": PROTOCOL,
               "fingerprint": FP, "founder": True, "resume": None}
        sess[n] = svc.handle(reg, identity=n)["session"]
    sync = {"op": "sync", "node": "a", "session": sess["a"], "step": 0}
    for bad in ({"state_hash": ["x"]}, {"state_hash": "h" * 129}, {"report": {"accused": ["b"]}},
                {"report": {"accused": "b"}}, {"report": {"avg_failed": "yes"}}, {"report": [1]},
                {"report": {"accused": ["b", 3]}}, {"report": {"more": 1}}):
        reply = svc.handle({**sync, **bad}, ("a", sess["a"]), deadline=1.0, identity="a")
        assert reply["ok"] is False and reply["error"] == "ProtocolError", (bad, reply)
    svc.locked(svc.membership.tick)  # the ticker still runs
    replies = {}

    def arrive(n: str) -> None:
        replies[n] = svc.handle({"op": "sync", "node": n, "session": sess[n], "step": 0, "state_hash": "h0",
                                 "report": {"avg_failed": False, "accused": None}}, deadline=5.0, identity=n)

    import threading

    ts = [threading.Thread(target=arrive, args=(n,)) for n in "ab"]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert all(r["ok"] and [m[0] for m in r["epoch"]["members"]] == ["a", "b"] for r in replies.values()), replies


def _lost_newest_state(**kw: Any) -> Run:
    """A run that reached outer step 3, whose every holder is gone; a, b come back with the
    checkpoints of steps 1 and 2 (c with a diverged one of step 2)."""
    first = Run(min_nodes=1)
    first.reg("a")
    for k in range(4):
        first.barrier(k, ["a"], f"h{k}")
    r = Run(record=RunRecord.from_json(first.m.record.to_json()), **kw)
    assert "behind" in r.reg("a", resume=Resume(1, 1, 0, "h1")).note
    assert "behind" in r.reg("b", resume=Resume(2, 1, 1, "h2")).note
    assert "behind" in r.reg("c", resume=Resume(2, 1, 2, "hX")).note
    return r


@pytest.mark.parametrize("liar", [None, Resume(10**6, 1, 0, "x"), Resume(3, 2**53, 0, "h3")])
def test_automatic_rollback_after_the_configured_wait(liar: Resume | None) -> None:
    """(A claim ahead of the journal, which registers as a joiner, holds no rollback back.)"""
    r = _lost_newest_state(auto_rollback_after=60.0)
    if liar is not None:
        assert "ahead of the run's journal" in r.reg("evil", resume=liar).note
    r.tick(59.0)
    assert r.m.admission_for("b", r.s["b"]) is None and not r.m.record.rollbacks  # still waiting
    r.tick(1.5)
    events = " ".join(r.m.drain_events())
    assert "no live node has held the run's newest state (outer step 3) for 60s: rolling back to outer step 2" in events
    adm = r.m.admission_for("b", r.s["b"])  # b resumes the run with its own state (its own donor)
    assert adm is not None and (adm.donor_id, adm.outer_step) == ("b", 2)
    assert r.m.admission_for("c", r.s["c"]) is None  # diverged bytes never resume anything
    ep = r.barrier(2, ["b"], "h2")["b"]
    assert ep.outer_step == 2 and ep.node_ids == ["b"]
    rec = r.m.record
    assert rec.hwm_step == 2 and 3 not in rec.hashes and rec.rollbacks[0]["from"] == 3
    assert rec.rollbacks[0]["to"] == 2 and rec.rollbacks[0]["by"].startswith("automatic: no live node held it for 60")
    assert "rolled the run back from outer step 3 to 2 (automatic" in " ".join(r.m.drain_events())
    assert r.m.admission_for("a", r.s["a"]).donor_id == "b"  # type: ignore[union-attr]  # a joins from b


def test_no_automatic_rollback_while_the_newest_state_is_registered_or_when_off() -> None:
    r = _lost_newest_state(auto_rollback_after=60.0)
    assert r.reg("d", resume=Resume(3, 1, 3, "h3")).member  # a holder of step 3 came back: waits for it
    r.tick(100.0)
    assert not r.m.record.rollbacks and "rolling back" not in " ".join(r.m.drain_events())
    off = _lost_newest_state(auto_rollback_after=None)
    off.tick(10_000.0)
    assert off.m.admission_for("b", off.s["b"]) is None and not off.m.record.rollbacks


def test_without_its_journal_a_restarted_coordinator_lets_no_stale_node_rebuild_the_run() -> None:
    """The old coordinator (no journal) had reached outer step 11 with epoch 9 = [a, b]; s was
    killed long before and restarts from its checkpoint of step 8 (epoch 5 = [s, a, b]). The
    new coordinator knows nothing. s registers first and waits at its boundary, past the join
    window: no epoch of one forms; a and b come back, s is behind, the run goes on from 11."""
    r = Run(join_window=1.0)
    assert r.reg("s", resume=Resume(8, 5, 0, "h8", ("s", "a", "b"))).member
    r.arrive("s", 8, "h8")
    r.tick(5.0)
    assert r.result("s") is None and not r.m.started
    assert "history is unknown" in " ".join(r.m.drain_events())
    assert r.reg("a", resume=Resume(11, 9, 0, "h11", ("a", "b"))).member
    with pytest.raises(Exception, match="behind: at outer step 8, the run resumes at 11"):
        r.result("s")
    assert r.reg("b", resume=Resume(11, 9, 1, "h11", ("a", "b"))).member
    r.arrive("a", 11, "h11")
    ep = r.arrive("b", 11, "h11")
    assert ep is not None and ep.outer_step == 11 and ep.epoch_id == 10 and ep.node_ids == ["a", "b"]
    assert r.m.record.hwm_step == 11 and 8 not in r.m.record.hashes
    late = r.reg("s", resume=Resume(8, 5, 0, "h8", ("s", "a", "b")))
    assert not late.member


def test_without_its_journal_and_without_a_quorum_it_waits_then_goes_on() -> None:
    r = Run(join_window=1.0, auto_rollback_after=30.0)
    r.reg("a", resume=Resume(11, 9, 0, "h11", ("a", "b", "c")))
    r.arrive("a", 11, "h11")
    r.tick(10.0)
    assert r.result("a") is None  # 1 of 3: no quorum
    r.tick(25.0)
    ep = r.result("a")
    assert ep is not None and ep.outer_step == 11 and ep.node_ids == ["a"]
    assert "only 1 of epoch 9's 3 members came back" in " ".join(r.m.drain_events())


class _FillingDisk(MemoryJournal):
    """A journal whose disk is full from when ``full`` is set."""

    full = False

    def save(self, rec: RunRecord) -> bool:
        if self.full and rec.key() != self._saved:
            raise OSError(28, "No space left on device")
        return super().save(rec)


def _journaled(disk: MemoryJournal, nodes: str, resume: dict[str, Any] | None = None
               ) -> tuple[CoordinatorService, dict[str, str]]:
    """A service on ``disk`` with ``nodes`` registered (founders, or resuming ``resume``)."""
    conf = CoordinatorConfig(min_nodes=len(nodes), join_window=0.0, heartbeat_timeout=60.0, keepalive_interval=0.01)
    svc = CoordinatorService(conf, run_id="r", journal=disk).start()
    sess = {}
    for i, n in enumerate(nodes):
        reg = {"op": "register", "node": n, "addr": f"127.0.0.1:{9000 + i}", "devices": 1, "protocol": PROTOCOL,
               "fingerprint": FP, "founder": resume is None, "resume": None if resume is None else {**resume, "rank": i}}
        reply = svc.handle(reg, identity=n)
        assert reply["ok"] and reply["member"], reply
        sess[n] = reply["session"]
    return svc, sess


def _syncs(svc: CoordinatorService, sess: dict[str, str], step: int, hashes: dict[str, str] | None = None,
           first: str | None = None) -> dict[str, Any]:
    """Every node of ``sess`` syncs at ``step`` (hash ``h<step>`` unless ``hashes`` says); what
    each request ended with (``first``: that node's sync is in before the others start)."""
    got: dict[str, Any] = {}

    def go(n: str) -> None:
        try:
            got[n] = svc.handle({"op": "sync", "node": n, "session": sess[n], "step": step,
                                 "state_hash": (hashes or {}).get(n, f"h{step}")},
                                deadline=time.monotonic() + 10.0, identity=n)
        except Exception as e:  # noqa: BLE001 - what each node's request ended with
            got[n] = e

    with ThreadPoolExecutor(len(sess)) as ex:
        early = ex.submit(go, first) if first else None
        if early is not None:
            wait_for(lambda: svc.status()["nodes"][list(sess).index(first)]["waiting_at"] == step)
        list(ex.map(go, [n for n in sess if n != first]))
        if early is not None:
            early.result(15)
    return got


def test_a_journal_that_cannot_be_saved_stops_the_coordinator_before_anyone_hears_of_the_step() -> None:
    """The disk fills up as the barrier of outer step 1 completes: no node is told of step 1
    (both syncs end with ServiceStopped, naming the journal), the journal stays at step 0, and
    a coordinator restarted on it takes the nodes' claims of step 1, the step after its newest,
    instead of refusing them as ahead of the run."""
    disk = _FillingDisk()
    svc, sess = _journaled(disk, "ab")
    first = _syncs(svc, sess, 0)
    assert all(r["ok"] for r in first.values()), first
    disk.full = True
    second = _syncs(svc, sess, 1)
    assert all(isinstance(r, ServiceStopped) for r in second.values()), second
    assert all("No space left on device" in str(r) for r in second.values()) and "journal" in str(svc.failure)
    assert RunRecord.from_json(disk._stored).hwm_step == 0
    with pytest.raises(ServiceStopped):
        svc.handle({"op": "status"}, identity="a")
    disk.full = False  # the operator frees the disk and restarts the coordinator on its journal
    ep = first["a"]["epoch"]
    svc2, sess2 = _journaled(disk, "ab", {"outer_step": 1, "epoch_id": ep["epoch_id"], "state_hash": "h1",
                                          "members": [m[0] for m in ep["members"]]})
    try:
        third = _syncs(svc2, sess2, 1)
        assert all(r["ok"] and r["epoch"]["outer_step"] == 1 for r in third.values()), third
        assert RunRecord.from_json(disk._stored).hwm_step == 1 and svc2.failure is None
    finally:
        svc2.stop()


def test_a_waiter_is_not_told_of_its_eviction_by_a_barrier_that_was_not_saved() -> None:
    """a waits at step 1 with a hash of its own; b and c complete the barrier with the run's,
    which would evict a as diverged, and the save fails: a hears ServiceStopped, not that."""
    disk = _FillingDisk()
    svc, sess = _journaled(disk, "abc")
    assert all(r["ok"] for r in _syncs(svc, sess, 0).values())
    disk.full = True
    got = _syncs(svc, sess, 1, {"a": "BAD"}, first="a")
    assert all(isinstance(r, ServiceStopped) for r in got.values()), got
    assert RunRecord.from_json(disk._stored).hwm_step == 0


def test_heartbeat_view_lists_the_joiners_a_donor_serves() -> None:
    r = Run(min_nodes=1)
    r.reg("a")
    r.barrier(0, ["a"])
    r.reg("j")
    r.barrier(1, ["a"])
    view = r.m.heartbeat("a", r.s["a"], r.now)
    assert view["serving"] == ["j"] and view["completed"] is False
    r.m.leave("j", r.s["j"], r.now)
    assert r.m.heartbeat("a", r.s["a"], r.now)["serving"] == []


# ---------------------------------------------------------------------------------------------
# real sockets and processes
# ---------------------------------------------------------------------------------------------
def test_a_first_registration_waits_for_a_coordinator_started_later() -> None:
    port, said = _free_port(), []
    c = _client(("127.0.0.1", port), "a", 9000, say=said.append, register_timeout=30.0, connect_timeout=0.5)
    coord = None
    try:
        with ThreadPoolExecutor(1) as ex:
            f = ex.submit(c.register)
            time.sleep(2.0)
            assert not f.done() and len(said) == 1 and "waiting for coordinator 127.0.0.1" in said[0]
            coord = Coordinator(_tcfg(), "127.0.0.1", port, _conf(min_nodes=1)).start()
            assert f.result(15).member
        assert len(said) == 2 and said[1].startswith("node a: registered with coordinator") and "after waiting" in said[1]
    finally:
        c.close()
        if coord is not None:
            coord.stop()


def test_a_registration_gives_up_past_its_limit_naming_the_coordinator() -> None:
    port = _free_port()
    c = _client(("127.0.0.1", port), "a", 9000, say=lambda _: None, register_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match=f"coordinator 127.0.0.1:{port} did not answer node a's "
                                                     "registration for 1s"):
        c.register()
    assert time.monotonic() - t0 < 6.0
    c.close()


def _coordinator_process(flags: list[str], **client_kw: Any) -> tuple[subprocess.Popen, list[Any]]:
    """A coordinator process for members a and b (no join window; ``flags`` added) and their
    clients, registered (``client_kw``: the clients' settings). The caller closes the clients
    and ends the process."""
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "intellect_jax.coordinator", "--host", "127.0.0.1", "--port",
                          str(port), "--run-id", "coord-test", "--min-nodes", "2", "--join-window", "0", *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    clients: list[Any] = []
    try:
        assert p.stdout.readline().startswith("coordinator listening on")  # type: ignore[union-attr]
        clients = [_client(("127.0.0.1", port), n, 9000 + i, **client_kw) for i, n in enumerate("ab")]
        for c in clients:
            c.register()
    except BaseException:
        for c in clients:
            c.close()
        p.kill()
        p.communicate(timeout=10)
        raise
    return p, clients


@pytest.mark.processes
def test_a_sigstopped_coordinator_process_evicts_nobody() -> None:
    """The coordinator process is SIGSTOPped for 8 s (heartbeat timeout 2 s, client I/O timeout
    1 s) while one member waits at a barrier and another trains: both keep their sessions, the
    barrier completes after SIGCONT with both, and the coordinator logs its stall."""
    p, clients = _coordinator_process(["--heartbeat-timeout", "2", "--no-journal"], io_timeout=1.0,
                                      heartbeat_interval=0.3)
    try:
        with ThreadPoolExecutor(2) as ex:
            assert {f.result(10).epoch_id for f in [ex.submit(c.sync, 0, "h0") for c in clients]} == {1}
            fa = ex.submit(clients[0].sync, 1, "h1")
            time.sleep(0.5)
            p.send_signal(signal.SIGSTOP)
            time.sleep(8.0)
            p.send_signal(signal.SIGCONT)
            time.sleep(1.0)
            eb = clients[1].sync(1, "h1")
            ea = fa.result(15)
        assert ea.epoch_id == eb.epoch_id == 1 and ea.node_ids == ["a", "b"]
        st = clients[0].status()
        assert st["evictions"] == [] and [n["node_id"] for n in st["nodes"]] == ["a", "b"]
    finally:
        for c in clients:
            c.close()
        p.send_signal(signal.SIGCONT)
        p.terminate()
        err = p.communicate(timeout=10)[1]
    assert "coordinator stalled for" in err and "no heartbeat" not in err and "missed boundary" not in err, err[-2000:]


@pytest.mark.processes
def test_a_coordinator_process_whose_journal_cannot_be_saved_exits_naming_it(tmp_path) -> None:
    """The journal's directory becomes a file under a running coordinator: at the next change (the
    barrier of outer step 0 records its hash) it cannot save, tells nobody of the step, and
    exits with status 2 and one line naming the journal."""
    where = tmp_path / "gone"
    where.mkdir()
    p, clients = _coordinator_process(["--journal", str(where / "run.journal")], io_timeout=2.0,
                                      reconnect_timeout=2.0)
    try:
        (where / "run.journal").unlink()
        where.rmdir()
        where.write_text("a file where the journal's directory was")  # (root may write anywhere else)
        with ThreadPoolExecutor(2) as ex:
            for f in [ex.submit(c.sync, 0, "h0") for c in clients]:
                with pytest.raises(CoordinatorUnavailable):
                    f.result(30)
        assert p.wait(timeout=15) == 2
    finally:
        for c in clients:
            c.close()
        p.kill()
        err = p.communicate(timeout=10)[1]
    assert f"error: journal {where / 'run.journal'}: cannot be saved" in err, err[-2000:]


def test_a_donor_lets_go_of_a_joiner_that_is_gone() -> None:
    """The donor dials a joiner that never listens (it died while being admitted); once the
    coordinator no longer admits it, the donor's transfer ends within a few heartbeats, not
    at the transfer timeout. Before that, it keeps trying."""
    import numpy as np

    from intellect_jax.diloco.state import DilocoState, MomentumState
    from intellect_jax.diloco.transfer import NetTransport
    from intellect_jax.net.comm import NetNode

    w = {"w": np.ones(8, np.float32)}
    snap = DilocoState(w, MomentumState(w), {"m": np.zeros(8, np.float32)}, 2, 8)
    lines: list[str] = []
    with Coordinator(_tcfg(), config=_conf(min_nodes=1)) as coord, NetNode(_tcfg()) as net:
        a = _client(coord.address, "a", 9000)
        j = _client(coord.address, "j", _free_port())  # nothing will listen there
        try:
            a.register()
            a.sync(0, "h0")
            assert not j.register().member
            ep = a.sync(1, "h1")
            assert [n for n, _ in ep.serve] == ["j"]
            since = a.view_seq
            donor = NetTransport(net, "a", log=lines.append, watch_interval=0.1)
            done = donor.serve("j", ep.serve[0][1], snap, {"outer_step": 2, "inner_step": 8, "hash": "x"},
                               lambda: a.serving_revoked("j", since), timeout=600.0)
            assert not done.wait(1.5)  # still admitted: the donor keeps dialling
            j.close()  # the joiner is gone: its session drops, the coordinator evicts it
            t0 = time.monotonic()
            assert done.wait(5.0), lines
            assert time.monotonic() - t0 < 5.0
            assert lines and lines[-1].startswith("stopped serving j after") and "no longer admits it" in lines[-1]
        finally:
            a.close(), j.close()


def test_after_a_restart_a_ring_missing_a_member_is_reported_broken() -> None:
    """A node and the coordinator die together while the ring of epoch 3 = [a, b, c] runs: the
    restarted coordinator has no epoch, but a and b tell it theirs when they re-register. Once c
    has not come back within a heartbeat timeout, their views say epoch 3 is broken, so they
    abort the all-reduce instead of waiting out its deadline; a ring whose members all came
    back is left alone."""
    r = Run(heartbeat_timeout=5.0, join_window=30.0)
    for n in "ab":
        r.reg(n, resume=Resume(5, 3, "ab".index(n), "h5", ("a", "b", "c")))
    r.tick(1.0)
    view = r.m.heartbeat("a", r.s["a"], r.now)
    assert view["epoch_id"] == 3 and not view["epoch_broken"]  # c may still be reconnecting
    r.tick(4.5)
    assert r.m.heartbeat("a", r.s["a"], r.now)["epoch_broken"]
    r.reg("c", resume=Resume(4, state_hash="h4"))  # c's process was restarted from its checkpoint
    assert r.m.heartbeat("b", r.s["b"], r.now)["epoch_broken"]  # the process of epoch 3 is gone
    r.m.leave("c", r.s["c"], r.now)
    r.reg("c", resume=Resume(5, 3, 2, "h5", ("a", "b", "c")))  # c's live process came back
    assert not r.m.heartbeat("b", r.s["b"], r.now)["epoch_broken"]
