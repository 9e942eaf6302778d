"""A DiLoCo node of several processes: the shard plumbing and the lead's stop() in process, and
real runs of a node of 2 processes x 4 CPU devices beside a node of 1 process x 8 devices."""

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
                         ({"until": 3}, "Unable to extract tag using discriminator 'op'")):
            send_msg(lead_conn, msg)
            with pytest.raises(FrameError, match=f"malformed command: .*{why}"):
                follower.run()
    finally:
        f_conn.close(), lead_conn.close()


TINY = [*TINY_ARGS, "--data.batch_size", "8", "--run.log_every", "1", "--run.no-progress"]


def _run(tmp_path, nodes, *, min_nodes, H, outer, more=()):
    """A coordinator and the given nodes ({name: (processes, devices each, extra args)}) to the end;
    returns every process's output by "name" / "name.i"."""
    port = free_port()
    env = dict(coord_env(*nodes), JAX_PLATFORMS="cpu")
    coord = subprocess.Popen([sys.executable, "-m", "intellect_jax.coordinator", "--host", "127.0.0.1", "--port",
                              str(port), "--min-nodes", str(min_nodes), "--heartbeat-timeout", "60",
                              "--journal", str(tmp_path / "coordinator.journal")], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = [sys.executable, "-m", "intellect_jax.train", "--config", "configs/debug_diloco.toml", *TINY,
            "--run.out_dir", str(tmp_path / "runs"), "--data.cache_dir", str(tmp_path / "cache"),
            "--run.steps", str(H * outer), "--diloco.inner_steps", str(H), "--diloco.coordinator",
            f"127.0.0.1:{port}", "--diloco.data_ranks", str(len(nodes)), *more]
    procs = {}
    for rank, (name, (n, devices, extra)) in enumerate(nodes.items()):
        cmd = [*base, "--run.name", name, "--diloco.node_id", name, "--diloco.data_rank", str(rank), *extra]
        dist = str(free_port())
        for i in range(n):
            d = ["--dist.coordinator_address", f"127.0.0.1:{dist}", "--dist.num_processes", str(n),
                 "--dist.process_id", str(i)] if n > 1 else []
            procs[f"{name}.{i}" if n > 1 else name] = subprocess.Popen(
                [*cmd, *d], cwd=ROOT, env=dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        outs = {k: p.communicate(timeout=540)[0] for k, p in procs.items()}
    finally:
        for p in [*procs.values(), coord]:
            p.kill()
        coord.communicate()
    bad = {k: o[-2500:] for k, o in outs.items() if procs[k].returncode != 0}
    assert not bad, bad
    return outs


def _rows(tmp_path, name):
    return rows(tmp_path / "runs" / name)


@pytest.mark.slow
def test_two_process_node_and_one_process_node_share_one_history(tmp_path):
    """Node a: 2 processes x 4 devices (jax.distributed); node b: 1 process x 8 devices. Every outer
    step has one hash on both, the loss falls, a's lead checkpoints and evaluates for the node."""
    H, outer = 4, 6
    outs = _run(tmp_path, {"a": (2, 4, []), "b": (1, 8, [])}, min_nodes=2, H=H, outer=outer,
                more=["--run.eval_every", str(3 * H), "--ckpt.every", str(3 * H)])
    assert "pseudo-gradient made on the devices" in outs["a.0"] and "followed" in outs["a.1"], outs["a.1"][-500:]
    ra, rb = _rows(tmp_path, "a"), _rows(tmp_path, "b")
    ha, hb = hashes(ra), hashes(rb)
    assert sorted(ha) == list(range(1, outer + 1)) and ha == hb == one_history([ra, rb]), (ha, hb)
    for r in (ra, rb):
        loss = [x["loss"] for x in r if "loss" in x]
        assert np.mean(loss[-H:]) < np.mean(loss[:H]) - 0.3, loss
    assert {r["outer_step"] for r in ra if "val_loss" in r} == {3, 6}
    # the lead's checkpoint of the last outer step holds the run's final state, every process's data position
    from intellect_jax.trainer.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "runs" / "a" / "ckpt", every=0, keep=10)
    try:
        assert ck.all_steps() == [3 * H, 6 * H]
        assert ck.restore_json("meta")["outer_hash"] == ha[outer]
        assert len(ck.restore_json("data")["processes"]) == 2
    finally:
        ck.close()


@pytest.mark.slow
def test_a_late_two_process_node_takes_the_live_state_then_loses_a_process(tmp_path):
    """b founds the run alone and ends that job after outer step 2; a (2 processes x 4 devices)
    registers while nobody holds the state, then b resumes from its checkpoint, so a joins after
    outer step 2 whatever the machine's speed:
    it receives b's state (its lead restores it and hands each process its slices, optimizer
    state included) and trains beside b with b's hashes. Then SIGKILL of a's second process:
    a's lead exits non-zero within the runtime's heartbeat timeout (no hang), and b, alone
    again, finishes the run."""
    import signal
    import time

    H, outer = 4, 14
    port, dist = free_port(), free_port()
    env = dict(coord_env("a", "b"), JAX_PLATFORMS="cpu")
    coord = subprocess.Popen([sys.executable, "-m", "intellect_jax.coordinator", "--host", "127.0.0.1", "--port",
                              str(port), "--min-nodes", "1", "--heartbeat-timeout", "5", "--boundary-timeout", "20",
                              "--journal", str(tmp_path / "coordinator.journal")],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = [sys.executable, "-m", "intellect_jax.train", "--config", "configs/debug_diloco.toml", *TINY,
            "--run.out_dir", str(tmp_path / "runs"), "--data.cache_dir", str(tmp_path / "cache"),
            "--run.steps", str(H * outer), "--diloco.inner_steps", str(H), "--diloco.coordinator",
            f"127.0.0.1:{port}", "--diloco.data_ranks", "2", "--diloco.heartbeat_interval", "1"]

    def until(proc, text, seen="", times=1):
        while seen.count(text) < times:
            line = proc.stdout.readline()
            assert line, seen[-2000:]
            seen += line
        return seen

    b = [*base, "--run.name", "b", "--diloco.node_id", "b", "--diloco.data_rank", "1"]
    b_env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    first = subprocess.run([*b, "--run.stop_at", str(2 * H)], cwd=ROOT, env=b_env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    procs = {f"a.{i}": subprocess.Popen(
        [*base, "--run.name", "a", "--diloco.node_id", "a", "--diloco.data_rank", "0",
         "--dist.coordinator_address", f"127.0.0.1:{dist}", "--dist.num_processes", "2", "--dist.process_id", str(i),
         "--dist.heartbeat_timeout", "10"], cwd=ROOT, env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)}
    try:
        seen_a = until(procs["a.0"], "registered as joiner")
        procs["b"] = subprocess.Popen([*b, "--ckpt.resume"], cwd=ROOT, env=b_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
        seen_a = until(procs["a.0"], "nodes), loss", seen_a, times=2)  # joined, and two outer steps beside b
        procs["a.1"].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        out_a = seen_a + procs["a.0"].communicate(timeout=120)[0]
        a_exit_s = time.monotonic() - t0
        out_b = procs["b"].communicate(timeout=300)[0]
    finally:
        for p in [*procs.values(), coord]:
            p.kill()
        coord.communicate()
    assert "receiving the state of outer step" in out_a, out_a[-2000:]
    assert procs["a.0"].returncode != 0 and a_exit_s < 60, (a_exit_s, out_a[-2000:])
    assert procs["b"].returncode == 0, out_b[-3000:]
    ha, hb = hashes(_rows(tmp_path, "a")), hashes(_rows(tmp_path, "b"))
    assert sorted(hb) == list(range(1, outer + 1)) and ha and min(ha) >= 3, (ha, hb)  # rows land once the next barrier confirms them
    assert all(hb[k] == h for k, h in ha.items()), (ha, hb)


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
