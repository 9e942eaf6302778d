"""Elastic DiLoCo: outer optimizer and hash units; whole runs through the launcher (slow)."""

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time

import numpy as np
import optax
import pytest

from intellect_jax.diloco import outer as O

# ---------------------------------------------------------------------------- units


def test_numpy_nesterov_matches_optax():
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(5, 3)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
    ours, ref = O.nesterov_sgd(0.7, 0.9), optax.sgd(0.7, momentum=0.9, nesterov=True)
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
    tx = O.nesterov_sgd(1.0, 0.0)
    outer = O.init_outer({"w": np.ones(4, np.float32)}, tx)
    inner = {"w": np.full(4, 0.25, np.float32)}
    pg = O.pseudo_gradient(outer, inner)
    np.testing.assert_array_equal(pg["w"], 0.75)
    new = O.outer_step(outer, pg, tx)  # lr 1, no momentum: outer jumps to the inner params
    np.testing.assert_array_equal(new.params["w"], inner["w"])
    assert new.step == 1


def test_state_hash_sees_every_bit():
    tx = O.nesterov_sgd(0.7, 0.9)
    a = O.init_outer({"w": np.linspace(0, 1, 10, dtype=np.float32)}, tx)
    h = O.state_hash(a)
    assert h == O.state_hash(O.init_outer({"w": np.linspace(0, 1, 10, dtype=np.float32)}, tx))
    w = a.params["w"].copy()
    w.view(np.uint32)[3] ^= 1  # one ulp
    assert O.state_hash(a._replace(params={"w": w})) != h
    assert O.state_hash(a._replace(step=1)) != h
    m = {"w": np.zeros(10, np.float32)}
    m["w"][0] = 1e-30
    assert O.state_hash(a._replace(opt_state=O.MomentumState(m))) != h


# ---------------------------------------------------------------------------- whole runs

TINY = ["--run.steps", "20", "--diloco.inner_steps", "5", "--model.num_layers", "2",
        "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.ffn_size", "128", "--data.seq_len", "32", "--data.bpe_vocab_size", "1024",
        "--run.eval_every", "0", "--run.log_every", "1", "--ckpt.every", "0"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, *args, port=None, env=None):
    cmd = [sys.executable, "-m", "intellect_jax.launch", "--config", "configs/debug_diloco.toml",
           "--out-dir", str(tmp_path / "runs"), "--table-every", "0", "--timeout", "500",
           *(["--port", str(port)] if port else []), *TINY, *args,
           "--data.cache_dir", str(tmp_path / "cache")]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen(cmd, cwd=root, env=env or dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _outer_rows(tmp_path, node):
    path = tmp_path / "runs" / "debug_diloco" / node / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    return [r for r in rows if "outer_hash" in r], [r for r in rows if "loss" in r]


def _check_hashes(tmp_path, nodes):
    by_step: dict[int, set] = {}
    for n in nodes:
        for r in _outer_rows(tmp_path, n)[0]:
            by_step.setdefault(r["outer_step"], set()).add(r["outer_hash"])
    assert by_step and all(len(h) == 1 for h in by_step.values()), by_step
    return by_step


@pytest.mark.slow
def test_three_nodes_survive_a_node_killed_inside_an_all_reduce(tmp_path):
    p = _launch(tmp_path, "--nodes", "3", "--kill", "node2@2")
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    assert "chaos: SIGKILL inside the all-reduce of outer step 2" in out
    assert re.search(r"\[node[01]\] all-reduce of outer step 2 failed in epoch 1", out), out[-3000:]
    steps = _check_hashes(tmp_path, ["node0", "node1"])
    assert sorted(steps) == [1, 2, 3, 4]
    for n in ("node0", "node1"):
        outer, inner = _outer_rows(tmp_path, n)
        assert [r["nodes"] for r in outer] == [3, 2, 2, 2]
        assert outer[1]["allreduce_tries"] == 2 and outer[1]["epoch"] > outer[0]["epoch"]
        assert inner[-1]["loss"] < inner[0]["loss"] - 1.0  # loss falls
        assert all(0 < r["utilization"] <= 1 and r["bytes_sent"] > 0 for r in outer)
    # the killed node got through outer step 1 with the same hash
    assert _outer_rows(tmp_path, "node2")[0][0]["outer_hash"] == steps[1].copy().pop()


@pytest.mark.slow
def test_join_coordinator_restart_and_refused_nodes(tmp_path):
    port = _free_port()
    secret = secrets.token_hex(32)
    env = dict(os.environ, INTELLECT_NET_SECRET=secret)
    p = _launch(tmp_path, "--nodes", "2", "--join", "node2@1", "--kill-coordinator", "3", "--run.steps", "30",
                port=port, env=env)
    # once the run is going: a node with the wrong secret and one with another model are refused
    from intellect_jax.diloco.client import coordinator_status
    from intellect_jax.net.transport import TransportConfig

    tcfg = TransportConfig(run_id="intellect-jax", secret=secret.encode())
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if coordinator_status(f"127.0.0.1:{port}", tcfg, timeout=2)["outer_step"] >= 1:
                break
        except Exception:
            pass
        time.sleep(0.5)
    base = [sys.executable, "-m", "intellect_jax.train", "--config", "configs/debug_diloco.toml",
            "--diloco.coordinator", f"127.0.0.1:{port}", "--run.out_dir", str(tmp_path / "bad"),
            *TINY, "--data.cache_dir", str(tmp_path / "cache")]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = [
        subprocess.Popen(base + ["--diloco.node_id", "intruder"], cwd=root, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=dict(env, INTELLECT_NET_SECRET=secrets.token_hex(32))),
        subprocess.Popen(base + ["--diloco.node_id", "other", "--model.num_layers", "3"], cwd=root,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
    ]
    (_, err_secret), (_, err_model) = [b.communicate(timeout=300) for b in bad]
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-3000:]
    assert [b.returncode for b in bad] == [2, 2], (err_secret[-500:], err_model[-500:])
    assert "secret" in err_secret.lower() or "auth" in err_secret.lower(), err_secret[-500:]
    assert "fingerprint" in err_model, err_model[-500:]
    assert "SIGKILL coordinator" in out and "resumed member" in out
    steps = _check_hashes(tmp_path, ["node0", "node1", "node2"])
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    joiner, _ = _outer_rows(tmp_path, "node2")
    first = joiner[0]["outer_step"]
    assert first >= 2 and joiner[0]["nodes"] == 3
    assert joiner[0]["outer_hash"] in steps[first]
    # the donor kept training while it streamed the state: inner steps logged inside the window
    m = re.search(r"\[(node\d)\] served node2: .* \(wall ([\d.]+) -> ([\d.]+)\)", out)
    assert m, out[-3000:]
    donor, t0, t1 = m.group(1), float(m.group(2)), float(m.group(3))
    _, inner = _outer_rows(tmp_path, donor)
    during = [r["step"] for r in inner if t0 <= r["time"] <= t1]
    assert during, (t0, t1, [(r["step"], r["time"]) for r in inner])


@pytest.mark.slow
def test_whole_run_restart_resumes_from_checkpoints(tmp_path):
    first = _launch(tmp_path, "--nodes", "2", "--run.stop_at", "10")
    out1 = first.communicate(timeout=600)[0]
    assert first.returncode == 0, out1[-3000:]
    before = {n: _outer_rows(tmp_path, n)[0] for n in ("node0", "node1")}
    assert [r["outer_step"] for r in before["node0"]] == [1, 2]
    # new nodes of another run dir start from node0's checkpoint on "shared storage"
    shared = _launch(tmp_path, "--nodes", "2", "--run.name", "shared",
                     "--diloco.init_from", str(tmp_path / "runs" / "debug_diloco" / "node0"))
    out = shared.communicate(timeout=600)[0]
    assert shared.returncode == 0, out[-3000:]
    assert out.count("loaded the checkpoint of step 10 (outer step 2)") == 2
    rows = [[json.loads(l) for l in (tmp_path / "runs" / "shared" / n / "metrics.jsonl").read_text().splitlines()]
            for n in ("node0", "node1")]
    hashes = [[(r["outer_step"], r["outer_hash"]) for r in rs if "outer_hash" in r] for rs in rows]
    assert hashes[0] == hashes[1] and [k for k, _ in hashes[0]] == [3, 4]
    second = _launch(tmp_path, "--nodes", "2", "--ckpt.resume")
    out2 = second.communicate(timeout=600)[0]
    assert second.returncode == 0, out2[-3000:]
    assert out2.count("as resumed member") == 2
    assert "registered with" in out2 and "as member at outer step 2" in out2
    steps = _check_hashes(tmp_path, ["node0", "node1"])
    assert sorted(steps) == [1, 2, 3, 4]
    _, inner = _outer_rows(tmp_path, "node0")
    assert [r["step"] for r in inner if r["step"] > 10][:1] == [11]  # the inner steps carried on
