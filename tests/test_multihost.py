"""A DiLoCo node of several processes: the shard plumbing and the lead's stop() in process, and
a real run of a node of 2 processes x 4 CPU devices beside a node of 1 process x 8 devices."""

import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from intellect_jax.diloco.multihost import (
    Follower,
    Followers,
    LeadInner,
    build,
    fill,
    local_shards,
    recv_parts,
    send_parts,
    slices_for,
)
from intellect_jax.net.comm import NetNode
from intellect_jax.net.errors import FrameError
from intellect_jax.net.arrays import recv_array_data, send_arrays
from intellect_jax.net.transport import connect, send_msg
from intellect_jax.testing.identities import transport_config

from helpers import TINY_ARGS, coord_env, free_port, hashes, one_history, rows

ROOT = Path(__file__).resolve().parent.parent


def _tree():
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    sh = {"w": NamedSharding(mesh, PartitionSpec("fsdp", "tp")), "b": NamedSharding(mesh, PartitionSpec("tp")),
          "n": NamedSharding(mesh, PartitionSpec())}
    rng = np.random.default_rng(0)
    host = {"w": rng.standard_normal((8, 6)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
            "n": np.asarray(7, np.int32)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host)
    return host, sh, abstract


def test_slices_build_the_arrays_and_shards_fill_them_back():
    host, sh, abstract = _tree()
    parts = slices_for(0, host, sh, abstract)  # every device is this process's here
    # each distinct slice once: w in 4x2 blocks, b in 2 halves (replicated over fsdp), n whole
    assert sorted((leaf, len([p for p in parts if p[0] == leaf])) for leaf in range(3)) == [(0, 2), (1, 1), (2, 8)]
    arrays = build(parts, sh, abstract)
    for k in host:
        assert arrays[k].sharding == sh[k] and np.array_equal(np.asarray(arrays[k]), host[k])
    back = fill(local_shards(arrays), abstract)
    assert all(np.array_equal(back[k], host[k]) and back[k].dtype == host[k].dtype for k in host)


def test_build_names_a_missing_slice_and_fill_a_gap_or_misfit():
    host, sh, abstract = _tree()
    parts = slices_for(0, host, sh, abstract)
    with pytest.raises(ValueError, match="no slice .* of leaf 2"):
        build([p for p in parts if p[0] != 2], sh, abstract)
    shards = local_shards(build(parts, sh, abstract))
    with pytest.raises(ValueError, match="leaf 2 of shape .8, 6.: shards cover 42 of 48"):  # leaves: b, n, w
        fill([p for p in shards if p[:2] != (2, ((0, 2), (0, 3)))], abstract)
    leaf, b, (a,) = shards[0]
    with pytest.raises(ValueError, match="shape"):
        fill([(leaf, b, [a[:1]])] + shards[1:], abstract)
    with pytest.raises(ValueError, match="overlaps the one at"):  # one shard twice
        fill([shards[-1], *shards], abstract)
    with pytest.raises(ValueError, match="the tree has 3 leaves"):  # a leaf that is not there
        fill([(7, b, [a])], abstract)


def _pair():
    cfg = transport_config("mh-node", "mh", io_timeout=5.0)  # a node's processes share its identity
    lead = NetNode(cfg)
    follower = connect(cfg, lead.address, "c", expect="mh-node", timeout=5)
    return lead, lead.accept("c", peer="mh-node", timeout=5), follower


def test_parts_cross_a_connection_and_bad_ones_are_refused():
    lead, a, b = _pair()
    try:
        parts = [(0, ((0, 2), (1, 3)), [np.arange(4, dtype=np.float32).reshape(2, 2)]),
                 (3, (), [np.asarray(5, np.int32), np.ones(3, jnp.bfloat16)])]
        send_parts(b, parts)
        got = recv_parts(a, max_bytes=100)
        assert [(leaf, bounds) for leaf, bounds, _ in got] == [(0, ((0, 2), (1, 3))), (3, ())]
        for (_, _, x), (_, _, y) in zip(parts, got):
            assert all(np.array_equal(u, v) and u.dtype == v.dtype for u, v in zip(x, y))
        send_parts(b, parts)
        with pytest.raises(FrameError, match="more than the 10 bytes"):
            recv_parts(a, max_bytes=10)
    finally:
        a.close(), b.close(), lead.close()
    lead, a, b = _pair()
    try:
        send_parts(b, [(0, (), [np.zeros(2, np.float64)])])
        with pytest.raises(FrameError, match="dtype 'float64' refused"):
            recv_parts(a, max_bytes=100)
        recv_array_data(a, [(np.dtype(np.float64), (2,))])  # (what the refused header announced)
        # part lists that do not describe the arrays that follow: refused before any is read
        one = [np.zeros(2, np.float32)]
        for layout in (None, [[0, [], 2]], [[-1, [], 1]], [[0, [[2, 1]], 1]], [[0, [[0, 1, 2]], 1]],
                       [[True, [], 1]], [[0, [], 1], [1, [], 1]], [[0, "x", 1]]):
            send_arrays(b, one, {"parts": layout})
            with pytest.raises(FrameError, match="malformed part list"):
                recv_parts(a, max_bytes=100)
            recv_array_data(a, [(np.dtype(np.float32), (2,))])
        send_parts(b, [(0, (), one * 2)])
        with pytest.raises(FrameError, match="malformed part list"):  # a pseudo-gradient part is codes + scales
            recv_parts(a, max_bytes=100, per_part=1)
    finally:
        a.close(), b.close(), lead.close()


def test_a_follower_refuses_lead_messages_of_the_wrong_form():
    from wire_fuzz import pair  # (framed connections over a socketpair; fuzzed messages: test_meta_schema.py)

    lead_conn, f_conn = pair("follower", "the node's lead process")
    follower = Follower(None, None, f_conn)  # type: ignore[arg-type]
    try:
        for msg, why in (({"op": "stop"}, "malformed answer within a train: op: Input should be 'go'"),
                         ({"op": "go", "stop": 1}, "stop: Input should be a valid boolean"),
                         ({"op": "go"}, "stop: Field required"), ({"op": "go", "stop": True, "x": 1}, "x: Extra")):
            send_msg(lead_conn, msg)
            with pytest.raises(FrameError, match=f"the node's lead process: .*{why}"):
                follower._lead_stops()
        send_msg(lead_conn, {"op": "go", "stop": True})
        assert follower._lead_stops() is True
        for msg, why in (({"op": "train", "until": "3", "asks": False}, "train.until: Input should be a valid integer"),
                         ({"op": "train", "until": True, "asks": False}, "train.until"),
                         ({"op": "train", "until": 3.0, "asks": False}, "train.until"),
                         ({"op": "fly"}, "Input tag 'fly' found using 'op' does not match"),
                         ({"op": "lease", "ranges": []}, "lease.ranges: List should have at least 1 item"),
                         ({"op": "lease", "ranges": [[4, 2]]}, "lease.ranges: Value error, not ascending disjoint"),
                         ({"op": "lease", "ranges": [[0, 4], [3, 6]]}, "not ascending disjoint"),
                         ({"op": "lease", "ranges": [[0, -1]]}, "lease.ranges.0.1: Input should be greater"),
                         ({"until": 3}, "Unable to extract tag using discriminator 'op'")):
            send_msg(lead_conn, msg)
            with pytest.raises(FrameError, match=f"malformed command: .*{why}"):
                follower.run()
    finally:
        f_conn.close(), lead_conn.close()


TINY = [*TINY_ARGS, "--data.batch_size", "8", "--run.log_every", "1", "--run.no-progress"]


def _node(base, env, node, *, run, n=1, more=()):
    """Node ``node``'s processes under run name ``run``: 1 process x 8 CPU devices, or ``n``
    processes x 4 (one JAX runtime) named "run.i"; each one's output on its stdout pipe."""
    cmd = [*base, "--run.name", run, "--diloco.node_id", node, *more]
    if n == 1:
        dist, names = [[]], [run]
    else:
        port = free_port()
        dist = [["--dist.coordinator_address", f"127.0.0.1:{port}", "--dist.num_processes", str(n),
                 "--dist.process_id", str(i)] for i in range(n)]
        names = [f"{run}.{i}" for i in range(n)]
    penv = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // n}")
    return {k: subprocess.Popen([*cmd, *d], cwd=ROOT, env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for k, d in zip(names, dist)}


def _until(proc, text, seen="", times=1):
    """``proc``'s output read up to its ``times``-th line holding ``text``; all of it so far."""
    while seen.count(text) < times:
        line = proc.stdout.readline()
        assert line, seen[-2000:]
        seen += line
    return seen


def _rows(tmp_path, name):
    return rows(tmp_path / "runs" / name)


@pytest.mark.processes
def test_a_two_process_node_shares_one_history_loses_a_process_and_joins_again_late(tmp_path, cache_dir):
    """One run (`outer` outer steps of H inner steps) of node a, 2 processes x 4 CPU devices (one
    jax.distributed runtime), and node b, 1 process x 8 devices, in two parts:

    1. a and b found the run together (the coordinator waits for 2 nodes) from the seeded state,
       each of a's processes making its own shards. After two outer steps beside b, SIGKILL of
       a's second process: a's lead exits non-zero within the runtime's heartbeat timeout (no
       hang), and b carries on alone; b ends that job after outer step S.
    2. a, started again with no state (run directory a2), registers while nobody holds the
       state; then b resumes from its checkpoint, so a is admitted at b's first boundary
       whatever the machine's speed: it receives b's state of outer step S + 1 (its lead
       restores it and hands each process its slices, optimizer state included) and trains
       beside b to the run's end; every process of this part exits 0.

    Shows: every outer step has one hash on every node that ran it (the 2-process node's from
    the first step on), the loss falls on both nodes, and a's lead evaluates and checkpoints for
    the node: its last checkpoint holds the run's final state and every process's data position.
    Both nodes lease their data from the coordinator (the 2-process node's processes each read
    their rows of its leased batches): every unit that made it is trained once, none is left out."""
    import signal
    import time

    H, S, outer = 4, 4, 7
    # (the boundary timeout only backs up the evictions the test expects, which are for lost
    # connections: under load a's two processes may take tens of seconds to sync once registered,
    # or once they received the state, while b reaches each boundary of 4 tiny steps in a second)
    port, env = free_port(), dict(coord_env("a", "b"), JAX_PLATFORMS="cpu")
    coord = subprocess.Popen([sys.executable, "-m", "intellect_jax.coordinator", "--host", "127.0.0.1", "--port",
                              str(port), "--min-nodes", "2", "--heartbeat-timeout", "5", "--boundary-timeout", "90",
                              "--journal", str(tmp_path / "coordinator.journal")],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = [sys.executable, "-m", "intellect_jax.train", "--config", "configs/debug_diloco.toml", *TINY,
            "--run.out_dir", str(tmp_path / "runs"), "--data.cache_dir", cache_dir,
            "--run.steps", str(H * outer), "--diloco.inner_steps", str(H), "--diloco.coordinator",
            f"127.0.0.1:{port}", "--diloco.leases", "--diloco.unit_steps", "2", "--diloco.heartbeat_interval", "1",
            "--run.eval_every", str(3 * H), "--ckpt.every", str(3 * H), "--ckpt.keep", "10"]
    # (a's JAX runtime ends its lead within 10 s of losing the follower)
    first = _node(base, env, "a", run="a", n=2, more=["--dist.heartbeat_timeout", "10"])
    first |= _node(base, env, "b", run="b", more=["--run.stop_at", str(S * H)])
    late: dict[str, subprocess.Popen] = {}
    try:  # 1. a and b from the seeded state; a loses a process
        seen_a = _until(first["a.0"], "nodes), loss", times=2)  # two outer steps beside b
        first["a.1"].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        out_a = seen_a + first["a.0"].communicate(timeout=120)[0]
        a_exit_s = time.monotonic() - t0
        out_b = first["b"].communicate(timeout=300)[0]
        assert first["a.0"].returncode != 0 and a_exit_s < 60, (a_exit_s, out_a[-2000:])
        assert first["b"].returncode == 0, out_b[-3000:]
        # 2. a again, with no state: a joiner while nobody holds the state, until b resumes
        late |= _node(base, env, "a", run="a2", n=2)
        seen_a = _until(late["a2.0"], "registered as joiner")
        late |= _node(base, env, "b", run="b", more=["--ckpt.resume"])
        outs = {k: p.communicate(timeout=300)[0] for k, p in late.items()}
        outs["a2.0"] = seen_a + outs["a2.0"]
    finally:
        for p in [*first.values(), *late.values(), coord]:
            p.kill()
        coord.communicate()
    bad = {k: o[-2500:] for k, o in outs.items() if late[k].returncode != 0}
    assert not bad, bad
    for out in (out_a, outs["a2.0"]):
        assert "pseudo-gradient made on the devices" in out, out[-1000:]
    assert f"receiving the state of outer step {S + 1} from b" in outs["a2.0"], outs["a2.0"][-2000:]
    assert "followed" in outs["a2.1"], outs["a2.1"][-500:]
    ra, ra2, rb = _rows(tmp_path, "a"), _rows(tmp_path, "a2"), _rows(tmp_path, "b")
    ha, ha2, hb = hashes(ra), hashes(ra2), hashes(rb)
    # b ran every outer step: with a, alone once a lost its process, with a again from S + 2 on
    assert sorted(hb) == list(range(1, outer + 1)) and hb == one_history([ra, ra2, rb]), (ha, ha2, hb)
    nodes = {r["outer_step"]: r["nodes"] for r in rb if "outer_hash" in r}
    assert nodes[1] == nodes[2] == 2 and nodes[S] == nodes[S + 1] == 1, nodes
    assert all(nodes[k] == 2 for k in range(S + 2, outer + 1)), nodes
    # (rows land once the next barrier confirms them) a's first life from the first step on,
    # its second from the step after the one it received on
    assert ha and min(ha) == 1 and max(ha) < S and sorted(ha2) == list(range(S + 2, outer + 1)), (ha, ha2)
    for r in (ra + ra2, rb):
        loss = [x["loss"] for x in r if "loss" in x]
        assert np.mean(loss[-H:]) < np.mean(loss[:H]) - 0.3, loss
    assert {r["outer_step"] for r in ra2 if "val_loss" in r} == {6, outer}
    # a's lead checkpointed the state it received, outer step 6 and the run's final state,
    # with every process's data position
    from intellect_jax.trainer.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "runs" / "a2" / "ckpt", every=0, keep=10)
    try:
        assert ck.all_steps() == [(S + 1) * H, 6 * H, outer * H]
        assert ck.restore_json("meta")["outer_hash"] == hb[outer]
        per = ck.restore_json("data")["processes"]  # both processes read the node's last lease, all of it
        assert len(per) == 2 and per[0]["plan"] == per[1]["plan"] and per[0]["step"] == per[1]["step"] == H, per
    finally:
        ck.close()
    # the data: each leased unit trained once by the nodes whose contributions made it
    from intellect_jax.coordinator.journal import Journal

    led = Journal(tmp_path / "coordinator.journal").load_any().leases
    st = led.status()
    assert led.problems() == [] and st["duplicates"] == 0 and st["units_outstanding"] == 0, st
    assert st["units_trained"] == sum(nodes[k] for k in range(1, outer + 1)) * H // 2, (st, nodes)


class Steps:
    """A trainer that only counts steps, with `Trainer.train`'s stop rule (asked before each step)."""

    def __init__(self) -> None:
        self.step = 0

    def train(self, until, stop=None):
        while self.step < until and not (stop is not None and stop()):
            self.step += 1
        return {"step": self.step}


def test_followers_stop_where_the_lead_stops():
    cfg = transport_config("mh-node", "mh", io_timeout=5.0)
    net = NetNode(cfg)
    mine, theirs = Steps(), Steps()
    f_conn = connect(cfg, net.address, "c", expect="mh-node", timeout=5)
    followers = Followers.__new__(Followers)  # (one follower, connected by hand: no JAX runtime here)
    followers.conns = {1: net.accept("c", peer="mh-node", timeout=5)}
    follower = Follower(theirs, None, f_conn)  # type: ignore[arg-type]
    served: list[int] = []
    th = threading.Thread(target=lambda: served.append(follower.run()), daemon=True)
    th.start()
    lead = LeadInner(mine, None, followers)  # type: ignore[arg-type]
    try:
        # the follower cannot see the lead's stop(): it stops at the lead's answers alone
        asked: list[int] = []
        assert lead.train(10, stop=lambda: asked.append(mine.step) or mine.step >= 4) == {"step": 4}
        assert asked == [0, 1, 2, 3, 4]
        assert lead.train(10, stop=lambda: True) == {"step": 4}  # stops before any step
        assert lead.train(6) == {"step": 6}  # no stop: no per-step answers
        assert lead.train(12, stop=lambda: False) == {"step": 12}  # until first: stop() not asked at 12
    finally:
        followers.close()  # "stop": the follower returns
        th.join(timeout=10)
        f_conn.close(), net.close()
    assert served == [4] and theirs.step == 12
