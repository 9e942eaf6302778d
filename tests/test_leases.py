"""Data leases (coordinator/leases.py): the range set, the ledger's every transition keeping the
partition of units, and the membership driving it at barriers, evictions, rollbacks and restarts."""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from intellect_jax.coordinator.journal import JournalError, RunRecord
from intellect_jax.coordinator.leases import Ledger, LeaseError, RangeSet, count
from intellect_jax.coordinator.protocol import PROTOCOL, DataPlan, ProtocolError
from intellect_jax.coordinator.schema import LeaseOk, parse_reply

from helpers import FP, Run

LEASING = DataPlan(True)
H, U, T = 10, 5, 640  # a round of 10 inner steps is 2 units of 5 steps (640 tokens each)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "take"]), st.integers(0, 60), st.integers(0, 12)),
                max_size=40))
def test_a_range_set_is_the_set_it_stands_for(ops):
    rs, ref = RangeSet(), set()
    for op, a, n in ops:
        if op == "add":
            assert rs.add(a, a + n) == len(ref & set(range(a, a + n)))
            ref |= set(range(a, a + n))
        elif op == "remove":
            inside = set(range(a, a + n)) <= ref
            if inside:
                rs.remove(a, a + n)
                ref -= set(range(a, a + n))
            else:
                with pytest.raises(ValueError):
                    rs.remove(a, a + n)
        else:
            got = {v for x, y in rs.take(n) for v in range(x, y)}
            assert got == set(sorted(ref)[:n])
            ref -= got
        assert {v for x, y in rs.ranges() for v in range(x, y)} == ref and len(rs) == len(ref)
        r = rs.ranges()
        assert all(x < y for x, y in r) and all(r[i][1] < r[i + 1][0] for i in range(len(r) - 1))


def _lease(led, node, rnd):
    return led.lease(node, rnd, H, U, T)


def test_a_round_s_units_are_trained_once_its_outer_step_is_recorded():
    led = Ledger()
    a0, b0 = _lease(led, "a", 0), _lease(led, "b", 0)
    assert (a0, b0) == ([[0, 2]], [[2, 4]]) and _lease(led, "a", 0) == a0  # asked again: the same
    led.contributions(0, ["a", "b"])  # barrier 0 formed: both contribute to outer step 1
    assert led.pending == {1: {"a": a0, "b": b0}} and not led.out
    a1 = _lease(led, "a", 1)  # overlapped: round 1 leased before step 1 is recorded
    led.recorded(1, skipped=False, keep=10)
    assert led.trained.ranges() == [[0, 4]] and led.commits == {1: {"a": a0, "b": b0}} and a1 == [[4, 6]]
    assert _lease(led, "b", 0) == [[6, 8]]  # round 0 again (behind, or rolled back): never units of the past
    assert led.status()["tokens_trained"] == 4 * T and led.status()["goodput"] == 1.0
    assert led.problems() == []


def test_a_sit_out_a_failed_ring_a_skipped_average_and_a_death_give_units_back():
    led = Ledger()
    for n in "abc":
        _lease(led, n, 0)
    led.contributions(0, ["a", "b"])  # c sits out: its lease stays out until round 0 is over
    assert led.out == {"c": {0: [[4, 6]]}}
    led.contributions(0, ["a"])  # the ring failed; the retry's epoch lost b, whose lease is out again
    assert led.out == {"b": {0: [[2, 4]]}, "c": {0: [[4, 6]]}} and led.pending == {1: {"a": [[0, 2]]}}
    led.contributions(0, ["a", "b"])  # b came back to the same barrier, formed once more
    assert led.pending == {1: {"a": [[0, 2]], "b": [[2, 4]]}} and led.problems() == []
    led.recorded(1, skipped=True, keep=10)  # every node skipped the average; round 0 is over
    assert led.free.ranges() == [[0, 6]] and len(led.trained) == 0 and not led.out and led.discarded == 6
    assert _lease(led, "c", 1) == [[0, 2]]  # released units are handed out first, lowest first
    _lease(led, "a", 1)
    led.contributions(1, ["a"])  # c died in round 1
    led.recorded(2, skipped=False, keep=10)  # ... its lease goes back once step 2 is recorded
    assert led.trained.ranges() == [[2, 4]] and led.free.ranges() == [[0, 2], [4, 6]] and not led.out
    assert led.problems() == [] and led.status()["duplicates"] == 0


def test_a_node_gone_with_its_contribution_in_the_ring_counts_if_the_step_is_recorded():
    led = Ledger()
    _lease(led, "a", 0), _lease(led, "b", 0)
    led.contributions(0, ["a", "b"])  # b dies after sending: the others' average holds its contribution
    led.recorded(1, skipped=False, keep=10)
    assert led.trained.ranges() == [[0, 4]] and led.problems() == []


def _trained_alone(rounds, keep):
    """A ledger whose one node "a" trained ``rounds`` rounds, each recorded."""
    led = Ledger()
    for r in range(rounds):
        _lease(led, "a", r)
        led.contributions(r, ["a"])
        led.recorded(r + 1, skipped=False, keep=keep)
    return led


def test_a_rollback_trains_the_forgotten_steps_units_again():
    led = _trained_alone(3, keep=10)
    _lease(led, "b", 1)  # b resumed from step 1 already (the barrier that rolls back is forming)
    led.rollback(1)  # back to outer step 1: steps 2 and 3 are forgotten, b's new lease stays
    assert led.trained.ranges() == [[0, 2]] and sorted(led.commits) == [1] and led.out == {"b": {1: [[6, 8]]}}
    assert led.free.ranges() == [[2, 6]] and led.problems() == []
    assert _lease(led, "a", 1) == [[2, 4]]
    led.contributions(1, ["a", "b"])
    assert led.pending == {2: {"a": [[2, 4]], "b": [[6, 8]]}}


def test_the_run_s_end_gives_back_what_is_out_and_old_commits_fold():
    led = _trained_alone(5, keep=2)
    assert sorted(led.commits) == [4, 5] and led.trained.ranges() == [[0, 10]]
    _lease(led, "a", 5)
    led.finish()
    assert not led.out and not led.pending and led.free.ranges() == [[10, 12]] and led.problems() == []


def test_the_partition_check_sees_a_unit_in_two_places_or_lost():
    led = Ledger()
    _lease(led, "a", 0)
    led.free.add(0, 1)
    assert any("also elsewhere" in p for p in led.problems())
    led = Ledger()
    _lease(led, "a", 0)
    led.out.clear()
    assert any("some lost" in p for p in led.problems())


def test_the_geometry_is_the_run_s():
    led = Ledger()
    with pytest.raises(LeaseError, match="not whole units"):
        led.lease("a", 0, 10, 3, T)
    _lease(led, "a", 0)
    with pytest.raises(LeaseError, match="this run's units are 5 inner steps"):
        led.lease("b", 0, 10, 2, T)
    led = Ledger()
    led.lease("a", 0, H, U, T, "s1")
    with pytest.raises(LeaseError, match="its data stream s2 is not this run's s1"):
        led.lease("b", 0, H, U, T, "s2")


def test_the_ledger_survives_the_journal_and_a_bad_one_is_refused():
    rec = RunRecord(run_id="r")
    rec.leases = Ledger()
    _lease(rec.leases, "a", 0)
    rec.leases.contributions(0, ["a"])
    _lease(rec.leases, "a", 1)
    back = RunRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert back.leases.to_json() == rec.leases.to_json() and back.leases.problems() == []
    bad = rec.to_json()
    bad["leases"]["free"] = [[3, 1]]
    with pytest.raises(JournalError, match="leases: not a list of"):
        RunRecord.from_json(bad)
    assert RunRecord.from_json(RunRecord(run_id="r").to_json()).leases is None  # a run without leases


def test_a_lease_reply_must_be_sorted_ranges():
    assert parse_reply(LeaseOk, {"ok": True, "units": [[0, 2], [5, 6]]}, "lease", "c").units == [[0, 2], [5, 6]]
    for units in ([[2, 2]], [[3, 4], [0, 2]], [[0, 2], [2, 3]], [], [[0, -1]]):
        with pytest.raises(ProtocolError, match="malformed lease reply"):
            parse_reply(LeaseOk, {"ok": True, "units": units}, "lease", "c")


# ---- the membership drives it ----------------------------------------------------------------------
def _lease_m(r, node, rnd):
    return r.m.lease(node, r.s[node], rnd, H, U, T, r.now)


def test_barriers_commit_what_made_it_and_evictions_give_back_what_did_not():
    r = Run(min_nodes=3)
    for n in "abc":
        r.reg(n, data=LEASING)
    for n in "abc":
        _lease_m(r, n, 0)
    r.m.arrive("a", r.s["a"], 0, r.now, "h0")
    r.m.arrive("b", r.s["b"], 0, r.now, "h0")
    r.m.arrive("c", r.s["c"], 0, r.now, "h0", sits_out="a NaN")  # c's round-0 units come back ...
    led = r.m.record.leases
    assert sorted(led.pending[1]) == ["a", "b"] and led.out == {"c": {0: [[4, 6]]}}
    for n in "abc":
        _lease_m(r, n, 1)
    r.barrier(1, ["a", "b", "c"], "h1")  # outer step 1 recorded: a's and b's round 0 trained
    assert led.trained.ranges() == [[0, 4]] and sorted(led.pending[2]) == ["a", "b", "c"]
    assert "c" not in led.out and [4, 6] in led.free.ranges()  # ... once round 0 is over
    for n in "abc":
        _lease_m(r, n, 2)
    r.silent.add("a")
    r.tick(6.0)  # a stops heartbeating and is evicted: its round-2 lease goes back once round 2 is over
    r.barrier(2, ["b", "c"], "h2")
    assert "a" in led.out and sorted(led.pending[3]) == ["b", "c"]
    for n in "bc":
        _lease_m(r, n, 3)
    r.barrier(3, ["b", "c"], "h3")
    assert 2 not in led.out.get("a", {}) and led.problems() == []
    st_ = r.m.status(r.now)["data"]
    assert st_["units_trained"] == 14 and st_["duplicates"] == 0 and 0 < st_["goodput"] < 1


def test_lease_requests_are_checked_against_the_run():
    r = Run(min_nodes=1)
    r.reg("a", data=LEASING)
    with pytest.raises(ProtocolError, match="round 5 is not one the run trains now"):
        _lease_m(r, "a", 5)
    _lease_m(r, "a", 0)
    with pytest.raises(ProtocolError, match="this run's units are 5 inner steps"):
        r.m.lease("a", r.s["a"], 0, H, 2, T, r.now)


def test_a_run_reads_its_data_one_way_and_a_fixed_shard_is_read_once():
    """The plan of the run's first barrier is the run's (journaled; before it, the live nodes'
    plan); a node of another plan, or on a fixed shard a live node reads, is refused in one
    line naming what to change; a misconfigured node that leaves first settles nothing."""
    from intellect_jax.coordinator.protocol import RegistrationRefused
    from intellect_jax.coordinator.schema import DataMsg

    def reg(r, n, plan):
        r.s[n] = r.m.register(n, f"h:{len(r.s) + 1}", 1, PROTOCOL, FP, r.now, data=plan).session

    r = Run(min_nodes=2)
    reg(r, "a", DataPlan(True))
    with pytest.raises(RegistrationRefused, match="reads its data by 4 fixed shards, live node a by leases .the "
                                                  "run's first barrier settles the plan") as ei:
        reg(r, "b", DataPlan(False, 1, 4))
    assert ei.value.reason == "plan"  # (retried by the node: a misconfigured one that dies or leaves settles nothing)
    reg(r, "b", DataPlan(True))
    reg(r, "tool", None)  # (a client that does not say is not checked, and it is leased nothing)
    with pytest.raises(ProtocolError, match="registered with no data plan: only a node that registered leasing"):
        _lease_m(r, "tool", 0)
    r.m.leave("tool", r.s.pop("tool"), r.now)
    assert r.m.record.data is None
    r.barrier(0, ["a", "b"], "h0")  # the first barrier settles the plan
    assert RunRecord.from_json(json.loads(json.dumps(r.m.record.to_json()))).data == "leases"
    assert r.m.status(r.now)["data_plan"] == "leases"
    for n in "ab":
        r.m.leave(n, r.s[n], r.now)
    with pytest.raises(RegistrationRefused, match="this run by leases"):
        reg(r, "c", DataPlan(False, 0, 1))

    r = Run(min_nodes=2)
    reg(r, "wrong", DataPlan(True))  # a misconfigured node, gone before any barrier
    r.m.leave("wrong", r.s["wrong"], r.now)
    reg(r, "a", DataPlan(False, 0, 2))
    with pytest.raises(RegistrationRefused, match="data shard 0 of 2 is read by live node a") as ei:
        reg(r, "b", DataPlan(False, 0, 2))
    assert ei.value.reason == "shard"  # (retried by the node: a dead holder is evicted soon)
    with pytest.raises(RegistrationRefused, match="by 3 fixed shards, live node a by 2 fixed shards"):
        reg(r, "b", DataPlan(False, 1, 3))
    reg(r, "b", DataPlan(False, 1, 2))
    with pytest.raises(ProtocolError, match="registered with fixed data shard 1 of 2: only a node"):
        _lease_m(r, "b", 0)
    r.barrier(0, ["a", "b"], "h0")
    r.barrier(1, ["a", "b"], "h1")
    r.m.leave("a", r.s["a"], r.now)
    reg(r, "c", DataPlan(False, 0, 2))  # a's shard, once a is gone
    with pytest.raises(RegistrationRefused, match="this run by 2 fixed shards .start it with --diloco.data_rank I "
                                                  "--diloco.data_ranks 2"):
        reg(r, "d", DataPlan(True))
    old = Run(min_nodes=1)
    old.m.record.hwm_step = 5  # a journal from before data plans, past step 0 without leases
    with pytest.raises(RegistrationRefused, match="past outer step 0 without leases"):
        reg(old, "a", DataPlan(True))
    led = Run(min_nodes=1)
    led.m.record.leases = Ledger()  # ... or with leases: they decide
    with pytest.raises(RegistrationRefused, match="this run by leases"):
        reg(led, "a", DataPlan(False, 0, 1))
    for bad in ({"leases": True, "ranks": 2}, {"leases": False, "rank": 2, "ranks": 2}, {"leases": False, "ranks": 0}):
        with pytest.raises(ValueError):
            DataMsg.model_validate(bad)


def test_a_node_of_another_protocol_is_told_so_whatever_fields_it_sends():
    from intellect_jax.coordinator.service import CoordinatorService

    svc = CoordinatorService()
    reply = svc.handle({"op": "register", "node": "a", "addr": "h:1", "devices": 1, "protocol": PROTOCOL + 1,
                        "fingerprint": FP, "a_field_of_version_8": {}}, identity="a")
    assert reply["reason"] == "protocol" and f"protocol version {PROTOCOL + 1} != coordinator's {PROTOCOL}" in \
        reply["message"], reply


def test_a_restarted_coordinator_keeps_the_leases_and_commits_on():
    """Killed after barrier 0 (round 0's units in the ring): the reloaded journal still has them
    pending, and the restarted coordinator's barrier 1 records them as trained."""
    from intellect_jax.coordinator.protocol import Resume

    r = Run(min_nodes=2)
    for n in "ab":
        r.reg(n, data=LEASING)
        _lease_m(r, n, 0)
    eps = r.barrier(0, ["a", "b"], "h0")
    rec = RunRecord.from_json(json.loads(json.dumps(r.m.record.to_json())))  # the journal, reloaded
    r2 = Run(record=rec, min_nodes=2)
    for n in "ab":  # they did outer step 1 meanwhile
        r2.reg(n, resume=Resume(1, eps[n].epoch_id, eps[n].rank, "h1", ("a", "b")), data=LEASING)
    r2.barrier(1, ["a", "b"], "h1")
    led = r2.m.record.leases
    assert led.trained.ranges() == [[0, 4]] and led.problems() == []
    assert count(_lease_m(r2, "a", 1)) == 2


# ---- real trainers ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_trainers_train_exactly_the_units_they_are_leased(tmp_path, cache_dir, monkeypatch):
    """Two real trainers reading the one stream, each round's data leased: every inner step
    trains the next batch of the node's lease, in order, and the two nodes' units are disjoint
    and cover the stream's first units, with none twice."""
    import jax

    from intellect_jax.data.pipeline import DataIterator, make_train_iter
    from intellect_jax.diloco.inner import TrainerInner
    from intellect_jax.diloco.parts import LoopConfig, Outcome
    from intellect_jax.net.comm import RingConfig
    from intellect_jax.testing.local import run_local
    from intellect_jax.trainer.loop import Role, Trainer

    from helpers import tiny_cfg

    H, R, U = 4, 3, 2
    trained: dict[int, list] = {}  # id(iterator) -> the token arrays it yielded
    nxt = DataIterator.__next__

    def recording(self):
        batch = nxt(self)
        trained.setdefault(id(self), []).append(np.asarray(batch["tokens"]))
        return batch

    monkeypatch.setattr(DataIterator, "__next__", recording)
    trainers = [Trainer(tiny_cfg(tmp_path / f"n{i}", cache_dir, run={"steps": H * R}), role=Role.INNER,
                        devices=jax.devices()[4 * i:4 * i + 4])
                for i in range(2)]  # each on its own devices (see helpers.node_trainer)
    leased: dict[int, list[tuple[int, list]]] = {0: [], 1: []}

    class Leased(TrainerInner):
        def lease(self, rnd, batches):
            leased[trainers.index(self.t)].append((rnd, [b for a, z in batches for b in range(a, z)]))
            super().lease(rnd, batches)

    stream = trainers[0].data.stream
    assert trainers[1].data.stream == stream
    try:
        outs = run_local(LoopConfig(inner_steps=H, outer_steps=R, data_units=(U, U * 8 * 32, stream)),
                         [Leased(t) for t in trainers], RingConfig(mode="int8"))
        ids = [id(t.data) for t in trainers]
        whole = make_train_iter(trainers[0].cfg.data, trainers[0].tok)  # the stream, unleased
        global_batches = [np.asarray(next(whole)["tokens"]) for _ in range(2 * R * H)]
        whole.close()
    finally:
        for t in trainers:
            t.close(save=False)
    assert set(outs) <= {Outcome.FINISHED, Outcome.COMPLETED}
    for i in range(2):
        assert [r for r, _ in leased[i]] == list(range(R))
        want = [global_batches[b] for _, bs in leased[i] for b in bs]  # what it trained is what it leased
        assert len(trained[ids[i]]) == len(want) and all(np.array_equal(a, b) for a, b in zip(trained[ids[i]], want))
    units = sorted(b // U for i in range(2) for _, bs in leased[i] for b in bs[::U])
    assert units == list(range(2 * R * H // U))  # disjoint, no gaps: the stream's first units, once each


def test_the_config_names_what_leases_replace():
    from pydantic import ValidationError

    from intellect_jax.diloco.config import DilocoConfig

    assert DilocoConfig(leases=True, inner_steps=100).lease_unit == 25
    assert DilocoConfig(leases=True, inner_steps=50).lease_unit == 25
    assert DilocoConfig(leases=True, inner_steps=12).lease_unit == 12
    assert DilocoConfig(leases=True, inner_steps=100, unit_steps=10).lease_unit == 10
    with pytest.raises(ValidationError, match="leases hand out the data: drop data_rank"):
        DilocoConfig(leases=True, data_rank=1, data_ranks=2)
    with pytest.raises(ValidationError, match="unit_steps \\(30\\) must divide inner_steps \\(100\\)"):
        DilocoConfig(leases=True, inner_steps=100, unit_steps=30)


def test_a_reloaded_memory_journal_saves_the_next_lease_of_a_new_lifetime():
    """A coordinator restarted on the same in-memory journal: its ledger's revisions start again,
    and the first change after the reload is still saved (not taken for the old lifetime's)."""
    from intellect_jax.coordinator.journal import MemoryJournal

    j = MemoryJournal()
    rec = j.load("r")
    rec.leases = Ledger()
    _lease(rec.leases, "a", 0)
    assert j.save(rec)
    again = j.load("r")  # the restarted coordinator: two new leases bring its revision to the old one's
    _lease(again.leases, "b", 0)
    _lease(again.leases, "c", 0)
    assert j.save(again) and sorted(j.load("r").leases.out) == ["a", "b", "c"]


def test_a_ledger_from_before_streams_were_named_takes_the_first_one():
    d = Ledger()
    d.lease("a", 0, H, U, T)
    old = d.to_json()
    del old["stream"]
    led = Ledger.from_json(old)
    rev = led.rev
    assert led.lease("b", 0, H, U, T, "s1") == [[2, 4]] and led.stream == "s1" and led.rev > rev


def test_the_simulation_counts_only_whole_units_a_node_trained():
    from intellect_jax.testing.sim_checks import units_of

    assert units_of([4, 5, 6, 7, 0, 1], 2) == [[0, 1], [2, 4]]
    assert "not whole units" in units_of([10, 11, 12], 2)
    assert "not whole units" in units_of([11, 12], 2)


def test_a_skipped_average_whose_every_witness_restarted_gives_its_units_back():
    """n2 sends NaN into outer step 3's all-reduce: every node skips that average. Then every
    node dies before the barrier that would report it, and all resume from their checkpoints
    of step 3: they still know they skipped it, so step 3 trains none of its units (the
    simulation's check compares each recorded step's units with what its ring carried)."""
    from intellect_jax.testing.sim import Fault, Script, Sim, SimParams

    nodes = ("n0", "n1", "n2")
    faults = {f"{n}#0": [Fault("sync", 3, "kill")] for n in nodes}
    faults["n2#0"].append(Fault("poison", 3, "poison", "wire", value="nan"))
    sim = Sim(0, SimParams(nodes=3, outer_steps=6, ckpt_every=1, coordinator_restarts=0, coordinator_pauses=0),
              script=Script(faults=faults))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN arithmetic on purpose
        report = sim.run()
    log = "\n".join(report["log"])
    assert report["ok"], "\n".join(report["problems"] + report["log"][-40:])
    assert "outer step 3 skipped" in log and log.count("FAULT kill at sync #3") == 3, log[-3000:]
    assert "resuming from the checkpoint of outer step 3" in log
    led = sim.journal.load("sim").leases
    assert 3 not in led.commits and {2, 4} <= set(led.commits), sorted(led.commits)


def test_a_skipped_average_held_only_by_a_joiner_gives_its_units_back():
    """The same skip, but its witnesses die once their joiner n2 holds state 3 (admitted at
    boundary 2): n2 alone forms barrier 3. The verdict came with the state (it is hashed), so
    n2 reports it and step 3 trains none of the units."""
    from intellect_jax.testing.sim import Fault, Script, Sim, SimParams

    faults = {f"{n}#0": [Fault("sync", 3, "kill")] for n in ("n0", "n1")}
    faults["n1#0"].append(Fault("poison", 3, "poison", "wire", value="nan"))
    p = SimParams(nodes=2, outer_steps=6, inner_steps=40, ckpt_every=1, coordinator_restarts=0, coordinator_pauses=0,
                  late_joiners=0)
    sim = Sim(0, p, script=Script(faults=faults, events=[(2.5, "join", "n2")]))  # (rounds of 0.4 s from 2 s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN arithmetic on purpose
        report = sim.run()
    log = "\n".join(report["log"])
    assert report["ok"], "\n".join(report["problems"] + report["log"][-40:])
    assert "admitted joiner n2 at boundary 2" in log and "epoch 2: members [n2] at boundary 3" in log, log[-3000:]
    led = sim.journal.load("sim").leases
    assert 3 not in led.commits and {2, 4} <= set(led.commits), sorted(led.commits)


def test_a_node_refused_while_the_plan_is_unsettled_waits_for_the_misconfigured_one_to_go():
    """A misconfigured node registered first (a fixed shard) holds no run: a leasing node is told
    so (reason "plan") and retries; once the misconfigured one leaves, it registers."""
    import threading

    from intellect_jax.coordinator.client import CoordinatorClient
    from intellect_jax.coordinator.protocol import CoordinatorConfig
    from intellect_jax.testing.local_coordinator import LocalCoordinator

    coord = LocalCoordinator(CoordinatorConfig(min_nodes=2, join_window=0.0))
    said: list[str] = []

    def client(n, plan):
        return CoordinatorClient(None, None, n, f"local://{n}", wire=coord.wire(n), heartbeat_interval=0.2,
                                 register_timeout=20.0, data=plan, say=said.append)

    wrong, good = client("m", DataPlan(False, 0, 4)), client("a", LEASING)
    try:
        wrong.register()
        got: list = []
        t = threading.Thread(target=lambda: got.append(good.register()))
        t.start()
        time.sleep(1.0)
        assert not got and any("live node m by 4 fixed shards" in line for line in said), said
        wrong.leave()
        t.join(15)
        assert got and got[0].member, (got, said)
    finally:
        wrong.close(), good.close()
        coord.crash()
