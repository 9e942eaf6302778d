"""Elastic DiLoCo: outer optimizer and hash, the state transfer of a real node, then whole runs
of real trainers in this process (stopped, resumed from checkpoints, started from another node's,
complete). Checkpoint store: test_store.py; real processes: test_launch.py (the launcher) and
test_chaos.py."""

import json
import threading
import time

import numpy as np
import optax
import pytest

from intellect_jax.coordinator.protocol import Admission
from intellect_jax.diloco import state as S

from helpers import InProcessRun, hashes, leaves, node_parts, one_history, outer_step

# ---------------------------------------------------------------------------- units


def test_numpy_nesterov_matches_optax():
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(5, 3)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
    ours, ref = S.nesterov_sgd(0.7, 0.9), optax.sgd(0.7, momentum=0.9, nesterov=True)
    s1, s2 = ours.init(params), ref.init(params)
    p1 = p2 = params
    for _ in range(4):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = ref.update(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    for k in params:
        np.testing.assert_allclose(np.asarray(p1[k]), np.asarray(p2[k]), rtol=1e-6, atol=1e-6)


def test_outer_step_moves_toward_the_inner_params():
    tx = S.nesterov_sgd(1.0, 0.0)
    s = S.init_state({"w": np.ones(4, np.float32)}, tx, None)
    inner = {"w": np.full(4, 0.25, np.float32)}
    pg = S.pseudo_gradient(s.outer_params, inner)
    np.testing.assert_array_equal(pg["w"], 0.75)
    new = S.outer_step(s, pg, tx, inner_step=10)  # lr 1, no momentum: outer jumps to the inner params
    np.testing.assert_array_equal(new.outer_params["w"], inner["w"])
    assert (new.outer_step, new.inner_step) == (1, 10)


def test_state_hash_sees_every_bit_of_the_shared_state_only():
    tx = S.nesterov_sgd(0.7, 0.9)
    a = S.init_state({"w": np.linspace(0, 1, 10, dtype=np.float32)}, tx, {"mu": np.zeros(3, np.float32)})
    h = S.state_hash(a)
    assert h == S.state_hash(S.init_state({"w": np.linspace(0, 1, 10, dtype=np.float32)}, tx, None))
    w = a.outer_params["w"].copy()
    w.view(np.uint32)[3] ^= 1  # one ulp
    assert S.state_hash(a._replace(outer_params={"w": w})) != h
    assert S.state_hash(a._replace(outer_step=1)) != h
    m = {"w": np.zeros(10, np.float32)}
    m["w"][0] = 1e-30
    assert S.state_hash(a._replace(outer_opt_state=S.MomentumState(m))) != h
    # the verdict on the last average (skipped or applied) is shared: hashed, once there is one
    assert len({h, S.state_hash(a._replace(skipped=True)), S.state_hash(a._replace(skipped=False))}) == 3
    # each node's own inner optimizer state and data position are not part of the run's hash
    assert S.state_hash(a._replace(inner_opt_state={"mu": np.ones(3, np.float32)}, data={"pos": 5})) == h


# ---------------------------------------------------------------------------- a real node's state transfer


def test_state_transfer_over_sockets_and_cancellation(tmp_path, cache_dir):
    from intellect_jax.diloco.parts import TransferFailed
    from intellect_jax.diloco.transfer import NetTransport
    from intellect_jax.net.comm import NetNode
    from intellect_jax.testing.identities import transport_config

    t, inner = node_parts(tmp_path, cache_dir)
    tx = S.nesterov_sgd(0.7, 0.9)
    s = outer_step(inner, inner.init_state(tx), tx, 4)
    snap = s._replace(inner_opt_state=inner.snapshot(), data=None)
    with NetNode(transport_config("donor", "xfer", io_timeout=5.0)) as donor_net, \
            NetNode(transport_config("j", "xfer", io_timeout=5.0)) as joiner_net:
        donor, joiner = NetTransport(donor_net, "donor", watch_interval=0.1), NetTransport(joiner_net, "j",
                                                                                        watch_interval=0.1)
        adm = Admission("donor", "x", 0, 1, 1)
        meta = {"outer_step": 1, "inner_step": 4, "hash": S.state_hash(s), "skipped": s.skipped}
        done = donor.serve("j", "%s:%d" % joiner_net.address, snap, meta)
        got_meta, got = joiner.receive(adm, inner.template(), lambda: False, timeout=30)
        assert done.wait(10)
        assert (got_meta.outer_step, got_meta.inner_step, got_meta.hash, got_meta.skipped) == (1, 4, meta["hash"], False)
        got = got._replace(outer_step=1, skipped=got_meta.skipped)
        assert S.state_hash(got) == meta["hash"]
        for a, b in zip(leaves(got.inner_opt_state), leaves(snap.inner_opt_state)):
            np.testing.assert_array_equal(a, b)
        assert joiner.last["bytes"] == sum(x.nbytes for x in leaves(snap.arrays()))
        # no donor comes and the coordinator revokes the admission: the joiner is freed at once
        flag = threading.Event()
        threading.Timer(0.3, flag.set).start()
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="revoked"):
            joiner.receive(Admission("gone", "x", 1, 2, 2), inner.template(), flag.is_set, timeout=60)
        assert time.monotonic() - t0 < 2.0
        # a donor whose state has another shape is refused
        bad = snap._replace(outer_params={**snap.outer_params, "embed_VxD": np.zeros((3, 3), np.float32)})
        donor.serve("j", "%s:%d" % joiner_net.address, bad, {**meta, "outer_step": 2})
        with pytest.raises(TransferFailed, match="another shape"):
            joiner.receive(Admission("donor", "x", 1, 2, 2), inner.template(), lambda: False, timeout=30)
    t.close(save=False)


# ---------------------------------------------------------------------------- whole runs in process


@pytest.mark.slow
def test_whole_run_stopped_resumed_started_elsewhere_and_complete(tmp_path, cache_dir):
    """Real trainers as threads, orbax checkpoints every outer step, one in-process coordinator
    per launch journaled in the run directory (as the launcher's). Launch 1 stops at outer step
    2 of 4; new nodes of another run start from node0's checkpoint (shared storage); the same
    nodes relaunched with --ckpt.resume carry on from step 2 as resumed members (one history,
    the journal's hashes); one more launch is told the run is complete."""
    from intellect_jax.diloco.parts import Outcome

    nodes = ["node0", "node1"]
    run = InProcessRun(tmp_path / "runs", cache_dir, "debug_diloco", H=5, steps=20, ckpt_every=5)
    assert set(run.launch(nodes, stop_at=2).values()) == {Outcome.STOPPED}, run.text()[-3000:]
    assert [r["outer_step"] for r in run.rows("node0") if "outer_hash" in r] == [1, 2]
    first = one_history(run.rows(n) for n in nodes)
    n_rows = len(run.rows("node0"))
    # new nodes of another run dir start from node0's checkpoint on "shared storage"
    shared = InProcessRun(tmp_path / "runs", cache_dir, "shared", H=5, steps=20, ckpt_every=5)
    shared.launch(nodes, init_from=str(run.run_dir / "node0"))
    assert shared.text().count("resuming from the checkpoint of outer step 2") == 2, shared.text()[-3000:]
    got = [hashes(shared.rows(n)) for n in nodes]
    assert got[0] == got[1] and sorted(got[0]) == [3, 4]
    # the same nodes again with --ckpt.resume: they carry on from their checkpoints of step 2
    mark = len(run.lines)
    assert set(run.launch(nodes, resume=True).values()) <= {Outcome.FINISHED, Outcome.COMPLETED}
    again = "\n".join(f"[{w}] {x}" for w, x in run.lines[mark:])
    assert again.count("resuming from the checkpoint of outer step 2") == 2, again[-3000:]
    assert again.count("as resumed member") == 2, again[-3000:]
    history = one_history(run.rows(n) for n in nodes)
    assert sorted(history) == [1, 2, 3, 4] and {k: history[k] for k in first} == first
    assert [r["step"] for r in run.rows("node0")[n_rows:] if "loss" in r] == list(range(11, 21))  # carried on
    journal = json.loads((run.run_dir / "coordinator.journal").read_text())
    assert journal["completed"] is True and journal["hwm_step"] == 4
    assert {int(k): h for k, h in journal["hashes"].items() if int(k) > 0} == history  # rows agree with the journal
    # the same launch again: the run is complete; every node is told so and ends
    mark = len(run.lines)
    assert set(run.launch(nodes, resume=True).values()) == {Outcome.COMPLETED}
    assert "\n".join(x for _, x in run.lines[mark:]).count("nothing to do: the run is complete") == 2


def test_a_ring_that_cannot_be_built_fails_one_epoch_and_the_step_is_redone(monkeypatch):
    """A member list the ring refuses (e.g. an address that is no address: ConfigMismatch) fails
    that epoch for every member, as a broken all-reduce does: each node retries in a new epoch,
    nobody dies, and the run keeps one history."""
    from intellect_jax.diloco.parts import LoopConfig, Outcome
    from intellect_jax.net.comm import RingConfig
    from intellect_jax.net.errors import ConfigMismatch
    from intellect_jax.testing import local

    built = local.LocalRing.__call__
    refused: list[int] = []

    def ring(self, ep):
        if ep.outer_step == 1 and ep.epoch_id == 1:  # the first epoch of outer step 2
            refused.append(ep.rank)
            raise ConfigMismatch(f"ring of epoch {ep.epoch_id}: not a host:port address: 'h:x'")
        return built(self, ep)

    monkeypatch.setattr(local.LocalRing, "__call__", ring)
    rng = np.random.default_rng(0)
    init = {"w": rng.standard_normal(8).astype(np.float32), "u": np.zeros(3, np.float32)}  # NumpyInner's leaves
    targets = [rng.standard_normal(8).astype(np.float32) for _ in range(2)]
    inners = [local.NumpyInner(t, init, np.mean(targets, axis=0)) for t in targets]
    lines: list[str] = []
    outs = local.run_local(LoopConfig(inner_steps=3, outer_steps=4), inners, RingConfig(mode="fp32"),
                           log=lines.append)
    assert sorted(refused) == [0, 1] and set(outs) <= {Outcome.FINISHED, Outcome.COMPLETED}
    assert sum("no ring for outer step 2 in epoch 1" in ln for ln in lines) == 2, lines
    history = one_history([m for _, m in x.records] for x in inners)  # (fails on two hashes for one step)
    assert sorted(history) == [1, 2, 3, 4]


def test_every_state_transport_takes_what_the_node_loop_passes_it() -> None:
    """The in-process transports stand in for the socket one (``parts.Transport``): each
    ``serve`` and ``receive`` takes the same parameters, or a joiner in a test run crashes its
    donor (the local one lacked ``cancelled`` and did, when a CI run's timing made a node join)."""
    import inspect

    from intellect_jax.diloco import parts, transfer
    from intellect_jax.testing import local, sim_parts

    for cls in (transfer.NetTransport, local._Endpoint, sim_parts._Transport):
        for name in ("serve", "receive"):
            want = [n for n in inspect.signature(getattr(parts.Transport, name)).parameters if n != "self"]
            have = [p for n, p in inspect.signature(getattr(cls, name)).parameters.items() if n != "self"]
            assert [p.name for p in have[:len(want)]] == want, (cls, name)  # what the loop passes, in order
            assert all(p.default is not inspect.Parameter.empty for p in have[len(want):]), (cls, name)
