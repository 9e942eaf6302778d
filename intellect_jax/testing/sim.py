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
for admission, around its registration) or SIGSTOPped for a while; the coordinator crashes and
restarts from its journal, or is SIGSTOPped for 0.05-30 s (its clients see the timeouts a
real client sees); the coordinator starts after the founders; a node and the coordinator die
together; several nodes, or every node but one, die at once (an outage); nodes (re)start
while the coordinator is down or paused; killed nodes restart from their newest or from an
older checkpoint, or with an empty disk; checkpoints are sometimes 2-3 outer steps apart (a
restart can lose the newest state: the coordinator rolls back by itself); new nodes join; one
registers after the run has completed. The invariants checked (:meth:`Sim.check`): never two
hashes for one outer step among everything any node recorded, the run completes, every node
still alive ends cleanly (none because of a transient coordinator fault) and soon after the
run completed, no node is evicted for a stall of the coordinator's own, nothing hangs.

    python -m intellect_jax.testing.sim --seeds 0:200      # prints one line per failing seed
    python -m intellect_jax.testing.sim --seed 17 -v       # replay one seed with its event log
"""

from __future__ import annotations

import argparse
import bisect
import copy
import dataclasses
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.testing.clock import SimClock
from intellect_jax.coordinator.journal import MemoryJournal
from intellect_jax.diloco.loop import LoopConfig, NodeLoop, NodeParts, Outcome
from intellect_jax.coordinator.protocol import CoordinatorConfig, CoordinatorUnavailable
from intellect_jax.coordinator.service import ServiceStopped
from intellect_jax.testing.local_coordinator import LocalCoordinator
from intellect_jax.testing.sim_parts import (HOOKS, Fault, Killed, Proc, Script, SimInner, SimParams, _Comm, _Disk,
                                            _Gated, _Group, _StallWire, _Transport, corrupt)
from intellect_jax.diloco.state import DilocoState, state_hash
from intellect_jax.net.comm import RingConfig
from intellect_jax.net.errors import NetError

TRANSIENT_ENDS = (CoordinatorUnavailable, NetError, OSError, TimeoutError)  # no process may end of these

__all__ = ["Fault", "Killed", "Script", "Sim", "SimParams", "main"]

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
                                           tick_interval=0.1, outer_steps=p.outer_steps,
                                           auto_rollback_after=p.auto_rollback_after)
        tau = p.overlap_delay
        if p.overlap and tau == 0:  # half the seeds merge when ready, the others after a fixed delay
            tau = int(self.rng.integers(1, p.inner_steps + 1)) if self.rng.random() < 0.5 else None
        ckpt = p.ckpt_every
        if ckpt == 0:  # every outer step; some seeds further apart (a restart may then lose the newest state)
            ckpt = 1 if script is not None or self.rng.random() < 0.5 else int(self.rng.integers(2, 4))
        self.ckpt_every = ckpt
        self.journal = MemoryJournal()
        self.coord: LocalCoordinator | None = None  # started by the driver, in virtual time
        self.loop_cfg = LoopConfig(inner_steps=p.inner_steps, outer_steps=p.outer_steps, outer_lr=p.outer_lr,
                                   outer_momentum=p.outer_momentum, transfer_timeout=p.transfer_timeout,
                                   admission_timeout=p.max_time, watch_interval=p.heartbeat_interval,
                                   ckpt_every=ckpt * p.inner_steps, eval_every=0, overlap=p.overlap,
                                   overlap_delay=tau)
        self.ring_cfg = RingConfig(mode="int8", block_size=32, piece_numel=64, deadline=p.ring_deadline)
        self.procs: list[Proc] = []
        self.disks: dict[str, dict[int, DilocoState]] = {}
        self.rows: list[tuple[str, int, dict[str, Any]]] = []  # (proc, inner step, row) as recorded
        self.groups: dict[tuple[int, int], _Group] = {}  # (epoch, boundary): an epoch spans steps
        self.by_addr: dict[str, Proc] = {}
        self.injected: Counter = Counter()
        self.forced: dict[str, str] = {}  # node -> how the operator wants it restarted
        self.rolled_back_to: list[int] = []  # rollbacks seen, operator's or automatic (later rows discarded)
        self.discarded = 0
        self.coord_events: list[tuple[float, str]] = []  # (time, line) of every coordinator event
        self.newest_epoch = 0  # the newest epoch id any coordinator formed so far
        self.rollbacks_seen: list[tuple[int, float]] = []  # (to, newest epoch of the abandoned history)
        self.completed_at: float | None = None  # when the run completed (the newest time)
        self.paused_until = 0.0  # the coordinator is SIGSTOPped until then
        self.pausing = False  # a pause is under way (its thread holds, or waits for, the service's lock)
        self.pauses: list[tuple[float, float]] = []  # (from, until) of each coordinator pause
        self.paused_services: list[Any] = []  # the coordinator service each pause stopped (its .stalls)
        self.coord_up_at: float | None = None  # a crashed coordinator restarts then
        self.downtimes: list[tuple[float, float]] = []  # (from, until) of each coordinator crash
        self.restart_delay: dict[str, float] = {}  # node -> seconds before its restart (else drawn)
        rs = np.random.default_rng(12345)  # the task itself is the same for every seed
        self.targets = [rs.standard_normal(p.dim).astype(np.float32) for _ in range(p.nodes + p.late_joiners + 2)]
        self.init = {"w": rs.standard_normal(p.dim).astype(np.float32), "u": np.zeros((4, 8), np.float32)}

    # ---- log -----------------------------------------------------------------------------------
    def say(self, who: str, line: str) -> None:
        self.log.append(f"{self.clock.now():9.3f} [{who}] {line}")

    def _coord_event(self, line: str) -> None:
        """A coordinator event line (under its lock): logged, kept for the checks; a rollback
        discards at once the rows recorded after its point (that history was abandoned)."""
        now = self.clock.now()
        self.say("coord", line)
        self.coord_events.append((now, line))
        if line.startswith("run complete"):
            self.completed_at = now
        m = re.match(r"epoch (\d+): members", line)
        if m:
            self.newest_epoch = max(self.newest_epoch, int(m.group(1)))
        m = re.search(r"rolled the run back from outer step (\d+) to (\d+)", line)
        if m:
            self.completed_at = None
            self._discard_after(int(m.group(2)), self.newest_epoch)

    # ---- processes -----------------------------------------------------------------------------
    def _faults(self, joining: bool) -> list[Fault]:
        if self.rng.random() >= self.p.fault_prob:
            return []
        # a process that will join mostly faults where joiners are; founders also while donating
        weights = dict(zip(HOOKS, (1, 1, 1, 0, 3, 3, 2) if joining else (2, 2, 2, 2, 0, 0, 1)))
        hook = str(self.rng.choice(HOOKS, p=[weights[h] / sum(weights.values()) for h in HOOKS]))
        kind = str(self.rng.choice(["kill", "kill", "stall", "stall"]
                                   + (["partial", "partial-outage"] if hook == "allreduce" else [])))
        when = str(self.rng.choice(["before", "during", "after"] if hook in ("train", "serve", "receive")
                                   else ["before", "after"]))
        if kind.startswith("partial"):
            when = "before"
        long = self.rng.random() < 0.7  # long stalls (SIGSTOP 1.5-30 s) get the node evicted, short ones not
        seconds = float(self.rng.uniform(1.5, 30.0) if long else self.rng.uniform(0.05, 0.5))
        rare = hook in ("serve", "receive", "admit", "register")  # a process calls these once or twice
        return [Fault(hook, int(self.rng.integers(0, 2 if rare else 6)), kind, when, seconds)]

    def start(self, node_id: str, start_from: str, faults: list[Fault] | None = None) -> Proc:
        disk = self.disks.setdefault(node_id, {})
        number = sum(1 for q in self.procs if q.node_id == node_id)
        if faults is None:
            faults = (list(self.script.faults.get(f"{node_id}#{number}", [])) if self.script
                      else self._faults(joining=start_from != "fresh" or self.clock.now() > 0))
        proc = Proc(node_id, number, faults, disk, start_from, started_at=self.clock.now())
        self.procs.append(proc)
        self.by_addr[proc.addr] = proc
        if self.coord is not None and self.coord.service is None:
            self.injected["start while coordinator down"] += 1
        elif self.coordinator_paused():
            self.injected["start while coordinator paused"] += 1
        self.say(proc.name, f"start ({start_from}; faults {proc.faults})")
        self.clock.spawn(lambda: self._main(proc), name=proc.name)
        return proc

    def _main(self, proc: Proc) -> None:
        p, clock = self.p, self.clock
        rank = int(proc.node_id.removeprefix("n"))
        wire = _StallWire(self.coord.wire(), proc, self)
        client = CoordinatorClient(None, None, proc.node_id, proc.addr, wire=wire, clock=clock,
                                   heartbeat_interval=p.heartbeat_interval, reconnect_timeout=p.reconnect_timeout,
                                   connect_timeout=p.connect_timeout, fingerprint="sim", outer_steps=p.outer_steps,
                                   say=lambda line: self.say(proc.name, line))
        proc.client = client
        held = None
        if proc.start_from in ("latest", "stale") and proc.disk:
            steps = sorted(proc.disk)
            pick = steps[-1] if proc.start_from == "latest" else steps[int(self.rng.integers(0, len(steps)))]
            held = copy.deepcopy(proc.disk[pick])
        elif proc.start_from == "empty":
            proc.disk.clear()
        inner = SimInner(self, proc, self.targets[rank % len(self.targets)])
        parts = NodeParts(proc.node_id, inner, _Gated(client, proc, self, {"sync": "sync", "wait_admission": "admit",
                                                                "register": "register"}),
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

            proc.error, proc.exc = f"{type(e).__name__}: {e}", e
            self.say(proc.name, f"UNHANDLED {proc.error}\n{traceback.format_exc()}")
        finally:
            proc.ended_at = clock.now()
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
                    proc.stalls.append((self.clock.now(), proc.stalled_until))
                    self.clock.sleep(f.seconds)
                    self.say(proc.name, f"resumes after a {f.seconds:.2f}s stall")
                return f
        return None

    def poison(self, proc: Proc, where: str, step: int, tree: Any) -> Any:
        """``tree`` as the node's pseudo-gradient of outer step ``step`` (``where``: "own" before its
        own check, "wire" on its way into the ring), corrupted if a poison fault says so."""
        for f in proc.faults:
            if f.hook == "poison" and f.when == where and f.nth == step:
                self.injected[f"poison {f.value} ({where})"] += 1
                self.say(proc.name, f"FAULT poison ({f.value}, {where}) at outer step {step}")
                return corrupt(tree, f.value)
        return tree

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
        proc.dead, proc.killed_at = True, self.clock.now()
        self.say(proc.name, "SIGKILL")
        if proc.client is not None:
            proc.client.close()
        with self.cond:
            self.cond.notify_all()
        raise Killed()

    # ---- the coordinator ------------------------------------------------------------------------
    def coordinator_paused(self) -> bool:
        return self.pausing or self.paused_until > self.clock.now()

    def pause_coordinator(self, seconds: float) -> bool:
        """SIGSTOP the coordinator for ``seconds``: a thread holds the service's one lock that long
        (its ticker and every request wait, as a stopped process's would); False if it is down."""
        svc, clock = self.coord.service, self.clock
        if svc is None or self.coordinator_paused():
            return False
        now = clock.now()
        self.paused_until, self.pausing = now + seconds, True
        self.pauses.append((now, now + seconds))
        self.paused_services.append(svc)
        self.injected["coordinator pause (" + ("long" if seconds >= self.p.connect_timeout else "short") + ")"] += 1
        self.say("driver", f"coordinator paused (SIGSTOP) for {seconds:.2f}s")

        def hold() -> None:
            try:
                svc.locked(lambda t: clock.sleep(max(0.0, self.paused_until - t)))
            except ServiceStopped:
                pass
            finally:
                self.pausing = False
                self.say("driver", "coordinator resumes (SIGCONT)")

        clock.spawn(hold, name="coordinator-pause")
        return True

    def crash_coordinator(self, down: float) -> None:
        """SIGKILL the coordinator; the driver restarts it (journal reloaded) ``down`` s later."""
        now = self.clock.now()
        self.say("driver", f"coordinator crashes for {down:.2f}s")
        self.coord.crash()
        self.coord_up_at = now + down
        self.downtimes.append((now, now + down))

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
        for rb in self.journal.load("sim").rollbacks:
            self.injected["rollback (" + ("operator" if str(rb.get("by", "")).startswith("operator")
                                          else "automatic") + ")"] += 1
        return {"seed": self.seed, "ok": not problems, "problems": problems, "faults": dict(self.injected),
                "procs": len(self.procs), "virtual_s": round(self.clock.now(), 2),
                "real_s": round(time.monotonic() - t0, 2), "log": self.log}

    def _schedule(self) -> list[tuple[float, str, str]]:
        """The seeded driver events (see :class:`Script` for what each does)."""
        p, rng = self.p, self.rng
        events: list[tuple[float, str, str]] = []

        def also_start() -> str:  # a node killed as the window opens restarts inside it
            return ",start" if rng.random() < p.start_in_window_prob else ""

        for _ in range(int(rng.integers(0, p.coordinator_restarts + 1))):
            events.append((float(rng.uniform(0.2, 4.0)), "coordinator", f"{rng.uniform(0.2, 3.0):.3f}{also_start()}"))
        for j in range(int(rng.integers(0, p.late_joiners + 1))):
            events.append((float(rng.uniform(0.1, 3.0)), "join", f"n{p.nodes + j}"))
        if rng.random() < p.outage_prob:  # several nodes die at once (a site outage), all but one, or all
            u = rng.random()  # (the correlated ones mostly once the run is under way: from 2 s, the join window)
            kind = "all-but-one" if u < p.all_but_one_prob else "all" if u < p.all_but_one_prob + p.all_prob else ""
            events.append((float(rng.uniform(1.5, 3.0) if kind else rng.uniform(0.05, 2.0)), "outage", kind))
        for _ in range(int(rng.integers(0, p.coordinator_pauses + 1))):  # log-uniform 0.05 s .. max_pause
            seconds = math.exp(rng.uniform(math.log(0.05), math.log(p.max_pause)))
            events.append((float(rng.uniform(0.05, 4.0)), "pause", f"{seconds:.3f}{also_start()}"))
        if rng.random() < p.node_and_coordinator_prob:
            events.append((float(rng.uniform(0.2, 4.0)), "kill+coordinator", ""))
        if rng.random() < p.late_coordinator_prob:  # the founders start before their coordinator
            events.append((0.0, "coordinator", f"{rng.uniform(0.5, 5.0):.3f}"))
        return events

    def _alive(self) -> list[Proc]:
        return [q for q in self.procs if not q.dead and q.outcome is None and q.error is None]

    def _event(self, what: str, arg: str, events: list[tuple[float, str, str]]) -> None:
        """One driver event; one that cannot happen now (a crash or a pause while the coordinator
        is paused, a pause while it is down) is put back for when it can."""
        rng, now = self.rng, self.clock.now()
        if what in ("coordinator", "pause", "kill+coordinator"):
            busy = (self.paused_until if self.coordinator_paused() else
                    self.coord_up_at if self.coord_up_at is not None else None)
            if busy is not None:
                bisect.insort(events, (max(busy, now) + 0.1, what, arg))
                return
        seconds, _, flag = arg.partition(",")
        if what == "coordinator":
            down = float(seconds) if seconds else float(rng.uniform(0.2, 3.0))
            self.injected["coordinator restart"] += 1
            self.crash_coordinator(down)
        elif what == "pause":
            down = float(seconds) if seconds else 20.0
            self.pause_coordinator(down)
        elif what == "kill+coordinator":
            alive = self._alive()
            victims = [q for q in alive if q.node_id == arg] if arg else (
                [alive[int(rng.integers(0, len(alive)))]] if alive else [])
            down = float(rng.uniform(0.2, 3.0))
            self.injected["node and coordinator killed together"] += 1
            self.say("driver", f"SIGKILL {[q.name for q in victims]} and the coordinator together")
            for q in victims:
                self.kill_from_outside(q)
            self.crash_coordinator(down)
        elif what == "outage":
            alive = self._alive()
            if arg in ("all-but-one", "all"):
                spared = alive[int(rng.integers(0, len(alive)))] if alive and arg != "all" else None
                victims = [q for q in alive if q is not spared]
                self.injected[f"outage ({arg.replace('-', ' ')})"] += 1
            else:
                victims = ([q for q in alive if q.node_id in arg.split(",")] if arg
                           else [q for q in alive if rng.random() < 0.6])
                self.injected["outage"] += 1
            self.say("driver", f"outage: SIGKILL {[q.name for q in victims]}")
            for q in victims:
                self.kill_from_outside(q)
        else:
            self.injected["late join"] += 1
            self.start(arg, "fresh")
        if flag == "start" and what in ("coordinator", "pause"):  # a node restarts inside the window
            alive = self._alive()
            if alive:
                q = alive[int(rng.integers(0, len(alive)))]
                self.say("driver", f"SIGKILL {q.name}: it restarts while the coordinator is "
                                   f"{'down' if what == 'coordinator' else 'paused'}")
                self.kill_from_outside(q)
                self.restart_delay[q.node_id] = float(rng.uniform(0.05, 0.9)) * float(seconds)

    def _drive(self) -> None:
        p, rng, clock = self.p, self.rng, self.clock
        self.coord = LocalCoordinator(self.coord_cfg, run_id="sim", clock=clock, journal=self.journal,
                                      on_event=self._coord_event)
        events = sorted(self.script.events if self.script is not None else self._schedule())
        while events and events[0][0] <= 0:  # e.g. the coordinator starts after the founders
            _, what, arg = events.pop(0)
            self._event(what, arg, events)
        for i in range(p.nodes):
            self.start(f"n{i}", "fresh")
        pending_restarts: dict[str, float] = {}
        while clock.now() < p.max_time:
            now = clock.now()
            if self.coord_up_at is not None and now >= self.coord_up_at:
                self.coord_up_at = None
                self.coord.start()
                self.say("driver", "coordinator restarted (journal reloaded)")
            while events and events[0][0] <= now:
                _, what, arg = events.pop(0)
                self._event(what, arg, events)
                self.check()
            for q in self.procs:  # restart the killed
                if q.dead and not q.restarted and q.node_id not in pending_restarts:
                    delay = self.restart_delay.pop(q.node_id, None)
                    pending_restarts[q.node_id] = now + (delay if delay is not None else float(rng.uniform(0.3, 3.0)))
                    q.restarted = True
            for node_id, t in list(pending_restarts.items()):
                if clock.now() >= t:
                    del pending_restarts[node_id]
                    mode = self.forced.pop(node_id, None) or (
                        self.script.restarts.get(node_id, "latest") if self.script
                        else str(rng.choice(["latest", "latest", "latest", "stale", "empty"])))
                    if mode == "none":
                        self.say("driver", f"{node_id} stays down")
                        continue
                    self.injected[f"restart ({mode})"] += 1
                    self.start(node_id, mode)
                    self.check()
            running = self._alive()
            if not running and not pending_restarts and not events and self.coord_up_at is None:
                break
            self._operator(running, pending_restarts)
            clock.sleep(0.1)
        if self.journal.load("sim").completed:  # one more node registers after the end
            late = self.start(f"n{p.nodes + p.late_joiners + 1}", "fresh")
            while late.outcome is None and late.error is None:
                if late.dead:  # a fault of its own: it comes back (without one)
                    clock.sleep(float(rng.uniform(0.3, 3.0)))
                    late = self.start(late.node_id, "latest", faults=[])
                clock.sleep(0.1)
            if late.outcome is not Outcome.COMPLETED:
                late.error = late.error or f"registered after completion and ended {late.outcome}"
        while self.pausing:
            clock.sleep(0.1)
        self.coord.crash()

    def _operator(self, running: list[Proc], pending_restarts: dict[str, float]) -> None:
        """What an operator does when the run has waited 20 s with no live node holding its
        newest state: restart a node whose disk has that state from its newest checkpoint, or,
        if no disk has it any more and the coordinator does not roll back by itself
        (``auto_rollback_after`` None), restart the coordinator allowing a rollback to the
        newest state any disk still has (the history after it is discarded explicitly, and
        logged). Nothing while the coordinator is down or paused."""
        rec = self.journal.load("sim")
        holders = [q for q in running if q.client is not None and q.client.member]
        if rec.hwm_step is None or rec.completed or pending_restarts or holders:
            self._stuck_since = None
            return
        if self.coord.service is None or self.coordinator_paused():
            return
        now = self.clock.now()
        self._stuck_since = getattr(self, "_stuck_since", None) or now
        if now - self._stuck_since < 20.0:
            return
        self._stuck_since = None
        newest = [node for node, disk in self.disks.items() for st in disk.values()
                  if st.outer_step > rec.hwm_step or (st.outer_step == rec.hwm_step
                                                      and state_hash(st) == rec.hwm_hash)]
        if newest:
            node = newest[0]
            self.injected["operator restart"] += 1
            self.say("driver", f"OPERATOR: {node}'s disk has the newest state; restarting {node} from it")
            for q in self.procs:
                if q.node_id == node and not q.dead:
                    self.kill_from_outside(q)
                q.restarted = q.restarted or q.node_id == node
            self.forced[node] = "latest"
            pending_restarts[node] = now + 0.5
            return
        if self.p.auto_rollback_after is not None:
            return  # the coordinator rolls back by itself
        on_disk = [st.outer_step for disk in self.disks.values() for st in disk.values()]
        to = max(on_disk, default=0)  # 0: start over from the seeded initial state
        self.injected["operator rollback"] += 1
        self.say("driver", f"OPERATOR: the state of outer step {rec.hwm_step} is lost; restarting the coordinator "
                           f"with allow_rollback_to={to}")
        self.coord.crash()
        self.coord.start(dataclasses.replace(self.coord_cfg, allow_rollback_to=to))
        for q in self.procs:  # nodes whose processes are gone come back from their disks
            if q.dead and q.disk and not any(r.node_id == q.node_id and not r.dead for r in self.procs):
                pending_restarts.setdefault(q.node_id, now + 0.5)

    def _discard_after(self, to: int, last_epoch: float = math.inf) -> None:
        """A rollback to outer step ``to``: the rows of the abandoned history after it go, now
        and whenever they are written (a node stopped before it logged its last step of that
        history may log it after the rollback): those of epochs up to ``last_epoch``, the
        newest epoch formed before the rollback (epoch ids only grow, journaled)."""
        self.rolled_back_to.append(to)
        self.rollbacks_seen.append((to, last_epoch))
        self._drop_abandoned()

    def _drop_abandoned(self) -> None:
        kept = [r for r in self.rows if not any(r[2]["outer_step"] > to and r[2].get("epoch", 0) <= last
                                                for to, last in self.rollbacks_seen)]
        self.discarded += len(self.rows) - len(kept)
        self.rows = kept

    def _note_rollbacks(self) -> None:
        """Rollbacks in the journal (an operator's or automatic) not yet seen as event lines."""
        rec = self.journal.load("sim")
        for rb in rec.rollbacks[len(self.rolled_back_to):]:
            self._discard_after(rb["to"])
        self._drop_abandoned()

    def stall_evictions(self) -> list[str]:
        """Evictions that no fault of the node explains: caused by the coordinator's own stall.

        Which evictions: for silence ("no heartbeat for Xs", "missed boundary ...") and for a
        session its client dropped ("connection lost": a client that gives its session up while
        the coordinator is paused). Such an eviction of node N at time t is explained if in the
        window it was judged on some process of N was SIGKILLed, was SIGSTOPped, or (for a
        dropped session) ended or the coordinator crashed and restarted. The window ends at t
        and reaches back ``X + slack`` (heartbeat), ``boundary_timeout + slack`` (boundary) or
        ``reconnect_timeout + slack`` (dropped session: as long as a client may take to give
        up) seconds as the coordinator counts them: net of its own pauses (the stalls it
        excuses) and, to be safe, of its crashes, so the window reaches back over every pause
        or crash inside it (``X`` as the line says; ``slack``: two heartbeat intervals and two
        ticks). E.g. a node stopped 2.1-8.4 s, then a coordinator pause 3.8-22.5 s: the node is
        evicted at 22.5 s for the 1 s of silence it had before the pause: explained. Anything
        else (a stall the coordinator failed to excuse, a heartbeat or session lost in a stalled
        wire) is reported."""
        p, out = self.p, []
        slack = 2 * p.heartbeat_interval + 2 * self.coord_cfg.tick_interval
        outside = sorted(self.pauses + self.downtimes, key=lambda w: -w[1])
        for t, line in self.coord_events:
            m = re.match(r"evicted (\S+): (no heartbeat for ([\d.]+)s|missed boundary|connection lost)", line)
            if not m:
                continue
            node, why = m.group(1), m.group(2)
            dropped = why == "connection lost"
            need = slack + (float(m.group(3)) if m.group(3) else p.reconnect_timeout if dropped
                            else self.coord_cfg.boundary_timeout)
            start = t  # walk back from t over `need` seconds the coordinator counted (it skips its pauses)
            for a, b in outside:
                if a >= start:
                    continue
                if b < start:
                    if start - b >= need:
                        break
                    need -= start - b
                start = a
            start -= need
            procs = [q for q in self.procs if q.node_id == node]
            explained = any((q.killed_at is not None and start <= q.killed_at <= t)
                            or any(a <= t and b >= start for a, b in q.stalls) for q in procs)
            if dropped and not explained:
                explained = (any(q.ended_at is not None and start <= q.ended_at <= t for q in procs)
                             or any(a <= t and b >= start for a, b in self.downtimes))
            if not explained:
                out.append(f"{node} evicted at {t:.1f}s ({why}) with no kill or stall of it since "
                           f"{start:.1f}s: the coordinator's own stall got it evicted")
        return out

    def late_ends(self) -> list[str]:
        """Processes that ended more than ``end_bound`` after the run completed and they could act
        again: after the completion, the process's start, its own last stall, and the end of
        the coordinator's last pause or crash (a donor that never lets go of a joiner shows
        here, as a node waiting on a transfer)."""
        if self.completed_at is None:
            return []
        out = []
        coord = max([b for _, b in self.pauses + self.downtimes], default=0.0)
        for q in self.procs:
            if q.dead or q.ended_at is None:
                continue
            settle = max([self.completed_at, q.started_at, coord] + [b for _, b in q.stalls])
            if q.ended_at - settle > self.p.end_bound:
                out.append(f"{q.name} ended {q.ended_at - settle:.1f}s after the run completed (bound "
                           f"{self.p.end_bound:.0f}s){self._why_late(q)}")
        return out

    def _why_late(self, q: Proc) -> str:
        """A diagnosis of a late end, where the log shows one (product bugs known to cause it)."""
        mine = [line.split("] ", 1)[1] for line in self.log if f" [{q.name}] " in line]
        told = next((i for i, line in enumerate(mine) if line.startswith("nothing to do: the run is complete")), None)
        if told is not None and any(re.match(r"serving \S+ failed: not reachable", line) for line in mine[told:]):
            return (": DONOR NEVER LET GO: its registration again was told the run is complete, yet its "
                    "transfers waited out transfer_timeout (CoordinatorClient.serving_revoked stays False: "
                    "register() cleared _fatal and a refused registration sets no view)")
        return ""

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
                elif q.error and isinstance(q.exc, TRANSIENT_ENDS):  # the client must wait those out
                    problems.append(f"{q.name} ended because of a transient coordinator fault: {q.error}")
                elif q.error:
                    problems.append(f"{q.name}: unhandled {q.error}")
            problems += self.stall_evictions()
            problems += self.late_ends()
        if problems and not final:
            self.say("driver", "INVARIANT " + "; ".join(problems))
        return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.testing.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="replay one seed")
    ap.add_argument("--seeds", default="0:50", help="a range START:END of seeds")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the event log of each seed")
    ap.add_argument("--overlap", action="store_true", help="the nodes run overlapped rounds")
    a = ap.parse_args(argv)
    seeds = [a.seed] if a.seed is not None else range(*map(int, a.seeds.split(":")))
    bad, total = 0, Counter()
    t0 = time.monotonic()
    for seed in seeds:
        r = Sim(seed, SimParams(overlap=a.overlap)).run()
        total.update(r["faults"])
        if a.verbose:
            print("\n".join(r["log"]))
        if not r["ok"]:
            bad += 1
            print(f"seed {seed}: FAILED: {'; '.join(r['problems'])}  (replay: python -m intellect_jax.testing.sim "
                  f"--seed {seed} -v)", flush=True)
    n = len(seeds)
    print(f"{n - bad}/{n} seeds passed in {time.monotonic() - t0:.1f}s; faults injected: {dict(total)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
