"""The DiLoCo node under faults, in process: scripted recovery paths, then hundreds of seeded
random fault schedules (`intellect_jax.diloco.sim`). Virtual time: a run of minutes takes
milliseconds, whatever the machine's load."""

from __future__ import annotations

import re
import time

import pytest


from intellect_jax.diloco.clock import Hang, SimClock
from intellect_jax.diloco.loop import Outcome
from intellect_jax.diloco.sim import Fault, Script, Sim, SimParams

SEEDS = {False: 500, True: 200}  # synchronous / overlapped rounds; the CI budget: about a minute on two cores


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
    sim, r = run(script, nodes=3)
    rolled = lines(r, r"OPERATOR")
    assert rolled and lines(r, r"rolled the run back from outer step \d+ to 0")
    died = lines(r, r"outage")[0][0]
    assert rolled[0][0] - died >= 20.0  # it waited first
    assert sim.journal.load("sim").rollbacks and sim.discarded > 0


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


# ---------------------------------------------------------------------------------------------
# seeded random fault schedules
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_seeded_fault_schedules(overlap: bool) -> None:
    failed, faults, n = [], 0, SEEDS[overlap]
    t0 = time.monotonic()
    for seed in range(n):
        r = Sim(seed, SimParams(overlap=overlap)).run()
        faults += sum(r["faults"].values())
        if not r["ok"]:
            failed.append(f"seed {seed}: {'; '.join(r['problems'])} (replay: python -m intellect_jax.diloco.sim "
                          f"--seed {seed} -v{' --overlap' if overlap else ''})")
    print(f"{n} seeds, {faults} faults, {time.monotonic() - t0:.0f}s")
    assert not failed, "\n".join(failed)
    assert faults > 3 * n  # the schedules really inject faults
