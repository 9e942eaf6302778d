"""A run on the open internet: strangers flooding the listeners, nodes sending broken or
poisoned pseudo-gradients, and the client commands' errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.coordinator.server import Coordinator
from intellect_jax.testing.local import NumpyInner
from intellect_jax.diloco.loop import NodeLoop
from intellect_jax.diloco.parts import LoopConfig, NodeParts, Outcome
from intellect_jax.coordinator.protocol import CoordinatorConfig
from intellect_jax.testing.sim import Script, Sim, SimParams
from intellect_jax.testing.sim_parts import Fault
from intellect_jax.diloco.state import state_hash
from intellect_jax.diloco.store import MemoryStore
from intellect_jax.diloco.transfer import NetTransport
from intellect_jax.net.comm import NetNode, RingConfig
from intellect_jax.net.identity import KEYS_ENV, Authority
from intellect_jax.testing.identities import credentials, keys_dir, transport_config

from helpers import TINY_ARGS, expire, free_port, socket_run

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# strangers: no pre-authentication lock-out
# ---------------------------------------------------------------------------------------------
class Attack:
    """One address holding ``idle`` connections open (renewed as they are dropped), another
    flooding random bytes, and 40 addresses of another network holding 8 connections each that
    sent one byte, against every port in ``ports``."""

    def __init__(self, ports: list[int], idle: int = 500) -> None:
        self.ports, self.idle, self.stop = ports, idle, threading.Event()
        self.opened = self.flooded = self.one_byte = 0
        self.threads = [threading.Thread(target=self._hold, daemon=True),
                        threading.Thread(target=self._flood, daemon=True),
                        threading.Thread(target=self._one_byte, daemon=True)]

    @staticmethod
    def _connect(src: str, port: int) -> socket.socket | None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST, no TIME_WAIT
        s.bind((src, 0))
        s.settimeout(1.0)
        try:
            s.connect(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
            return None

    def _hold(self) -> None:
        held: list[socket.socket] = []
        while not self.stop.is_set():
            for s in held:
                s.close()
            held = []
            for i in range(self.idle):
                s = self._connect("127.0.0.2", self.ports[i % len(self.ports)])
                if s is not None:
                    held.append(s)
                    self.opened += 1
            self.stop.wait(1.0)
        for s in held:
            s.close()

    def _one_byte(self) -> None:
        """127.0.2.10-49 (one /24), 8 connections each, each one byte into its TLS hello."""
        held: list[socket.socket] = []
        while not self.stop.is_set():
            for s in held:
                s.close()
            held = []
            for a in range(10, 50):
                for i in range(8):
                    s = self._connect(f"127.0.2.{a}", self.ports[i % len(self.ports)])
                    if s is not None:
                        try:
                            s.sendall(b"\x16")
                            held.append(s)
                            self.one_byte += 1
                        except OSError:
                            s.close()
            self.stop.wait(1.0)
        for s in held:
            s.close()

    def _flood(self) -> None:
        rng = np.random.default_rng(0)
        while not self.stop.is_set():
            for port in self.ports:
                s = self._connect("127.0.0.3", port)
                if s is not None:
                    try:
                        s.sendall(rng.integers(0, 256, 512, dtype=np.uint8).tobytes())
                    except OSError:
                        pass
                    s.close()
                    self.flooded += 1

    def __enter__(self) -> Attack:
        for t in self.threads:
            t.start()
        t0 = time.monotonic()  # the attack is in full swing before the run starts: a wave of each held
        while self.opened < 0.9 * self.idle or self.one_byte < 300 or self.flooded < 50:
            if time.monotonic() > t0 + 60:
                break
            time.sleep(0.05)
        self.at_start = (self.opened, self.flooded, self.one_byte)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def run_nodes(n: int, attack: bool) -> dict:
    """A coordinator and ``n`` nodes (numpy trainers, real sockets: authenticated transport,
    coordinator, int8 ring, state transport), optionally under attack on the coordinator's and
    node0's ports. Returns timings, evictions, hashes, and what the listeners turned away."""
    reg_s: list[float] = [0.0] * n

    def timed(i: int, client: CoordinatorClient) -> None:
        register = client.register

        def timed_register(*a, **kw):
            t0 = time.monotonic()
            try:
                return register(*a, **kw)
            finally:
                reg_s[i] = max(reg_s[i], time.monotonic() - t0)

        client.register = timed_register  # type: ignore[method-assign]

    attacks: list[Attack] = []

    def under_attack(coord: Coordinator, nets: list[NetNode]) -> Attack | None:
        if attack:
            attacks.append(Attack([coord.address[1], nets[0].address[1]]))
            return attacks[0]
        return None

    r = socket_run(n, "sec", RingConfig(deadline=30.0, piece_numel=1 << 12), client_hook=timed, during=under_attack)
    ctx = attacks[0] if attacks else None
    return {**r, "register_s": reg_s, "attack": (ctx.opened, ctx.flooded, ctx.one_byte) if ctx else None,
            "attack_at_start": ctx.at_start if ctx else None}


@pytest.mark.processes
def test_strangers_cannot_lock_members_out():
    """While 127.0.0.2 holds 500 idle connections, 127.0.0.3 floods random bytes and 40
    addresses of 127.0.2.0/24 hold 8 one-byte connections each at the coordinator's and node0's
    (ring and transfer) ports, 4 nodes register, train and all-reduce: no eviction, a few
    seconds of added latency at most."""
    base = run_nodes(4, attack=False)
    hit = run_nodes(4, attack=True)
    print(f"registration s (max): {max(base['register_s']):.3f} alone, {max(hit['register_s']):.3f} under attack; "
          f"run s: {base['wall_s']:.2f} alone, {hit['wall_s']:.2f} under attack; attack: {hit['attack']}; "
          f"refused by the coordinator: {hit['refused']}; by node0: {hit['node_refused']}")
    for r in (base, hit):
        assert r["outcomes"] == [Outcome.FINISHED] * 4, r["outcomes"]
        assert not r["evictions"] and len(r["hashes"]) == 1, (r["evictions"], r["hashes"])
    assert max(hit["register_s"]) <= max(base["register_s"]) + 3.0
    # (the attack's threads share this process and its two cores with the nodes: on a machine
    # loaded besides, CI's other test worker, they slow the run by more than the defence does:
    # 6.9 s alone, 12.4 s under attack there, against 5.7 and 6.6 s on a quiet one)
    assert hit["wall_s"] <= 2 * base["wall_s"] + 3.0
    opened, flooded, one_byte = hit["attack"]
    opened0, flooded0, one_byte0 = hit["attack_at_start"]
    # the attack ran all along: a whole wave of 500 idle and of 40 x 8 one-byte connections held as
    # the run started (a few connects may fail; how many later waves fit depends on the run's
    # speed and the machine's load), and the flood went on during the run
    assert opened0 >= 450 and one_byte0 >= 300 and flooded - flooded0 > 100, (hit["attack_at_start"], hit["attack"])
    for refused in (hit["refused"], hit["node_refused"]):
        assert refused.get("source over its handshake budget", 0) > 100, refused
        assert refused.get("network over its handshake budget", 0) > 100, refused


# ---------------------------------------------------------------------------------------------
# broken and poisoned pseudo-gradients (the in-process harness)
# ---------------------------------------------------------------------------------------------
POISON = {
    "clean": {},
    "own NaN (a broken host)": {"n1#0": [Fault("poison", 3, "poison", "own", value="nan")]},
    "own Inf, 3 rounds in a row": {"n1#0": [Fault("poison", s, "poison", "own", value="inf") for s in (4, 5, 6)]},
    "own x1000": {"n1#0": [Fault("poison", s, "poison", "own", value="x1000") for s in (2, 6)]},
    "sent NaN (malicious)": {"n2#0": [Fault("poison", s, "poison", "wire", value="nan") for s in (3, 8)]},
    "sent Inf": {"n2#0": [Fault("poison", s, "poison", "wire", value="inf") for s in (4, 5)]},
    "sent x1000": {"n2#0": [Fault("poison", s, "poison", "wire", value="x1000") for s in (5, 6, 7)]},
    "butterfly, sent NaN": {"n2#0": [Fault("poison", s, "poison", "wire", value="nan") for s in (3, 8)]},
    "butterfly, sent x1000": {"n2#0": [Fault("poison", s, "poison", "wire", value="x1000") for s in (5, 6, 7)]},
}


def poison_run(faults: dict, exchange: str = "ring") -> tuple[Sim, dict, float]:
    sim = Sim(0, SimParams(nodes=4, outer_steps=16, outer_lr=1.0, outer_momentum=0.0, exchange=exchange),
              script=Script(faults=faults))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN arithmetic on purpose
        report = sim.run()
    assert report["ok"], "\n".join(report["problems"] + report["log"][-60:])
    final = [row["val_loss"] for _, _, row in sim.rows if row["outer_step"] == 16 and "val_loss" in row]
    return sim, report, final[0]


def test_broken_and_poisoned_pseudo_gradients_never_reach_the_outer_state():
    results = {name: poison_run(faults, "butterfly" if name.startswith("butterfly") else "ring")
               for name, faults in POISON.items()}
    _, _, clean = results["clean"]
    for name, (sim, report, final) in results.items():
        log = "\n".join(report["log"])
        for _, _, row in sim.rows:  # every recorded outer state is finite
            assert np.isfinite(row["avg_norm"]) or row["skipped"], (name, row)
        assert final / clean - 1 <= 0.02, (name, final, clean)  # within 2% of the run without the fault
        if name.startswith("own"):
            assert "sitting out outer step" in log and "outer step 3 skipped" not in log, name
        if name.startswith("sent"):  # the ring's successor sees 1/N of it: the round is skipped, no more
            assert "skipped: the average has" in log, name
        if name == "butterfly, sent NaN":  # the owners see all of it, signed: the rows are dropped, and
            # two rounds of evidence evict n2
            assert "evicted n2: poisoned contributions: shown in 2 rounds with its own signed pieces" in log, name
        if name == "butterfly, sent x1000":  # outsized against the others' rows in every owner's segment:
            # its first round evicts it
            assert "evicted n2: steered the average: 3 of the 3 others showed its own pieces outsized" in log, name
    assert "evicted n1: its own pseudo-gradient checks failed at 3 barriers in a row" in "\n".join(
        results["own Inf, 3 rounds in a row"][1]["log"])


def test_without_the_checks_the_poison_gets_through(monkeypatch):
    """The same malicious run with the average check disabled: the outer state is damaged (so
    the test above can fail)."""
    from intellect_jax.diloco import loop as L
    from intellect_jax.diloco.guard import tree_norm

    monkeypatch.setattr(L, "check_average", lambda avg, history, cfg, scale=None: (tree_norm(avg), None))
    _, _, clean = poison_run({})
    with pytest.raises(AssertionError):  # NaN reaches the params: the final loss is NaN, or far off
        _, _, final = poison_run(POISON["sent x1000"])
        assert final / clean - 1 <= 0.02


# ---------------------------------------------------------------------------------------------
# client commands: one line, non-zero exit
# ---------------------------------------------------------------------------------------------
def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})}, cwd=ROOT)


def _finish(p: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.slow
def test_client_commands_fail_in_one_line(tmp_path):
    """Every command at once (they are independent; one after another costs the suite ~30 s):
    no keys, a missing keys directory, a foreign, revoked or expired certificate, an identity
    never issued, a coordinator that is not there."""
    dead = free_port()
    credentials("sec-node")
    good = {KEYS_ENV: str(keys_dir())}
    foreign = tmp_path / "foreign"
    Authority.init(foreign, "elsewhere")
    revoked = tmp_path / "revoked"
    Authority.init(revoked, "intellect-jax").revoke("operator")
    expired = tmp_path / "expired"
    expire(Authority.init(expired, "intellect-jax"), "operator")
    # a node whose coordinator is not there
    node = _start("intellect_jax.train", "--config", "configs/debug_diloco.toml", "--diloco.coordinator",
                  f"127.0.0.1:{dead}", "--run.out_dir", str(tmp_path / "runs"), "--run.steps", "10",
                  "--diloco.inner_steps", "5", *TINY_ARGS, "--data.cache_dir", str(tmp_path / "cache"),
                  "--diloco.node_id", "sec-node", "--diloco.register_timeout", "3",
                  env={**good, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    status = ("intellect_jax.coordinator", "--status")
    cases = [
        ((*status, f"127.0.0.1:{dead}"), good, "127.0.0.1"),
        ((*status, "127.0.0.1:1"), {KEYS_ENV: ""}, "no keys directory"),
        ((*status, "127.0.0.1:1", "--keys", str(tmp_path / "missing")), good, "missing: no such keys directory"),
        ((*status, "127.0.0.1:1", "--identity", "nobody"), good, "identity nobody: no certificate"),
        ((*status, "127.0.0.1:1", "--keys", str(revoked)), good, "identity operator is revoked"),
        ((*status, "127.0.0.1:1", "--keys", str(expired)), good, "operator.crt: certificate of operator expired"),
        (("intellect_jax.train", "--config", "configs/debug_diloco.toml", "--diloco.coordinator", "127.0.0.1:1",
          "--diloco.keys", str(foreign)), good, "holds 0 node identities"),
    ]
    with Coordinator(transport_config("coordinator", "intellect-jax")) as coord:  # live, and a foreign caller
        cases.append(((*status, coord.address_str, "--keys", str(foreign)), good, "certificate not of this run"))
        ok = _start(*status, coord.address_str, env=good)
        procs = [(args, needle, _start(*args, env=env)) for args, env, needle in cases]
        for args, needle, p in procs:
            r = _finish(p)
            err = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (
                args, r.returncode, r.stderr[-1500:])
        r = _finish(ok)
        assert r.returncode == 0 and '"outer_step"' in r.stdout, r.stderr[-1500:]
    r = _finish(node)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and f"127.0.0.1:{dead}" in err[0], (
        r.stderr[-1500:])
    assert "did not answer node" in err[0] and "registration for 3s" in err[0], err  # it waited, then gave up
    assert "waiting for coordinator" in r.stdout  # and said so when it started waiting
