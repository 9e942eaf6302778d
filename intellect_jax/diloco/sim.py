"""Seeded fault simulation of elastic DiLoCo: whole runs of N nodes in one process.

Each node is a thread running the real outer loop (:class:`~.loop.NodeLoop`) with the real
coordinator client, talking to the real coordinator service (membership state machine,
journal) through the in-process wire, all in the virtual time of a :class:`~.clock.SimClock`.
Only the heavy parts are stand-ins: a numpy "model" trained by a deterministic rule
(:class:`SimInner`), an in-process ring with the int8 ring's exact arithmetic, an in-process
state transport, and in-memory checkpoints that survive a node's death (its "disk").

Faults come from a seeded schedule and are injected here, around the collaborators, never in
production code: a node is SIGKILLed (during compute, at the barrier, inside the all-reduce,
after a ring that only some ranks finished, while donating, while receiving, while waiting
for admission) or SIGSTOPped for a while; the coordinator crashes and restarts from its
journal; killed nodes restart from their newest or from an older checkpoint, or with an empty
disk; new nodes join; one registers after the run has completed. The invariants checked:
never two hashes for one outer step among everything any node recorded, the run completes,
every node still alive ends cleanly, nothing hangs.

    python -m intellect_jax.diloco.sim --seeds 0:200      # prints one line per failing seed
    python -m intellect_jax.diloco.sim --seed 17 -v       # replay one seed with its event log
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from intellect_jax.diloco.client import CoordinatorClient
from intellect_jax.diloco.clock import Hang, SimClock
from intellect_jax.diloco.journal import MemoryJournal
from intellect_jax.diloco.loop import LoopConfig, NodeLoop, NodeParts, Outcome, TransferFailed
from intellect_jax.diloco.protocol import Admission, CoordinatorConfig, Epoch
from intellect_jax.diloco.service import LocalCoordinator
from intellect_jax.diloco.state import DilocoState, MomentumState, init_state
from intellect_jax.net.comm import CommStats, RingConfig
from intellect_jax.net.errors import PeerClosed, PeerTimeout
from intellect_jax.net.local import LocalGroup

HOOKS = ("train", "sync", "allreduce", "serve", "receive", "admit")


class Killed(BaseException):
    """The simulated node process died (SIGKILL): nothing of it runs any more."""


@dataclass(frozen=True)
class SimParams:
    nodes: int = 4
    outer_steps: int = 10
    inner_steps: int = 4
    step_time: float = 0.01
    ring_time: float = 0.01
    transfer_time: float = 0.2
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 1.0
    join_window: float = 2.0  # above the clients' longest reconnect backoff (1 s)
    reconnect_timeout: float = 30.0
    transfer_timeout: float = 20.0
    ring_deadline: float = 20.0
    max_time: float = 900.0  # virtual seconds before the run counts as not completing
    dim: int = 96
    fault_prob: float = 0.6  # chance that an incarnation gets a fault
    coordinator_restarts: int = 2  # at most
    outage_prob: float = 0.3  # chance of one event that kills several nodes at once
    late_joiners: int = 1  # at most


@dataclass(frozen=True)
class Fault:
    hook: str  # one of HOOKS
    nth: int  # on this node process's nth call of that hook
    kind: str  # "kill" | "stall" | "partial" (allreduce: some ranks finish, the victim dies)
    when: str = "before"  # "before" | "during" | "after"
    seconds: float = 0.0  # stall length


@dataclass
class Script:
    """A hand-written schedule instead of the seeded one (tests of one recovery path): faults per
    node process (``"n1#0"``: node n1's first process), driver events ``(time, "coordinator" |
    "join" | "outage", arg)`` (an outage's arg: comma-separated node ids) and how each node
    restarts after a kill (``"latest"``, ``"stale"``, ``"empty"``; default latest)."""

    faults: dict[str, list[Fault]] = field(default_factory=dict)
    events: list[tuple[float, str, str]] = field(default_factory=list)
    restarts: dict[str, str] = field(default_factory=dict)


@dataclass
class Proc:
    """One process of one node (a restart is a new Proc with the same node id and disk)."""

    node_id: str
    number: int
    faults: list[Fault]
    disk: dict[int, DilocoState]
    start_from: str  # "fresh" | "latest" | "stale" | "empty"
    dead: bool = False
    restarted: bool = False
    stalled_until: float = 0.0
    counts: Counter = field(default_factory=Counter)
    outcome: Outcome | None = None
    error: str | None = None
    client: CoordinatorClient | None = None
    mailbox: dict[int, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.node_id}#{self.number}"

    @property
    def addr(self) -> str:
        return f"sim://{self.name}"


class Sim:
    """One seeded run; :meth:`run` returns a report dict (``ok``, ``problems``, counts, log)."""

    def __init__(self, seed: int, params: SimParams | None = None, *, script: Script | None = None,
                 verbose: bool = False) -> None:
        self.seed, self.p, self.script, self.verbose = seed, params or SimParams(), script, verbose
        self.rng = np.random.default_rng(seed)
        self.clock = SimClock()
        self.cond = self.clock.Condition()
        self.log: list[str] = []
        p = self.p
        self.coord_cfg = CoordinatorConfig(heartbeat_timeout=p.heartbeat_timeout, boundary_timeout=60.0,
                                           join_window=p.join_window, min_nodes=p.nodes, keepalive_interval=0.2,
                                           tick_interval=0.1, outer_steps=p.outer_steps)
        self.journal = MemoryJournal()
        self.coord: LocalCoordinator | None = None  # started by the driver, in virtual time
        self.loop_cfg = LoopConfig(inner_steps=p.inner_steps, outer_steps=p.outer_steps, outer_lr=0.7,
                                   outer_momentum=0.9, transfer_timeout=p.transfer_timeout,
                                   admission_timeout=p.max_time, watch_interval=p.heartbeat_interval,
                                   ckpt_every=p.inner_steps, eval_every=0)
        self.ring_cfg = RingConfig(mode="int8", block_size=32, piece_numel=64, deadline=p.ring_deadline)
        self.procs: list[Proc] = []
        self.disks: dict[str, dict[int, DilocoState]] = {}
        self.rows: list[tuple[str, int, dict[str, Any]]] = []  # (proc, inner step, row) as recorded
        self.groups: dict[tuple[int, int], _Group] = {}  # (epoch, boundary): an epoch spans steps
        self.by_addr: dict[str, Proc] = {}
        self.injected: Counter = Counter()
        self.rolled_back_to: list[int] = []  # operator rollbacks seen (the rows after them are discarded)
        self.discarded = 0
        rs = np.random.default_rng(12345)  # the task itself is the same for every seed
        self.targets = [rs.standard_normal(p.dim).astype(np.float32) for _ in range(p.nodes + p.late_joiners + 2)]
        self.init = {"w": rs.standard_normal(p.dim).astype(np.float32), "u": np.zeros((4, 8), np.float32)}

    # ---- log -----------------------------------------------------------------------------------
    def say(self, who: str, line: str) -> None:
        self.log.append(f"{self.clock.now():9.3f} [{who}] {line}")

    # ---- processes -----------------------------------------------------------------------------
    def _faults(self) -> list[Fault]:
        if self.rng.random() >= self.p.fault_prob:
            return []
        hook = str(self.rng.choice(HOOKS))
        kind = str(self.rng.choice(["kill", "kill", "stall", "stall"]
                                   + (["partial", "partial-outage"] if hook == "allreduce" else [])))
        when = str(self.rng.choice(["before", "during", "after"] if hook in ("train", "serve", "receive")
                                   else ["before", "after"]))
        if kind.startswith("partial"):
            when = "before"
        long = self.rng.random() < 0.7  # long stalls (SIGSTOP 1.5-30 s) get the node evicted, short ones not
        seconds = float(self.rng.uniform(1.5, 30.0) if long else self.rng.uniform(0.05, 0.5))
        rare = hook in ("serve", "receive", "admit")  # a process calls these once or twice
        return [Fault(hook, int(self.rng.integers(0, 2 if rare else 6)), kind, when, seconds)]

    def start(self, node_id: str, start_from: str) -> Proc:
        disk = self.disks.setdefault(node_id, {})
        number = sum(1 for q in self.procs if q.node_id == node_id)
        faults = list(self.script.faults.get(f"{node_id}#{number}", [])) if self.script else self._faults()
        proc = Proc(node_id, number, faults, disk, start_from)
        self.procs.append(proc)
        self.by_addr[proc.addr] = proc
        self.say(proc.name, f"start ({start_from}; faults {proc.faults})")
        self.clock.spawn(lambda: self._main(proc), name=proc.name)
        return proc

    def _main(self, proc: Proc) -> None:
        p, clock = self.p, self.clock
        rank = int(proc.node_id.removeprefix("n"))
        wire = _StallWire(self.coord.wire(), proc, clock)
        client = CoordinatorClient(None, None, proc.node_id, proc.addr, wire=wire, clock=clock,
                                   heartbeat_interval=p.heartbeat_interval, reconnect_timeout=p.reconnect_timeout,
                                   fingerprint="sim", outer_steps=p.outer_steps)
        proc.client = client
        held = None
        if proc.start_from in ("latest", "stale") and proc.disk:
            steps = sorted(proc.disk)
            pick = steps[-1] if proc.start_from == "latest" else steps[int(self.rng.integers(0, len(steps)))]
            held = copy.deepcopy(proc.disk[pick])
        elif proc.start_from == "empty":
            proc.disk.clear()
        inner = SimInner(self, proc, self.targets[rank % len(self.targets)])
        parts = NodeParts(proc.node_id, inner, _Gated(client, proc, self, {"sync": "sync", "wait_admission": "admit"}),
                          lambda ep: _Comm(self, proc, ep), _Transport(self, proc), _Disk(self, proc, held),
                          clock=clock, log=lambda line: self.say(proc.name, line))
        try:
            proc.outcome = NodeLoop(self.loop_cfg, parts).run()
            self.say(proc.name, f"exit: {proc.outcome.value}")
        except Killed:
            self.say(proc.name, "killed")
        except Exception as e:  # noqa: BLE001 - an unhandled error is what the simulation looks for
            if proc.dead:  # killed from outside while blocked: whatever it raised on the way out is moot
                self.say(proc.name, f"killed ({type(e).__name__} on the way out)")
                return
            import traceback

            proc.error = f"{type(e).__name__}: {e}"
            self.say(proc.name, f"UNHANDLED {proc.error}\n{traceback.format_exc()}")
        finally:
            if not proc.dead:
                client.close()
            with self.cond:
                self.cond.notify_all()

    def gate(self, proc: Proc, hook: str, when: str, during: Callable[[float], None] | None = None) -> Fault | None:
        """A fault point of ``proc``: dies, stalls, or returns a fault the caller acts on."""
        if proc.dead:
            raise Killed()
        self._wait_unstalled(proc)
        if when == "before":
            proc.counts[hook] += 1
        n = proc.counts[hook] - 1
        for f in proc.faults:
            if f.hook == hook and f.nth == n and f.when == when:
                proc.faults.remove(f)
                self.injected[f"{f.kind}@{hook}/{when}"] += 1
                self.say(proc.name, f"FAULT {f.kind} at {hook} #{n} ({when})")
                if f.kind == "kill":
                    self.kill(proc)
                if f.kind == "stall":
                    proc.stalled_until = self.clock.now() + f.seconds
                    self.clock.sleep(f.seconds)
                    self.say(proc.name, f"resumes after a {f.seconds:.2f}s stall")
                return f
        return None

    def _wait_unstalled(self, proc: Proc) -> None:
        left = proc.stalled_until - self.clock.now()
        if left > 0:
            self.clock.sleep(left)
        if proc.dead:
            raise Killed()

    def kill_from_outside(self, proc: Proc) -> None:
        """SIGKILL from another thread: the process's own threads die at their next step."""
        try:
            self.kill(proc)
        except Killed:
            pass

    def kill(self, proc: Proc) -> None:
        """SIGKILL: the process is gone (its session drops, its rings and transfers fail)."""
        if proc.dead:
            raise Killed()
        proc.dead = True
        self.say(proc.name, "SIGKILL")
        if proc.client is not None:
            proc.client.close()
        with self.cond:
            self.cond.notify_all()
        raise Killed()

    # ---- the run -------------------------------------------------------------------------------
    def run(self, real_timeout: float = 120.0) -> dict[str, Any]:
        import logging

        logging.getLogger("intellect_jax").setLevel(logging.ERROR)  # the event log below has it all
        t0 = time.monotonic()
        driver = self.clock.spawn(self._drive, name="driver")
        driver.join(real_timeout)
        problems = self.check(final=True)
        if driver.is_alive():
            problems.append(f"driver still running after {real_timeout:.0f}s of real time")
        if self.clock.hang is not None:
            problems.append(f"hang: {self.clock.hang}")
        for name, e in self.clock.errors:
            if not isinstance(e, Killed):
                problems.append(f"thread {name} raised {type(e).__name__}: {e}")
        problems += [f"{q.name}: unhandled {q.error}" for q in self.procs if q.error]
        return {"seed": self.seed, "ok": not problems, "problems": problems, "faults": dict(self.injected),
                "procs": len(self.procs), "virtual_s": round(self.clock.now(), 2),
                "real_s": round(time.monotonic() - t0, 2), "log": self.log}

    def _drive(self) -> None:
        p, rng, clock = self.p, self.rng, self.clock
        self.coord = LocalCoordinator(self.coord_cfg, run_id="sim", clock=clock, journal=self.journal,
                                      on_event=lambda line: self.say("coord", line))
        for i in range(p.nodes):
            self.start(f"n{i}", "fresh")
        events: list[tuple[float, str, str]] = []
        if self.script is not None:
            events = list(self.script.events)
        else:
            for _ in range(int(rng.integers(0, p.coordinator_restarts + 1))):
                events.append((float(rng.uniform(0.2, 4.0)), "coordinator", ""))
            for j in range(int(rng.integers(0, p.late_joiners + 1))):
                events.append((float(rng.uniform(0.1, 3.0)), "join", f"n{p.nodes + j}"))
            if rng.random() < p.outage_prob:  # several nodes die at once (a site outage)
                events.append((float(rng.uniform(0.05, 2.0)), "outage", ""))
        events.sort()
        pending_restarts: dict[str, float] = {}
        while clock.now() < p.max_time:
            now = clock.now()
            while events and events[0][0] <= now:
                _, what, arg = events.pop(0)
                if what == "coordinator":
                    down = float(rng.uniform(0.2, 3.0))
                    self.injected["coordinator restart"] += 1
                    self.say("driver", f"coordinator crashes for {down:.2f}s")
                    self.coord.crash()
                    clock.sleep(down)
                    self.coord.start()
                    self.say("driver", "coordinator restarted (journal reloaded)")
                elif what == "outage":
                    alive = [q for q in self.procs if not q.dead and q.outcome is None and q.error is None]
                    victims = ([q for q in alive if q.node_id in arg.split(",")] if arg
                               else [q for q in alive if rng.random() < 0.6])
                    self.injected["outage"] += 1
                    self.say("driver", f"outage: SIGKILL {[q.name for q in victims]}")
                    for q in victims:
                        self.kill_from_outside(q)
                else:
                    self.injected["late join"] += 1
                    self.start(arg, "fresh")
                self.check()
            for q in self.procs:  # restart the killed
                if q.dead and not q.restarted and q.node_id not in pending_restarts:
                    pending_restarts[q.node_id] = clock.now() + float(rng.uniform(0.3, 3.0))
                    q.restarted = True
            for node_id, t in list(pending_restarts.items()):
                if clock.now() >= t:
                    del pending_restarts[node_id]
                    mode = (self.script.restarts.get(node_id, "latest") if self.script
                            else str(rng.choice(["latest", "latest", "latest", "stale", "empty"])))
                    self.injected[f"restart ({mode})"] += 1
                    self.start(node_id, mode)
                    self.check()
            running = [q for q in self.procs if not q.dead and q.outcome is None and q.error is None]
            if not running and not pending_restarts and not events:
                break
            self._operator(running, pending_restarts)
            clock.sleep(0.1)
        if self.journal.load("sim").completed:  # one more node registers after the end
            late = self.start(f"n{p.nodes + p.late_joiners + 1}", "fresh")
            while late.outcome is None and late.error is None and not late.dead:
                clock.sleep(0.1)
            if late.outcome is not Outcome.COMPLETED:
                late.error = late.error or f"registered after completion and ended {late.outcome}"
        self.coord.crash()

    def _operator(self, running: list[Proc], pending_restarts: dict[str, float]) -> None:
        """What an operator does when the newest state is lost for good (every node that held it
        died with its disk): restart the coordinator allowing a rollback to the newest state any
        disk still has. History after that step is discarded explicitly (and logged)."""
        rec = self.journal.load("sim")
        if rec.hwm_step is None or rec.completed or pending_restarts:
            self._stuck_since = None
            return
        H = self.p.inner_steps
        on_disk = [k // H for q in self.procs for k in q.disk]
        holders = [q for q in running if q.client is not None and q.client.member]
        if holders or (on_disk and max(on_disk) >= rec.hwm_step):
            self._stuck_since = None
            return
        now = self.clock.now()
        self._stuck_since = getattr(self, "_stuck_since", None) or now
        if now - self._stuck_since < 20.0:
            return
        to = max(on_disk, default=0)  # 0: start over from the seeded initial state
        self.injected["operator rollback"] += 1
        self.say("driver", f"OPERATOR: the state of outer step {rec.hwm_step} is lost; restarting the coordinator "
                           f"with allow_rollback_to={to}")
        self.coord.crash()
        self.coord.start(dataclasses.replace(self.coord_cfg, allow_rollback_to=to))
        self._stuck_since = None
        for q in self.procs:  # nodes whose processes are gone come back from their disks
            if q.dead and q.disk and not any(r.node_id == q.node_id and not r.dead for r in self.procs):
                pending_restarts.setdefault(q.node_id, now + 0.5)

    def _note_rollbacks(self) -> None:
        rec = self.journal.load("sim")
        for rb in rec.rollbacks[len(self.rolled_back_to):]:
            self.rolled_back_to.append(rb["to"])
            kept = [r for r in self.rows if r[2]["outer_step"] <= rb["to"]]
            self.discarded += len(self.rows) - len(kept)
            self.rows = kept

    def check(self, final: bool = False) -> list[str]:
        """The invariants (see the module docstring); raises nothing, returns the violations."""
        problems = []
        self._note_rollbacks()
        by_step: dict[int, set[str]] = {}
        for _, _, row in self.rows:
            by_step.setdefault(row["outer_step"], set()).add(row["outer_hash"])
        rec = self.journal.load("sim")
        for k, hs in sorted(by_step.items()):
            if len(hs) > 1:
                problems.append(f"FORK: outer step {k} has {len(hs)} hashes: {sorted(h[:12] for h in hs)}")
            elif k in rec.hashes and rec.hashes[k] not in hs:
                problems.append(f"FORK: outer step {k} recorded {rec.hashes[k][:12]}, nodes logged {list(hs)[0][:12]}")
        if final:
            if not rec.completed or rec.hwm_step != self.p.outer_steps:
                problems.append(f"run not completed: high-water mark {rec.hwm_step}, completed {rec.completed}")
            for q in self.procs:
                if not q.dead and q.outcome is None and q.error is None:
                    problems.append(f"{q.name} never finished")
        if problems and not final:
            self.say("driver", "INVARIANT " + "; ".join(problems))
        return problems


class _StallWire:
    """The coordinator wire of one process: nothing gets through while the process is stopped."""

    def __init__(self, wire: Any, proc: Proc, clock: SimClock) -> None:
        self.w, self.proc, self.clock, self.name = wire, proc, clock, wire.name

    def _pause(self) -> None:
        left = self.proc.stalled_until - self.clock.now()
        if left > 0:
            self.clock.sleep(left)
        if self.proc.dead:
            raise PeerClosed("process gone")

    def open(self, msg: dict, timeout: float) -> Any:
        self._pause()
        return self.w.open(msg, timeout)

    def beat(self, handle: Any, msg: dict) -> dict:
        self._pause()
        return self.w.beat(handle, msg)

    def close(self, handle: Any) -> None:
        self.w.close(handle)

    def request(self, msg: dict, deadline: float | None, connect_timeout: float) -> dict:
        self._pause()
        return self.w.request(msg, deadline, connect_timeout)


class _Gated:
    """Calls of the named methods pass through a fault point before and after."""

    def __init__(self, target: Any, proc: Proc, sim: Sim, hooks: dict[str, str]) -> None:
        self._t, self._proc, self._sim, self._hooks = target, proc, sim, hooks

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._t, name)
        hook = self._hooks.get(name)
        if hook is None:
            if callable(attr) and not self._proc.dead:
                return attr
            if callable(attr):
                def dead(*a: Any, **kw: Any) -> Any:
                    raise Killed()
                return dead
            return attr

        def call(*a: Any, **kw: Any) -> Any:
            self._sim.gate(self._proc, hook, "before")
            result = attr(*a, **kw)
            self._sim.gate(self._proc, hook, "after")
            return result

        return call


class SimInner:
    """A numpy stand-in for the trainer: each inner step pulls the weights toward this node's
    target, deterministically per (node data, step); compute costs virtual time."""

    def __init__(self, sim: Sim, proc: Proc, target: np.ndarray) -> None:
        self.sim, self.proc, self.target = sim, proc, target
        self.weights = copy.deepcopy(sim.init)
        self.opt = {"m": np.zeros(sim.p.dim, np.float32)}
        self.step = 0
        self.data = {"pos": 0}

    def train(self, until: int) -> dict[str, Any]:
        sim, n = self.sim, max(0, until - self.step)
        sim.gate(self.proc, "train", "before")
        sim.clock.sleep(n * sim.p.step_time / 2)
        sim.gate(self.proc, "train", "during")
        sim.clock.sleep(n * sim.p.step_time / 2)
        if self.proc.dead:
            raise Killed()
        w = self.weights
        for _ in range(self.step, until):
            noise = np.random.default_rng([self.data["pos"], int(abs(self.target[0]) * 1e6)]).standard_normal(
                sim.p.dim).astype(np.float32)
            g = w["w"] - self.target + np.float32(0.1) * noise
            self.opt["m"] = (np.float32(0.9) * self.opt["m"] + g).astype(np.float32)
            w["w"] = (w["w"] - np.float32(0.05) * self.opt["m"]).astype(np.float32)
            w["u"] = (w["u"] + np.float32(0.01)).astype(np.float32)
            self.data["pos"] += 1
        self.step = until
        sim.gate(self.proc, "train", "after")
        return {"loss": float(np.mean((w["w"] - self.target) ** 2))}

    def params(self) -> Any:
        return copy.deepcopy(self.weights)

    def init_state(self, tx: Any) -> DilocoState:
        return init_state(self.weights, tx, None, self.step)

    def set_params(self, params: Any) -> None:
        self.weights = copy.deepcopy(params)

    def snapshot(self) -> Any:
        return copy.deepcopy(self.opt)

    def live_opt_state(self) -> Any:
        return copy.deepcopy(self.opt)

    def data_state(self) -> dict | None:
        return dict(self.data)

    def adopt(self, s: DilocoState) -> None:
        self.weights = copy.deepcopy(s.outer_params)
        if s.inner_opt_state is not None:
            self.opt = copy.deepcopy(s.inner_opt_state)
        if s.data is not None:
            self.data = dict(s.data)
        self.step = s.inner_step

    def template(self) -> DilocoState:
        return DilocoState(self.weights, MomentumState(self.weights), self.opt, 0, 0)

    def evaluate(self) -> float:
        target = np.mean(self.sim.targets[: self.sim.p.nodes], axis=0)
        return float(np.mean((self.weights["w"] - target) ** 2))

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        if self.proc.dead:
            raise Killed()
        self.sim.rows.append((self.proc.name, step, dict(metrics)))


class _Group:
    def __init__(self, world: int) -> None:
        self.world = world
        self.inputs: dict[int, Any] = {}
        self.members: dict[int, Proc] = {}
        self.results: list[Any] | None = None
        self.error: str | None = None
        self.fail_ranks: set[int] = set()


class _Comm:
    """One rank of an in-process ring for one epoch; results are the int8 ring's exact bits."""

    def __init__(self, sim: Sim, proc: Proc, ep: Epoch) -> None:
        self.sim, self.proc, self.rank, self.world_size, self.epoch = sim, proc, ep.rank, ep.world_size, ep.epoch_id
        self.group = sim.groups.setdefault((ep.epoch_id, ep.outer_step), _Group(ep.world_size))
        self.last_stats = CommStats(world_size=ep.world_size, mode="int8")

    def all_reduce_mean(self, tree: Any) -> Any:
        sim, g, clock = self.sim, self.group, self.sim.clock
        f = sim.gate(self.proc, "allreduce", "before")
        deadline = clock.now() + sim.p.ring_deadline
        with sim.cond:
            g.inputs[self.rank], g.members[self.rank] = tree, self.proc
            if len(g.inputs) == g.world and g.results is None and g.error is None:
                ordered = [g.inputs[r] for r in range(g.world)]
                g.results = LocalGroup(g.world, sim.ring_cfg, epoch=self.epoch).all_reduce_mean_all(ordered)
                if f is not None and f.kind.startswith("partial") and g.world > 2:
                    others = [r for r in range(g.world) if r != self.rank]
                    g.fail_ranks = set(others[: int(sim.rng.integers(1, len(others)))])
                    if f.kind == "partial-outage":  # the ranks that finished die soon after, too
                        finished = [g.members[r] for r in others if r not in g.fail_ranks]
                        delay = float(sim.rng.uniform(0.0, 2 * sim.p.inner_steps * sim.p.step_time))
                        sim.clock.spawn(lambda: (sim.clock.sleep(delay), [sim.kill_from_outside(q) for q in finished]),
                                        name="outage")
                sim.cond.notify_all()
            while g.results is None and g.error is None:
                if any(m.dead for m in g.members.values()):
                    g.error = "a peer closed the connection (it died)"
                    break
                left = deadline - clock.now()
                if left <= 0:
                    g.error = f"all-reduce deadline ({sim.p.ring_deadline:.0f}s) expired"
                    break
                sim.cond.wait(min(left, 1.0))
            sim.cond.notify_all()
        clock.sleep(sim.p.ring_time)
        if self.proc.dead:
            raise Killed()
        if f is not None and f.kind.startswith("partial"):
            sim.kill(self.proc)
        if g.results is None or self.rank in g.fail_ranks:
            raise PeerClosed(f"sim ring epoch {self.epoch}: {g.error or 'a peer died before passing it on'}")
        sim.gate(self.proc, "allreduce", "after")
        return copy.deepcopy(g.results[self.rank])

    def abort(self) -> None:
        with self.sim.cond:
            if self.group.results is None and self.group.error is None:
                self.group.error = "aborted (a member was evicted)"
            self.sim.cond.notify_all()

    def close(self) -> None:
        pass


class _Transport:
    """In-process state transfer: the donor's thread delivers a copy after ``transfer_time``."""

    def __init__(self, sim: Sim, proc: Proc) -> None:
        self.sim, self.proc = sim, proc

    def serve(self, joiner_id: str, joiner_addr: str, snapshot: DilocoState, meta: dict[str, Any]) -> Any:
        sim, proc, clock = self.sim, self.proc, self.sim.clock
        done, snap = clock.Event(), copy.deepcopy(snapshot)
        target = sim.by_addr.get(joiner_addr)

        def deliver(item: Any) -> None:
            if target is not None and not target.dead:
                with sim.cond:
                    target.mailbox[meta["outer_step"]] = item
                    sim.cond.notify_all()

        def run() -> None:
            try:
                sim.gate(proc, "serve", "before")
                clock.sleep(sim.p.transfer_time / 2)
                sim.gate(proc, "serve", "during")
                clock.sleep(sim.p.transfer_time / 2)
                sim._wait_unstalled(proc)
                deliver((meta, snap))
                sim.gate(proc, "serve", "after")
            except Killed:
                deliver(PeerClosed("donor connection reset"))
            finally:
                done.set()

        clock.spawn(run, name=f"serve-{proc.name}-{joiner_id}")
        return done

    def receive(self, adm: Admission, template: DilocoState, cancelled: Callable[[], bool],
                timeout: float) -> tuple[dict[str, Any], DilocoState]:
        sim, proc, clock = self.sim, self.proc, self.sim.clock
        sim.gate(proc, "receive", "before")
        deadline = clock.now() + timeout
        with sim.cond:
            while adm.outer_step not in proc.mailbox:
                if proc.dead:
                    raise Killed()
                if cancelled():
                    raise TransferFailed(f"admission from {adm.donor_id} revoked")
                left = deadline - clock.now()
                if left <= 0:
                    raise PeerTimeout(f"no state from {adm.donor_id} within {timeout:.0f}s")
                sim.cond.wait(min(left, sim.p.heartbeat_interval))
            item = proc.mailbox.pop(adm.outer_step)
        sim.gate(proc, "receive", "during")
        if isinstance(item, Exception):
            raise item
        sim.gate(proc, "receive", "after")
        meta, snap = item
        return meta, copy.deepcopy(snap)


class _Disk:
    """A node's checkpoints: they outlive its processes (keep the newest 3)."""

    def __init__(self, sim: Sim, proc: Proc, held: DilocoState | None) -> None:
        self.sim, self.proc, self.held = sim, proc, held

    def latest(self) -> DilocoState | None:
        return self.held

    def save(self, s: DilocoState, *, wait: bool = False) -> None:
        if self.proc.dead:
            raise Killed()
        self.proc.disk[s.inner_step] = copy.deepcopy(s)
        for k in sorted(self.proc.disk)[:-3]:
            del self.proc.disk[k]

    def load(self, inner_step: int) -> DilocoState:
        return copy.deepcopy(self.proc.disk[inner_step])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.diloco.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="replay one seed")
    ap.add_argument("--seeds", default="0:50", help="a range START:END of seeds")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the event log of each seed")
    a = ap.parse_args(argv)
    seeds = [a.seed] if a.seed is not None else range(*map(int, a.seeds.split(":")))
    bad, total = 0, Counter()
    t0 = time.monotonic()
    for seed in seeds:
        r = Sim(seed).run()
        total.update(r["faults"])
        if a.verbose:
            print("\n".join(r["log"]))
        if not r["ok"]:
            bad += 1
            print(f"seed {seed}: FAILED: {'; '.join(r['problems'])}  (replay: python -m intellect_jax.diloco.sim "
                  f"--seed {seed} -v)", flush=True)
    n = len(seeds)
    print(f"{n - bad}/{n} seeds passed in {time.monotonic() - t0:.1f}s; faults injected: {dict(total)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
