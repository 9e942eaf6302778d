"""The DiLoCo node under faults, in process: scripted recovery paths, then hundreds of seeded
random fault schedules (`intellect_jax.testing.sim`). Virtual time: a run of minutes takes
milliseconds, whatever the machine's load."""

from __future__ import annotations

import re
import time

import pytest


from intellect_jax.testing.clock import Hang, SimClock
from intellect_jax.diloco.parts import Outcome
from intellect_jax.testing.sim import Fault, Script, Sim, SimParams

# the seeds of each run of schedules (the CLI runs thousands): synchronous rounds 0-99 in the test
# command, 100-499 among the long tests (about 3 minutes on 2 cores); overlapped rounds 0-49
SEEDS = {"sync": range(100), "sync-long": range(100, 500), "overlap": range(50)}


def run(script: Script, **params) -> tuple[Sim, dict]:
    sim = Sim(0, SimParams(**params), script=script)
    report = sim.run()
    assert report["ok"], "\n".join(report["problems"] + report["log"][-80:])
    return sim, report


def lines(report: dict, pattern: str) -> list[tuple[float, str]]:
    out = []
    for line in report["log"]:
        if re.search(pattern, line):
            out.append((float(line.split()[0]), line))
    return out


def hashes_by_step(sim: Sim) -> dict[int, set[str]]:
    by: dict[int, set[str]] = {}
    for _, _, row in sim.rows:
        by.setdefault(row["outer_step"], set()).add(row["outer_hash"])
    return by


# ---------------------------------------------------------------------------------------------
# the virtual clock
# ---------------------------------------------------------------------------------------------
def test_sim_clock_jumps_to_deadlines_and_reports_a_hang() -> None:
    clock = SimClock()
    seen: list[tuple[str, float]] = []

    def main() -> None:
        cond = clock.Condition()

        def sleeper(i: int) -> None:
            clock.sleep(10.0 * i)
            seen.append((f"s{i}", clock.now()))

        for i in (3, 1, 2):
            clock.spawn(lambda i=i: sleeper(i), name=f"s{i}")
        with cond:
            assert not cond.wait(100.0)  # times out at t=100: nobody notifies
        seen.append(("main", clock.now()))

    t0 = time.monotonic()
    clock.spawn(main, name="main").join(10)
    assert seen == [("s1", 10.0), ("s2", 20.0), ("s3", 30.0), ("main", 100.0)]
    assert time.monotonic() - t0 < 2.0  # 100 virtual seconds, no real ones
    ev = clock.Event()
    clock.spawn(lambda: ev.wait(), name="forever").join(10)  # waits with no deadline, nobody to set it
    assert isinstance(clock.hang, Hang) and "wait forever" in str(clock.hang)
    assert [type(e) for _, e in clock.errors] == [Hang]


def test_a_thread_waiting_for_a_lock_that_a_wait_frees_runs_before_time_jumps() -> None:
    """a waits on a condition whose lock b is queued for (in real time, a held it a while): b is
    runnable from that moment, at virtual time 0. Before, a was parked before it let go of the
    lock, so for an instant every thread counted as blocked and time jumped to the next deadline
    (the ticker's, 0.1): whether b ran at 0 or at 0.1 depended on the machine's load."""
    clock, seen = SimClock(), {}
    cond = clock.Condition()

    def a() -> None:
        with cond:
            time.sleep(0.2)  # real time, holding the lock: b queues for it
            cond.wait(5.0)

    def b() -> None:
        time.sleep(0.05)
        with cond:
            seen["b"] = clock.now()
            cond.notify_all()

    threads = [clock.spawn(f, name=n) for f, n in ((a, "a"), (b, "b"), (lambda: clock.sleep(0.1), "ticker"))]
    for t in threads:
        t.join(10)
    assert seen == {"b": 0.0} and not clock.errors, (seen, clock.errors)


# ---------------------------------------------------------------------------------------------
# scripted recovery paths
# ---------------------------------------------------------------------------------------------
def test_fault_free_run_agrees_at_every_step() -> None:
    sim, r = run(Script(), nodes=3)
    by = hashes_by_step(sim)
    assert sorted(by) == list(range(1, 11)) and all(len(h) == 1 for h in by.values())
    assert sum(1 for _, _, row in sim.rows if row["outer_step"] == 10) == 3  # every node logged the end
    assert {q.outcome for q in sim.procs} == {Outcome.FINISHED, Outcome.COMPLETED}  # + the late registrant


def test_kill_inside_the_all_reduce_survivors_redo_the_step() -> None:
    sim, r = run(Script(faults={"n2#0": [Fault("allreduce", 2, "kill")]}, restarts={"n2": "latest"}), nodes=3,
                 inner_steps=40)
    assert lines(r, r"n[01]#0\] all-reduce of outer step 3 failed")
    assert all(len(h) == 1 for h in hashes_by_step(sim).values())
    assert lines(r, r"n2#1\] registered as joiner")  # restarted from its checkpoint of step 2: behind


def test_partial_ring_then_the_finished_ranks_die_history_does_not_fork() -> None:
    """Some ranks finished outer step 3 (and checkpointed it) before the rest failed; then every
    rank that finished dies. The survivors redo step 3 with other members: the dead ranks'
    step-3 state never made it into the run's history, and never into any node's metrics."""
    script = Script(faults={"n3#0": [Fault("allreduce", 2, "partial-outage")]},
                    restarts={n: "latest" for n in ("n0", "n1", "n2", "n3")})
    for seed in range(6):
        sim = Sim(seed, SimParams(nodes=4), script=script)
        r = sim.run()
        assert r["ok"], "\n".join(r["problems"] + r["log"][-60:])
        assert all(len(h) == 1 for h in hashes_by_step(sim).values())


def test_joiner_whose_donor_dies_mid_transfer_is_served_by_another_within_a_heartbeat() -> None:
    script = Script(faults={"n0#0": [Fault("serve", 0, "kill", "during")]}, events=[(2.5, "join", "n3")],
                    restarts={"n0": "latest"})
    sim, r = run(script, nodes=3, inner_steps=40)  # the run starts at 2 s (join window), rounds of 0.4 s
    killed = lines(r, r"n0#0\] FAULT kill at serve")
    freed = lines(r, r"n3#0\] state transfer from n0 failed")
    assert killed and freed
    assert freed[0][0] - killed[0][0] <= sim.p.heartbeat_timeout + 2 * sim.p.heartbeat_interval
    assert lines(r, r"n3#0\] restored the state of outer step")  # from another donor
    assert any(row["outer_step"] == 10 for name, _, row in sim.rows if name == "n3#0")


def test_a_donor_trains_its_round_while_a_long_transfer_goes_on() -> None:
    """The donor streams the state from a background thread: with a transfer of 3 s (7 rounds),
    its next round's inner steps are done long before the joiner has the state, and it then
    waits at the barrier as long as the other founders do (for the joiner's first round)."""
    sim, r = run(Script(events=[(2.5, "join", "n3")]), nodes=3, inner_steps=40, transfer_time=3.0)
    (t_served, serving), = lines(r, r"\] serving the state of outer step \d+ to n3")
    donor, step = re.search(r"\[(n\d)#0\] serving the state of outer step (\d+)", serving).groups()
    (t_restored, _), = lines(r, r"n3#0\] restored the state of outer step")
    assert t_restored - t_served >= 3.0
    nxt = {name.split("#")[0]: row for name, _, row in sim.rows if row["outer_step"] == int(step) + 1}
    assert set(nxt) == {"n0", "n1", "n2", "n3"}
    ours = nxt[donor]
    assert ours["round_start_s"] + ours["compute_s"] <= t_served + 1.0 < t_restored - 1.0
    assert all(abs(ours["sync_s"] - row["sync_s"]) < 0.05 for n, row in nxt.items() if n not in (donor, "n3"))


def test_node_stopped_for_20s_at_the_barrier_is_evicted_and_rejoins() -> None:
    sim, r = run(Script(faults={"n1#0": [Fault("sync", 3, "stall", seconds=20.0)]}), nodes=3,
                 inner_steps=400)  # rounds of 4 s: the run outlasts the stall
    assert lines(r, r"coord\] evicted n1: no heartbeat")
    assert lines(r, r"n1#0\] evicted .*registering again")
    assert lines(r, r"n1#0\] restored the state of outer step")  # took a live peer's state
    assert sim.procs[1].outcome is Outcome.FINISHED


def test_joiner_evicted_while_waiting_for_admission_registers_again() -> None:
    script = Script(faults={"n3#0": [Fault("admit", 0, "stall", seconds=8.0)]}, events=[(2.5, "join", "n3")])
    sim, r = run(script, nodes=3, inner_steps=200)  # rounds of 2 s: the run outlasts the stall
    assert lines(r, r"n3#0\] evicted while waiting for admission")
    assert lines(r, r"n3#0\] restored the state of outer step")


def test_coordinator_restart_mid_run_and_a_stale_checkpoint_restart() -> None:
    """A node killed at step 6 restarts from an older checkpoint while the coordinator is being
    restarted: the journal tells the new coordinator that the state is behind, so it joins."""
    script = Script(faults={"n2#0": [Fault("train", 6, "kill")]}, events=[(2.0 + 6 * 0.4 + 0.2, "coordinator", "")],
                    restarts={"n2": "stale"})
    sim, r = run(script, nodes=3, inner_steps=40)
    assert lines(r, r"coordinator restarted")
    assert lines(r, r"n2#1\] registered as joiner")
    assert all(len(h) == 1 for h in hashes_by_step(sim).values())


def test_an_evicted_node_waits_out_a_coordinator_restart_to_register_again() -> None:
    """n2 stalls past its heartbeat timeout (evicted at 1.8 s) and comes back (3.8 s) while the
    coordinator is down (3.0 s to ~4 s): its new registration waits for the restarted
    coordinator instead of failing, and it is back in the run (found by seed 88 of the
    overlapped simulation)."""
    script = Script(faults={"n2#0": [Fault("train", 1, "stall", "after", seconds=3.0)]},
                    events=[(3.0, "coordinator", "")])
    sim, r = run(script, nodes=3, inner_steps=40, overlap=True, overlap_delay=None)
    assert lines(r, r"n2#0\] evicted") and lines(r, r"coordinator restarted")
    assert len(lines(r, r"n2#0\] registered as")) == 2, "\n".join(r["log"][-40:])  # again, after the eviction
    assert all(len(h) == 1 for h in hashes_by_step(sim).values())


def test_every_holder_lost_the_run_waits_then_the_operator_rolls_back() -> None:
    """All nodes die and come back with empty disks: nobody has the newest state, so the run
    waits (no node is accepted with older state) until the operator allows a rollback."""
    script = Script(events=[(2.3, "outage", "n0,n1,n2")], restarts={n: "empty" for n in ("n0", "n1", "n2")})
    sim, r = run(script, nodes=3, auto_rollback_after=None)  # the manual path: the coordinator waits
    rolled = lines(r, r"OPERATOR")
    assert rolled and lines(r, r"rolled the run back from outer step \d+ to 0")
    died = lines(r, r"outage")[0][0]
    assert rolled[0][0] - died >= 20.0  # it waited first
    assert sim.journal.load("sim").rollbacks and sim.discarded > 0


def test_every_holder_lost_between_checkpoints_the_coordinator_rolls_back_by_itself() -> None:
    """Checkpoints every 3 outer steps; every node dies once the run recorded step 4 (each
    holding step 5, unsaved) and restarts from its checkpoint of step 3: nobody holds the
    newest state. After auto_rollback_after (20 s) of waiting the coordinator rolls back to step
    3 by itself (no operator) and the run completes with one hash per outer step (the abandoned
    step 4 discarded from the fork check)."""
    script = Script(events=[(2.0 + 4 * 0.4 + 0.2, "outage", "n0,n1,n2")])
    sim, r = run(script, nodes=3, inner_steps=40, ckpt_every=3, auto_rollback_after=20.0)
    lost = lines(r, r"coord\] no live node holds the run's state any more")
    rolled = lines(r, r"coord\] WARNING no live node has held the run's newest state \(outer step 4\) for 20s: "
                      r"rolling back to outer step 3")
    assert lost and rolled and lines(r, r"rolled the run back from outer step 4 to 3 \(automatic")
    assert 20.0 <= rolled[0][0] - lost[-1][0] <= 20.0 + 2 * sim.coord_cfg.tick_interval  # waited as configured
    assert not lines(r, r"OPERATOR")
    rb = sim.journal.load("sim").rollbacks
    assert [(x["from"], x["to"]) for x in rb] == [(4, 3)] and rb[0]["by"].startswith("automatic")
    by = hashes_by_step(sim)
    assert sorted(by) == list(range(1, 11)) and all(len(h) == 1 for h in by.values()) and sim.discarded > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_coordinator_paused_20s_mid_run_evicts_nobody(overlap: bool) -> None:
    """SIGSTOP of the coordinator for 20 s mid-run: requests time out and are retried, the
    heartbeats wait for their replies (the session stays open), the coordinator excuses its
    own stall: no eviction at all, and the run completes with one hash per outer step."""
    sim, r = run(Script(events=[(3.0, "pause", "20")]), nodes=3, inner_steps=40, overlap=overlap)
    assert lines(r, r"coordinator paused \(SIGSTOP\) for 20.00s")
    assert lines(r, r"\] (sync|lease): no answer from the coordinator within 10.0s")  # requests timed out meanwhile
    assert not lines(r, r"coord\] evicted"), "\n".join(t for _, t in lines(r, r"evicted"))
    stall = lines(r, r"coord\] WARNING coordinator stalled for (19\.\d|20\.0)s")
    assert stall and 22.9 <= stall[0][0] <= 23.1
    assert any(19.5 <= g <= 20.0 for g in sim.paused_services[0].stalls)
    by = hashes_by_step(sim)
    assert sorted(by) == list(range(1, 11)) and all(len(h) == 1 for h in by.values())
    assert all(q.outcome is not None for q in sim.procs)


def test_every_node_restarted_while_the_coordinator_is_paused_registers_after_waiting() -> None:
    """Every node is SIGKILLed 0.5 s into a 20 s coordinator pause and restarts from its newest
    checkpoint while the coordinator is still stopped: each first registration times out, waits
    (one line), gets through once the coordinator runs again (one line); the run completes."""
    script = Script(events=[(3.0, "pause", "20"), (3.5, "outage", "n0,n1,n2")])
    sim, r = run(script, nodes=3, inner_steps=40)
    restarted = [q for q in sim.procs if q.number == 1]
    assert sorted(q.node_id for q in restarted) == ["n0", "n1", "n2"]
    for q in restarted:
        assert 3.5 < q.started_at < 23.0  # inside the pause
        assert len(lines(r, rf"{q.name}\] node {q.node_id}: waiting for local coordinator")) == 1
        got = lines(r, rf"{q.name}\] node {q.node_id}: registered with local coordinator after waiting")
        assert len(got) == 1 and got[0][0] >= 23.0
        assert q.error is None and q.outcome is not None
    assert sim.injected["start while coordinator paused"] == 3
    by = hashes_by_step(sim)  # (step 3's metrics died with the processes that computed it)
    assert 10 in by and all(len(h) == 1 for h in by.values())


@pytest.mark.parametrize("when", ["mid-run", "before the founders"])
def test_a_node_started_while_the_coordinator_is_down_waits_and_registers(when: str) -> None:
    """A joiner starts while the coordinator is crashed (restarted 5 s later), or every founder
    starts before its coordinator: the first registration waits for it instead of failing."""
    if when == "mid-run":
        script, who = Script(events=[(3.0, "coordinator", "5"), (3.5, "join", "n3")]), ["n3#0"]
    else:
        script, who = Script(events=[(0.0, "coordinator", "5")]), ["n0#0", "n1#0", "n2#0"]
    sim, r = run(script, nodes=3, inner_steps=40)
    up = lines(r, r"coordinator restarted")[0][0]
    for name in who:
        node = name.split("#")[0]
        assert lines(r, rf"{name}\] node {node}: waiting for local coordinator")
        got = lines(r, rf"{name}\] node {node}: registered with local coordinator after waiting")
        assert got and got[0][0] >= up
    assert sim.injected["start while coordinator down"] == len(who)
    assert all(q.outcome is not None and q.error is None for q in sim.procs)
    by = hashes_by_step(sim)
    assert sorted(by) == list(range(1, 11)) and all(len(h) == 1 for h in by.values())


def test_joiner_killed_right_after_a_live_transfer_resumes_from_that_checkpoint(monkeypatch) -> None:
    """n3 joins by live transfer and dies before its first round (before its next checkpoint):
    the state it received was checkpointed with n3's own data position; its restart resumes
    from that checkpoint (rounds of 4 s: the run is still at that step, so it registers with
    it, not as behind) and finishes the run."""
    from intellect_jax.testing import sim_parts

    saved: list[tuple[str, int, object]] = []
    save = sim_parts._Disk.save

    def spy(self, s, *, wait=False):
        saved.append((self.proc.name, s.outer_step, s.data))
        return save(self, s, wait=wait)

    monkeypatch.setattr(sim_parts._Disk, "save", spy)
    script = Script(faults={"n3#0": [Fault("train", 0, "kill", "before")]}, events=[(4.5, "join", "n3")],
                    restarts={"n3": "latest"})
    sim, r = run(script, nodes=3, inner_steps=400)  # the first barrier at 4 s: n3 is a joiner
    got = lines(r, r"n3#0\] restored the state of outer step (\d+)")
    assert got and lines(r, r"n3#0\] FAULT kill at train #0")
    k = int(re.search(r"outer step (\d+)", got[0][1]).group(1))
    assert ("n3#0", k, {"pos": 0}) in saved  # the received state, with the joiner's own (fresh) data position
    assert lines(r, rf"n3#1\] resuming from the checkpoint of outer step {k}")
    assert lines(r, rf"n3#1\] registered as .* at outer step {k} .*state from step {k} joins")
    n3 = next(q for q in sim.procs if q.name == "n3#1")
    assert n3.outcome is Outcome.FINISHED
    by = hashes_by_step(sim)
    assert sorted(by) == list(range(1, 11)) and all(len(h) == 1 for h in by.values())


def test_donor_lets_go_of_a_joiner_that_went_away() -> None:
    """n3 is admitted, then dies before it takes the state and stays down, while its donor
    dials it (transfer_timeout 120 s): the coordinator evicts n3, the donor's heartbeat views
    stop listing it, the donor stops within a few heartbeats, and every process ends within
    a few virtual seconds of the run's completion (not after the transfer timeout)."""
    script = Script(faults={"n3#0": [Fault("receive", 0, "kill", "before")]}, events=[(2.5, "join", "n3")],
                    restarts={"n3": "none"})
    sim, r = run(script, nodes=3, inner_steps=40, transfer_timeout=120.0)
    killed = lines(r, r"n3#0\] FAULT kill at receive")
    stopped = lines(r, r"\] stopped serving n3: the coordinator no longer admits it")
    assert killed and stopped and lines(r, r"driver\] n3 stays down")
    assert stopped[0][0] - killed[0][0] <= sim.p.heartbeat_timeout + 4 * sim.p.heartbeat_interval
    assert sim.completed_at is not None
    ends = [q.ended_at for q in sim.procs if not q.dead]
    assert max(ends) - sim.completed_at < 2.0


def test_the_checker_names_transient_ends_stall_evictions_and_late_ends() -> None:
    from intellect_jax.coordinator.protocol import CoordinatorUnavailable
    from intellect_jax.testing.sim_world import Proc

    sim = Sim(0, SimParams(nodes=2))
    a, b = Proc("n0", 0, [], {}, "fresh"), Proc("n1", 0, [], {}, "fresh", stalls=[(10.0, 12.0)])
    sim.procs = [a, b]
    sim.coord_events = [(5.0, "evicted n0: no heartbeat for 1.1s"), (12.5, "evicted n1: no heartbeat for 1.0s")]
    assert [p.split(" ")[0] for p in sim.stall_evictions()] == ["n0"]  # n1 was stopped meanwhile
    sim.pauses = [(3.0, 4.8)]  # the 1.1 s (+ slack) the coordinator counted reach back over its pause
    assert sim.stall_evictions()
    a.stalls = [(2.0, 2.95)]  # n0 was stopped just before the pause: explained
    assert not sim.stall_evictions()
    sim.completed_at, a.ended_at, b.ended_at = 20.0, 23.0, 45.0
    assert [p.split(" ")[0] for p in sim.late_ends()] == ["n1#0"]  # 33 s after its stall ended
    a.error, a.exc = "CoordinatorUnavailable: gone", CoordinatorUnavailable("gone")
    assert any(p.startswith("n0#0 ended because of a transient coordinator fault")
               for p in sim.check(final=True))


def donor_told_complete_lets_go() -> bool:
    """A donor whose node was evicted (stopped too long) and whose registration again is told
    that the run is complete must let go of the joiner it was serving: ``serving_revoked``."""
    from intellect_jax.coordinator.client import CoordinatorClient
    from intellect_jax.coordinator.journal import MemoryJournal
    from intellect_jax.coordinator.protocol import CoordinatorConfig, RunCompleted
    from intellect_jax.testing.local_coordinator import LocalCoordinator

    clock, out = SimClock(), {}

    def main() -> None:
        cfg = CoordinatorConfig(heartbeat_timeout=1.0, join_window=0.0, min_nodes=1, outer_steps=1)
        coord = LocalCoordinator(cfg, run_id="t", clock=clock, journal=MemoryJournal())
        client = CoordinatorClient(None, None, "n0", "sim://n0", wire=coord.wire("n0"), clock=clock,
                                   heartbeat_interval=0.2, outer_steps=1, say=lambda line: None)
        assert client.register().member
        clock.sleep(1.0)
        since = client.view_seq  # it starts serving joiner n1 now
        svc = coord.service

        def evict_and_complete(now: float) -> None:
            svc.membership.tick(now + 5.0)  # it was stopped 5 s: evicted for silence
            svc.membership.record.completed = True  # meanwhile the others completed the run

        svc.locked(evict_and_complete)
        clock.sleep(1.0)
        out["evicted"] = client.epoch_broken(0)
        try:
            client.register()  # as NodeLoop does after Evicted
        except RunCompleted:
            out["told"] = True
        clock.sleep(5.0)
        out["revoked"] = client.serving_revoked("n1", since)
        client.close()
        coord.crash()

    clock.spawn(main, name="main").join(10)
    assert out.get("evicted") and out.get("told"), (out, clock.errors)
    return bool(out["revoked"])


def test_a_donor_told_at_registration_that_the_run_is_complete_lets_go() -> None:
    assert donor_told_complete_lets_go()


def test_no_joiner_is_admitted_for_the_last_step_and_late_registrants_are_told() -> None:
    script = Script(events=[(2.0 + 0.4 * 9 + 0.2, "join", "n3")])  # joins during the last round
    sim, r = run(script, nodes=3, inner_steps=40)
    assert not lines(r, r"admitted joiner n3")
    joiner = next(q for q in sim.procs if q.node_id == "n3")
    assert joiner.outcome is Outcome.COMPLETED
    assert lines(r, r"\] nothing to do: the run is complete")


def test_the_checker_sees_a_fork() -> None:
    sim = Sim(0)
    sim.rows = [("a#0", 4, {"outer_step": 1, "outer_hash": "h1"}), ("b#0", 4, {"outer_step": 1, "outer_hash": "h2"})]
    assert any("FORK: outer step 1 has 2 hashes" in p for p in sim.check())


def final_leave_survives(event: str) -> bool:
    """n0 did the run's last outer step (the run completes at 5.6 s) and is stopped for 0.5 s
    right after its last barrier; meanwhile (5.7 s) the coordinator is paused for 20 s or
    crashes for 5 s. Its graceful leave then meets a coordinator that does not answer: a
    transient fault, which must not end the process with an error (the run is complete)."""
    ev = (5.65, "pause", "20") if event == "pause" else (5.65, "coordinator", "5")
    sim = Sim(0, SimParams(nodes=3, inner_steps=40, ring_time=0.0),
              script=Script(events=[ev], faults={"n0#0": [Fault("sync", 10, "stall", "after", seconds=0.5)]}))
    r = sim.run()
    assert sim.completed_at is not None and abs(sim.completed_at - 5.6) < 1e-6, sim.completed_at  # the setting
    assert lines(r, r"n0#0\] FAULT stall at sync #10 \(after\)")
    return r["ok"]


@pytest.mark.parametrize("event", ["pause", "crash"])
def test_a_node_whose_final_leave_meets_a_stalled_or_restarting_coordinator_finishes(event: str) -> None:
    assert final_leave_survives(event)


# ---------------------------------------------------------------------------------------------
# seeded random fault schedules
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["sync", pytest.param("sync-long", marks=pytest.mark.slow), "overlap"])
def test_seeded_fault_schedules(which: str) -> None:
    overlap, seeds = which == "overlap", SEEDS[which]
    failed, faults, n = [], 0, len(seeds)
    kinds: dict[str, int] = {}
    t0 = time.monotonic()
    for seed in seeds:
        r = Sim(seed, SimParams(overlap=overlap)).run()
        faults += sum(r["faults"].values())
        for k, v in r["faults"].items():
            kinds[k] = kinds.get(k, 0) + v
        if not r["ok"]:
            line = (f"seed {seed}: {'; '.join(r['problems'])} (replay: python -m intellect_jax.testing.sim "
                    f"--seed {seed} -v{' --overlap' if overlap else ''})")
            failed.append(line)
    print(f"{n} seeds, {faults} faults, {time.monotonic() - t0:.0f}s")
    assert not failed, "\n".join(failed)
    assert faults > 3 * n  # the schedules really inject faults
    for kind in ("coordinator pause (short)", "coordinator pause (long)", "start while coordinator paused",
                 "start while coordinator down", "node and coordinator killed together", "outage (all but one)",
                 "outage (all)", "kill@register/before", "stall@register/after", "donor let go",
                 "frame (an honest piece as evidence)", "kill@lease/after", "stall@lease/before",
                 *(("rollback (automatic)",) if which == "sync-long" else ())):  # (about 1 in 100 seeds)
        assert kinds.get(kind, 0) > 0, (kind, kinds)  # every new kind of fault really happens
