"""Shared test helpers: the tiny model every trainer test uses (as a config and as CLI flags),
free ports, metrics rows and the one-history check, byte flipping of checkpoint files, the real
node trainer, whole DiLoCo runs of real trainers as threads in this process, launcher runs, and
coordinators (the membership with a manual clock, socket coordinators and clients, and the
``coordinator`` fixture, which conftest.py makes available to every test)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.coordinator.clock import RealClock
from intellect_jax.coordinator.journal import RunRecord
from intellect_jax.coordinator.membership import Membership
from intellect_jax.coordinator.protocol import PROTOCOL, CoordinatorConfig, Epoch, Resume
from intellect_jax.net.identity import COORDINATOR, KEYS_ENV
from intellect_jax.net.transport import TransportConfig
from intellect_jax.testing.identities import credentials, keys_dir, transport_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------------------- the tiny model

TINY_MODEL = {"preset": "debug", "hidden_size": 64, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "ffn_size": 128, "compute_dtype": "float32"}
TINY_DATA = {"seq_len": 32, "batch_size": 8, "bpe_vocab_size": 1024}

# the same model and data as command-line flags (the batch size is the config's own)
TINY_ARGS = [x for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_size")
             for x in (f"--model.{k}", str(TINY_MODEL[k]))] + [
    "--model.compute_dtype", TINY_MODEL["compute_dtype"],
    "--data.seq_len", str(TINY_DATA["seq_len"]), "--data.bpe_vocab_size", str(TINY_DATA["bpe_vocab_size"])]


def tiny_cfg(tmp_path, cache_dir, **sections):
    """A validated `TrainConfig` of the tiny model; ``sections`` override keys per section."""
    from intellect_jax import config as C

    raw = {
        "run": {"name": "t", "out_dir": str(tmp_path / "runs"), "steps": 12, "progress": False,
                "eval_batches": 2},
        "model": TINY_MODEL,
        "data": {**TINY_DATA, "cache_dir": cache_dir},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": 4},
        "ckpt": {"every": 6, "keep": 3, "async_save": True},
    }
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    return C.validate(raw)


def ref_loss(logits_BxLxV, targets_BxL, z_weight=0.0):
    """The plain reference the fused loss is checked against: from the whole logits array."""
    logits = logits_BxLxV.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
    ce, z = jnp.mean(lse - tgt), jnp.mean(jnp.square(jnp.max(logits, axis=-1)))
    return ce + z_weight * z, {"ce": ce, "z": z}


# ---------------------------------------------------------------------------- ports, rows, files


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(path) -> list[dict]:
    """The rows of a metrics.jsonl (a run directory or the file itself; [] when absent)."""
    p = Path(path)
    p = p / "metrics.jsonl" if p.is_dir() or not p.suffix else p
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def one_history(rows_of_nodes: Iterable[Iterable[dict]]) -> dict[int, str]:
    """Asserts one hash per outer step over every outer row of every node; returns step -> hash."""
    by_step: dict[int, set[str]] = {}
    for node_rows in rows_of_nodes:
        for r in node_rows:
            if "outer_hash" in r:
                by_step.setdefault(r["outer_step"], set()).add(r["outer_hash"])
    assert by_step and all(len(h) == 1 for h in by_step.values()), by_step
    return {k: next(iter(h)) for k, h in sorted(by_step.items())}


def hashes(node_rows: Iterable[dict]) -> dict[int, str]:
    """One node's outer step -> hash."""
    return {r["outer_step"]: r["outer_hash"] for r in node_rows if "outer_hash" in r}


def flip_bytes(directory) -> Path:
    """Damage a checkpoint: flip the middle byte of the largest file under ``directory``."""
    f = max((p for p in Path(directory).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    return f


# ---------------------------------------------------------------------------- real DiLoCo nodes in process


def loop_config(cfg):
    """The node's `LoopConfig`, as `DilocoNode` derives it from its config (and its pseudo-gradient path)."""
    from intellect_jax.diloco.node import loop_config, node_pg_path

    return loop_config(cfg, node_pg_path(cfg))


def ring_config(cfg):
    from intellect_jax.net.comm import RingConfig

    d = cfg.diloco
    return RingConfig(mode=d.mode, block_size=d.block_size, streams=d.streams, deadline=d.allreduce_deadline,
                      exchange=d.exchange, robust=d.robust)


def node_inner(cfg, trainer):
    """The `TrainerInner` a single-process `DilocoNode` runs (its pseudo-gradient path: the
    device path for overlapped rounds, the default on one process)."""
    from intellect_jax.diloco.inner import TrainerInner
    from intellect_jax.diloco.node import node_pg_path

    return TrainerInner(trainer, node_pg_path(cfg).build(cfg.diloco.block_size))


def node_trainer(cfg, *, rank: int = 0, count: int = 1, share: int | None = None):
    """A DiLoCo node's trainer as `DilocoNode` builds it: checkpoints, evaluations and resumes are
    the outer loop's (the `CheckpointStore`'s), not the trainer's. ``share``: one of that many
    nodes in this process, each on its own slice of the devices (two trainers running device
    programs with collectives from two threads on the same CPU devices can deadlock XLA's
    rendezvous: it aborts the process after 40 s)."""
    from intellect_jax.trainer.loop import Role, Trainer

    devices = None
    if share is not None and share > 1:
        per = len(jax.devices()) // share
        devices = jax.devices()[rank * per:(rank + 1) * per]
    return Trainer(cfg, node_rank=rank, node_count=count, role=Role.INNER, devices=devices)


class InProcessRun:
    """A whole DiLoCo run of real trainers in this process: nodes as threads running `NodeLoop`
    against an in-process coordinator (`LocalCoordinator`, journaled under ``run_dir`` so a
    "relaunch" resumes the run) over the in-process ring and state transport; each node's
    states go through its own orbax `CheckpointStore`. ``launch`` is one launch of the run."""

    def __init__(self, out_dir: Path, cache_dir: str, name: str, *, H: int, steps: int, ckpt_every: int = 0,
                 run_id: str = "in-process") -> None:
        self.out_dir, self.cache_dir, self.name, self.H, self.steps = Path(out_dir), cache_dir, name, H, steps
        self.ckpt_every, self.run_id = ckpt_every, run_id
        self.lines: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    @property
    def run_dir(self) -> Path:
        return self.out_dir / self.name

    def say(self, who: str, line: str) -> None:
        with self._lock:
            self.lines.append((who, line))

    def text(self, who: str | None = None) -> str:
        with self._lock:
            return "\n".join(f"[{w}] {x}" for w, x in self.lines if who is None or w == who)

    def rows(self, node: str) -> list[dict]:
        return rows(self.run_dir / node)

    def node_cfg(self, n: str, rank: int, count: int, *, stop_at: int | None = None, resume: bool = False,
                 init_from: str | None = None):
        """Node ``n``'s config, as the launcher's command line makes it (``stop_at``: outer steps)."""
        return tiny_cfg(self.out_dir, self.cache_dir,
                        run={"out_dir": str(self.out_dir), "name": f"{self.name}/{n}", "steps": self.steps,
                             "log_every": 1, "eval_every": 0,
                             "stop_at": stop_at * self.H if stop_at else None},
                        # (orbax keeps per-process state of async saves: nodes sharing a process save in turn)
                        ckpt={"every": self.ckpt_every, "resume": resume, "async_save": False},
                        diloco={"enabled": True, "inner_steps": self.H, "node_id": n, "data_rank": rank,
                                "data_ranks": count, "init_from": init_from})

    def launch(self, nodes: list[str], *, stop_at: int | None = None, resume: bool = False,
               init_from: str | None = None) -> dict[str, Any]:
        """Every node to its end (one coordinator "process" for the launch); returns the outcomes."""
        from intellect_jax.coordinator.client import CoordinatorClient
        from intellect_jax.coordinator.journal import Journal
        from intellect_jax.coordinator.protocol import CoordinatorConfig
        from intellect_jax.diloco.loop import NodeLoop
        from intellect_jax.diloco.parts import NodeParts
        from intellect_jax.diloco.store import CheckpointStore
        from intellect_jax.testing.local import LocalRing, LocalTransport
        from intellect_jax.testing.local_coordinator import LocalCoordinator

        cfgs = [self.node_cfg(n, i, len(nodes), stop_at=stop_at, resume=resume, init_from=init_from)
                for i, n in enumerate(nodes)]
        loop_cfg = loop_config(cfgs[0])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        coord = LocalCoordinator(CoordinatorConfig(min_nodes=len(nodes), join_window=0.0,
                                                   outer_steps=loop_cfg.outer_steps, heartbeat_timeout=30.0),
                                 run_id=self.run_id, journal=Journal(self.run_dir / "coordinator.journal"),
                                 on_event=lambda line: self.say("coord", line))
        rings, transport = LocalRing(ring_config(cfgs[0])), LocalTransport()
        trainers = [node_trainer(c, rank=i, count=len(nodes), share=len(nodes)) for i, c in enumerate(cfgs)]
        outcomes: dict[str, Any] = {}

        def node(i: int, n: str) -> None:
            client = CoordinatorClient(None, None, n, f"local://{n}", wire=coord.wire(n), heartbeat_interval=0.5,
                                       outer_steps=loop_cfg.outer_steps)
            store = CheckpointStore(trainers[i], resume=resume, init_from=init_from,
                                    warn=lambda line: self.say(n, line))
            parts = NodeParts(n, node_inner(cfgs[i], trainers[i]), client, rings, transport.endpoint(n), store,
                              log=lambda line: self.say(n, line))
            try:
                outcomes[n] = NodeLoop(loop_cfg, parts).run()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                outcomes[n] = e
            finally:
                client.close()

        threads = [threading.Thread(target=node, args=(i, n), name=n) for i, n in enumerate(nodes)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            assert not any(t.is_alive() for t in threads), self.text()[-4000:]
        finally:
            coord.crash()
            for t in trainers:
                t.close(save=False)
        for n, o in outcomes.items():
            if isinstance(o, BaseException):
                raise AssertionError(f"{n} failed: {o!r}\n{self.text()[-4000:]}") from o
        return outcomes


def node_parts(tmp_path, cache_dir, name="a", steps=12):
    """A real trainer of the tiny model (its own run directory) and its `TrainerInner`."""
    from intellect_jax.diloco.inner import TrainerInner

    t = node_trainer(tiny_cfg(tmp_path / name, cache_dir, run={"steps": steps}))
    return t, TrainerInner(t)


def outer_step(inner, s, tx, until):
    """Train to inner step ``until`` and take one single-node outer step from state ``s``."""
    from intellect_jax.diloco import state as S

    inner.train(until)
    s = S.outer_step(s, inner.pseudo_gradient(s.outer_params), tx, until)
    inner.set_params(s.outer_params)
    return s._replace(inner_opt_state=inner.live_opt_state(), data=inner.data_state())


def leaves(tree):
    import numpy as np

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


LAUNCH_TINY = ["--run.steps", "20", "--diloco.inner_steps", "5", *TINY_ARGS, "--run.eval_every", "0",
               "--run.log_every", "1", "--ckpt.every", "0"]


def launch(tmp_path, *args, port=None, env=None, tiny=LAUNCH_TINY, module="intellect_jax.launch", cache=None):
    """A launcher (or chaos) run of configs/debug_diloco.toml under ``tmp_path``, output piped.
    ``cache``: the data cache (tokenizer, token shards); by default a new one under ``tmp_path``,
    which the nodes then build as they start, each its own copy (the first to finish publishes it)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", module, "--config", "configs/debug_diloco.toml",
           "--out-dir", str(tmp_path / "runs"), "--table-every", "0", "--timeout", "500",
           *(["--port", str(port)] if port else []), *tiny, *args,
           "--data.cache_dir", str(cache or tmp_path / "cache")]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_rows(tmp_path, node, run="debug_diloco") -> tuple[list[dict], list[dict]]:
    """A launched node's outer-step rows and inner-step rows."""
    rs = rows(tmp_path / "runs" / run / node)
    return [r for r in rs if "outer_hash" in r], [r for r in rs if "loss" in r]

# ---------------------------------------------------------------------------- coordinators

FP = "fp-llama-debug"


class ManualClock(RealClock):
    """Real locks, a time the test sets, no ticker thread (the test ticks)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def spawn(self, target: Any, name: str) -> Any:
        return None


class Run:
    """A Membership (no sockets, no threads) plus the sessions of its nodes, with a manual clock."""

    def __init__(self, record: RunRecord | None = None, **kw: Any) -> None:
        kw.setdefault("join_window", 0.0)
        kw.setdefault("heartbeat_timeout", 5.0)
        kw.setdefault("boundary_timeout", 30.0)
        self.m = Membership(CoordinatorConfig(**kw), instance="i1", record=record)
        self.now = 0.0
        self.s: dict[str, str] = {}
        self.silent: set[str] = set()  # nodes whose heartbeats stop

    def reg(self, node: str, fp: str = FP, resume: Resume | None = None, protocol: int = PROTOCOL,
            founder: bool = True, data: Any = None) -> Any:
        r = self.m.register(node, f"10.0.0.{len(self.s) + 1}:700{len(self.s)}", 8, protocol, fp, self.now,
                            resume, founder, data=data)
        self.s[node] = r.session
        return r

    def arrive(self, node: str, k: int, h: str | None = None, retry_of: int | None = None) -> Epoch | None:
        return self.m.arrive(node, self.s[node], k, self.now, h, retry_of)

    def result(self, node: str) -> Epoch | None:
        return self.m.epoch_for(node, self.s[node])

    def tick(self, dt: float) -> None:
        self.now += dt
        for n, sess in self.s.items():  # everyone alive heartbeats, unless told otherwise
            if n not in self.silent and n in self.m._nodes and self.m._nodes[n].session == sess:
                self.m.heartbeat(n, sess, self.now)
        self.m.tick(self.now)

    def barrier(self, k: int, nodes: list[str], h: str | None = None) -> dict[str, Epoch]:
        for n in nodes:
            self.arrive(n, k, h)
        out = {n: self.result(n) for n in nodes}
        assert all(e is not None for e in out.values()), out
        return out  # type: ignore[return-value]


def coord_transport(name: str = COORDINATOR, **kw: Any) -> TransportConfig:
    """Identity ``name``'s transport (the coordinator's by default), from the test authority."""
    return transport_config(name, "coord-test", **({"io_timeout": 5.0, "connect_timeout": 5.0,
                                                   "handshake_timeout": 5.0} | kw))


def coord_config(**kw: Any) -> CoordinatorConfig:
    base: dict[str, Any] = {"heartbeat_timeout": 3.0, "boundary_timeout": 30.0, "join_window": 0.0, "min_nodes": 3,
                            "keepalive_interval": 0.3, "tick_interval": 0.05}
    return CoordinatorConfig(**(base | kw))


def coord_client(addr: Any, node: str, port: int, fp: str = FP, transport: TransportConfig | None = None,
                 **kw: Any) -> CoordinatorClient:
    """A client for ``node``, speaking as ``node`` (or with ``transport``: as someone else)."""
    kw.setdefault("heartbeat_interval", 0.2)
    kw.setdefault("reconnect_timeout", 15.0)
    return CoordinatorClient(addr, transport or coord_transport(node), node, f"127.0.0.1:{port}", devices=2,
                             fingerprint=fp, **kw)


def wait_for(pred: Any, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def coord_env(*names: str) -> dict[str, str]:
    """Environment of a child process that uses the test authority (``names`` issued first)."""
    for n in names:
        credentials(n)
    return {**os.environ, KEYS_ENV: str(keys_dir()), "PYTHONPATH": ROOT}


@pytest.fixture
def coordinator():
    """Start socket coordinators on 127.0.0.1 (``coordinator(**config)``, the test config's
    fields overridden); every one started is stopped at the test's end."""
    from intellect_jax.coordinator.server import Coordinator

    started = []

    def start(transport=None, **conf):
        c = Coordinator(transport or coord_transport(), config=coord_config(**conf)).start()
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def expire(auth: Any, name: str) -> None:
    """Replace ``name``'s certificate in ``auth``'s directory by one that expired yesterday."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = serialization.load_pem_private_key((auth.dir / f"{name}.key").read_bytes(), password=None)
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(auth.ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=10)).not_valid_after(now - dt.timedelta(days=1))
            .sign(auth._key, hashes.SHA256()))  # noqa: SLF001 - a test forges what the product refuses to make
    (auth.dir / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def socket_run(n: int, run_id: str, ring: Any, *, outer_steps: int = 20, dim: int = 64, client_hook: Any = None,
               during: Any = None) -> dict:
    """A socket coordinator and ``n`` nodes in threads, every part real but the model (numpy
    trainers): authenticated transport, coordinator, the exchange of ``ring`` (a RingConfig),
    state transfer, a model of ``dim`` + 8 values. ``client_hook(i, client)`` may wrap node i's client before it registers;
    ``during(coord, nets)`` may return a context manager held while the nodes run. Returns the
    wall time, outcomes, evictions, the final state hashes, the listeners' refusals and the
    coordinator's event log."""
    from intellect_jax.coordinator.server import Coordinator
    from intellect_jax.diloco.loop import NodeLoop
    from intellect_jax.diloco.parts import LoopConfig, NodeParts
    from intellect_jax.diloco.state import state_hash
    from intellect_jax.diloco.store import MemoryStore
    from intellect_jax.diloco.transfer import NetTransport
    from intellect_jax.net.comm import NetNode
    from intellect_jax.testing.local import NumpyInner

    loop = LoopConfig(inner_steps=5, outer_steps=outer_steps, outer_lr=1.0, outer_momentum=0.0, watch_interval=0.2)
    conf = CoordinatorConfig(heartbeat_timeout=3.0, min_nodes=n, join_window=0.0, keepalive_interval=0.3,
                             tick_interval=0.05, outer_steps=loop.outer_steps)
    rs = np.random.default_rng(7)
    targets = [rs.standard_normal(dim).astype(np.float32) for _ in range(n)]
    init = {"w": rs.standard_normal(dim).astype(np.float32), "u": np.zeros((2, 4), np.float32)}
    goal = np.mean(targets, axis=0)
    cfgs = [transport_config(f"n{i}", run_id, io_timeout=10.0) for i in range(n)]
    events: list[str] = []
    with Coordinator(transport_config("coordinator", run_id, io_timeout=10.0), config=conf) as coord:
        coord.service._on_event = events.append  # noqa: SLF001 - the test reads the coordinator's log
        nets = [NetNode(cfg) for cfg in cfgs]
        outcomes: list = [None] * n
        loops: list = [None] * n

        def node(i: int) -> None:
            client = CoordinatorClient(coord.address, cfgs[i], f"n{i}", "%s:%d" % nets[i].address, fingerprint="fp",
                                       heartbeat_interval=0.2, outer_steps=loop.outer_steps)
            if client_hook is not None:
                client_hook(i, client)
            ring_of = lambda ep: nets[i].ring(ep.members, ep.rank, epoch=ep.epoch_id, step=ep.outer_step,  # noqa: E731
                                              config=ring)
            parts = NodeParts(f"n{i}", NumpyInner(targets[i], init, goal, step_time=0.04), client, ring_of,
                              NetTransport(nets[i], f"n{i}", watch_interval=0.2), MemoryStore(), log=lambda line: None)
            loops[i] = NodeLoop(loop, parts)
            try:
                outcomes[i] = loops[i].run()
            except Exception as e:  # noqa: BLE001 - reported by the test
                outcomes[i] = f"{type(e).__name__}: {e}"
            finally:
                client.close()

        ctx = during(coord, nets) if during is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            threads = [threading.Thread(target=node, args=(i,)) for i in range(n)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            wall = time.monotonic() - t0
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        status = coord.status()
        refused = dict(coord._listener.refused) if coord._listener else {}  # noqa: SLF001
        node_refused = dict(nets[0].listener.refused)
        for net in nets:
            net.close()
    return {"wall_s": wall, "outcomes": outcomes, "evictions": [e for e in status["evictions"] if not e["graceful"]],
            "hashes": {state_hash(lp.state) for lp in loops if lp.state is not None},
            "node_hashes": [None if lp is None or lp.state is None else state_hash(lp.state) for lp in loops],
            "distance": [None if lp is None or lp.state is None else  # each node's final outer params to the goal
                         float(np.linalg.norm(lp.state.outer_params["w"] - goal) / np.linalg.norm(goal))
                         for lp in loops],
            "refused": refused,
            "node_refused": node_refused, "events": events}


@contextmanager
def forging_owner(monkeypatch: pytest.MonkeyPatch, bad: Callable[[Any], bool],
                  pieces: set[int] | None = None) -> Iterator[None]:
    """Butterfly owners for which ``bad(run)`` holds (``run``: the exchange's ``_ButterflyRun``)
    send back their aggregate negated (of ``pieces`` only, if given), the same bytes to every
    member, as a malicious owner would; every other rank runs the product's code."""
    from intellect_jax.net import butterfly, quant

    local = threading.local()
    encoder, honest = butterfly._ButterflyRun.encoder, butterfly.aggregate_piece

    def as_owner(self: Any) -> None:
        local.bad, local.j = bad(self), 0
        encoder(self)

    def forged(rows: Any, n: int, mode: str, block: int, how: str, out: Any = None, absent: Any = frozenset(),
               scratch: Any = None) -> Any:
        wire = honest(rows, n, mode, block, how, out, absent, scratch)
        j, local.j = getattr(local, "j", 0), getattr(local, "j", 0) + 1
        if getattr(local, "bad", False) and (pieces is None or j in pieces):
            return quant.encode(-quant.decode(wire, n, mode, block), mode, block, wire)
        return wire

    monkeypatch.setattr(butterfly._ButterflyRun, "encoder", as_owner)
    monkeypatch.setattr(butterfly, "aggregate_piece", forged)
    yield


def withholding_aggregates(monkeypatch: pytest.MonkeyPatch, bad: Callable[[Any, int], bool]) -> None:
    """Butterfly owners send none of their aggregates on mesh link ``k`` where ``bad(run, k)``
    holds (``run``: the exchange's ``_ButterflyRun``); their audit and POST frames they do send."""
    from intellect_jax.net import butterfly
    from intellect_jax.net.frames import MsgType

    honest = butterfly._ButterflyRun._gather_to

    def gather(self: Any, k: int) -> None:
        conn = self.links.out[k]
        if bad(self, k) and not getattr(conn, "skipping", False):
            send = conn.send
            conn.send = lambda t, payload=b"", **kw: None if t == MsgType.DATA else send(t, payload, **kw)
            conn.skipping = True
        honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_gather_to", gather)


def withholding_answers(monkeypatch: pytest.MonkeyPatch, bad: Callable[[Any], bool],
                        what: str = "both") -> list[tuple[int, int, bool]]:
    """Butterfly members send every auditor but their own no answer to its challenge
    (``what``: ``answer``), no echo (``echo``) or neither (``both``) in the buckets where
    ``bad(run)`` holds (``run``: the exchange's ``_ButterflyRun``); what the auditors made of
    each row an owner supplied them goes into the list returned (auditor, member, taken)."""
    from intellect_jax.net import audit, audit_frames

    answer, echo, supply, supplied = audit_frames.AuditFrames._answer, audit_frames.AuditFrames._echo_to, \
        audit.Ledger.supply, []

    def withheld(honest: Any, kind: str) -> Any:
        def send(self: Any, conn: Any, o: int) -> bool:
            if what in (kind, "both") and o != self.ledger.auditor and bad(self):
                return True
            return honest(self, conn, o)
        return send

    def took(self: Any, r: int, payload: bytes) -> bool:
        ok = supply(self, r, payload)
        supplied.append((self.rank, r, ok))
        return ok

    monkeypatch.setattr(audit_frames.AuditFrames, "_answer", withheld(answer, "answer"))
    monkeypatch.setattr(audit_frames.AuditFrames, "_echo_to", withheld(echo, "echo"))
    monkeypatch.setattr(audit.Ledger, "supply", took)
    return supplied


def unsigned_rows(monkeypatch: pytest.MonkeyPatch, bad: Callable[[Any, int], bool]) -> list[tuple[int, int]]:
    """Butterfly members sign their own pieces with garbage to each owner ``o`` where
    ``bad(run, o)`` holds (``run``: the exchange's ``_ButterflyRun``); every (owner, sender) an
    owner left out of its segment (``_ButterflyRun._leave_out``) goes into the list returned."""
    import dataclasses

    from intellect_jax.net import butterfly

    scatter, leave, left = butterfly._ButterflyRun._scatter_to, butterfly._ButterflyRun._leave_out, []

    def scatter_to(self: Any, k: int) -> None:
        if not hasattr(self, "garbled"):
            sign = self.garbled = self.mseal.sign
            self.mseal = dataclasses.replace(self.mseal, sign=lambda o, *a: bytes(64) if bad(self, o) else sign(o, *a))
        return scatter(self, k)

    def leave_out(self: Any, i: int, j: int) -> None:
        left.append((self.rank, i))
        return leave(self, i, j)

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter_to)
    monkeypatch.setattr(butterfly._ButterflyRun, "_leave_out", leave_out)
    return left


def tailless(monkeypatch: pytest.MonkeyPatch, bad: Callable[[Any, int], bool]) -> list[int]:
    """Butterfly members drop their last tail to the owner ``o`` where ``bad(run, o)`` holds
    (``run``: the exchange's ``_ButterflyRun``; the tail then comes by relay); the ranks that
    did so go into the list returned."""
    from intellect_jax.net import butterfly

    gather, dropped = butterfly._ButterflyRun._gather_to, []

    def gather_to(self: Any, k: int) -> None:
        conn = self.links.out[k]
        if not bad(self, butterfly.peer_of(self.rank, self.world, k)):
            return gather(self, k)
        send = conn.send

        def without(t: Any, payload: Any = b"", **kw: Any) -> Any:
            if getattr(payload, "nbytes", 0) == butterfly.TAIL:
                dropped.append(self.rank)
                return None
            return send(t, payload, **kw)
        conn.send = without
        try:
            return gather(self, k)
        finally:
            del conn.send

    monkeypatch.setattr(butterfly._ButterflyRun, "_gather_to", gather_to)
    return dropped


def first_piece(run: Any, k: int, at: float | None = None) -> Any:
    """Send the owner at the end of mesh link ``k`` our first piece of its segment, signed
    (``run``: the exchange's ``_ButterflyRun``), once ``time.monotonic()`` reaches ``at``;
    returns the link."""
    import time

    from intellect_jax.net import butterfly
    from intellect_jax.net.frames import MsgType

    o = butterfly.peer_of(run.rank, run.world, k)
    conn, (a, b) = run.links.out[k], run.plan.piece(o, 0)
    wire = run._encode(o, 0)
    time.sleep(max(0.0, (at or 0.0) - time.monotonic()))
    conn.send(MsgType.DATA, wire, deadline=run.deadline)
    conn.send(MsgType.DATA, run.mseal.sign(o, o, 0, b - a, wire), deadline=run.deadline)
    return conn


def quiet_after_first_piece(monkeypatch: pytest.MonkeyPatch, bad: Callable[[Any, int], bool]) -> list[tuple[int, int]]:
    """Butterfly members send each owner ``o`` where ``bad(run, o)`` holds (``run``: the
    exchange's ``_ButterflyRun``) their first piece of its segment, signed, then keep the link
    quiet until their own call's deadline shuts it (this thread then sleeps on until a second
    past it); each (sender, owner) that did so goes into the list returned, once a call."""
    import time

    from intellect_jax.net import butterfly

    scatter, quiet = butterfly._ButterflyRun._scatter_to, []

    def scatter_to(self: Any, k: int) -> None:
        o = butterfly.peer_of(self.rank, self.world, k)
        if not bad(self, o):
            return scatter(self, k)
        first_piece(self, k)
        self._sent(0, k)
        quiet.append((self.rank, o))
        time.sleep(max(0.0, self.deadline + 1.0 - time.monotonic()))

    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter_to)
    return quiet


def garbling_commitment(monkeypatch: pytest.MonkeyPatch, bad: Callable[[Any, Any], bool],
                        what: tuple[str, ...] = ("commitment", "nonce")) -> list[int]:
    """Butterfly owners send, on a mesh connection ``conn`` where ``bad(run, conn)`` holds, their
    own commitment under a signature that does not verify and (``what``) a nonce their header's
    chain does not hash to; the buckets garbled go into the list returned."""
    from intellect_jax.net import butterfly
    from intellect_jax.net.evidence import digest

    frame, garbled = butterfly._ButterflyRun._audit_frame, []

    def garble(self: Any, conn: Any, payload: bytes) -> bool:
        led = self.ledger
        if bad(self, conn):
            if "commitment" in what and led.commit is not None and payload == led.commit[1]:
                payload = bytes(len(payload))
                garbled.append(self.index)
            elif "nonce" in what and payload == led.ctx.nonce:
                payload = digest(payload)
                garbled.append(self.index)
        return frame(self, conn, payload)

    monkeypatch.setattr(butterfly._ButterflyRun, "_audit_frame", garble)
    return garbled
