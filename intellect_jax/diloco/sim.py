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
from typing import Any

import numpy as np

from intellect_jax.diloco.client import CoordinatorClient
from intellect_jax.diloco.clock import SimClock
from intellect_jax.diloco.journal import MemoryJournal
from intellect_jax.diloco.loop import LoopConfig, NodeLoop, NodeParts, Outcome
from intellect_jax.diloco.protocol import CoordinatorConfig
from intellect_jax.diloco.service import LocalCoordinator
from intellect_jax.diloco.sim_parts import (HOOKS, Fault, Killed, Proc, Script, SimInner, SimParams, _Comm, _Disk,
                                            _Gated, _Group, _StallWire, _Transport, corrupt)
from intellect_jax.diloco.state import DilocoState, state_hash
from intellect_jax.net.comm import RingConfig

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
                                           tick_interval=0.1, outer_steps=p.outer_steps)
        tau = p.overlap_delay
        if p.overlap and tau == 0:  # half the seeds merge when ready, the others after a fixed delay
            tau = int(self.rng.integers(1, p.inner_steps + 1)) if self.rng.random() < 0.5 else None
        self.journal = MemoryJournal()
        self.coord: LocalCoordinator | None = None  # started by the driver, in virtual time
        self.loop_cfg = LoopConfig(inner_steps=p.inner_steps, outer_steps=p.outer_steps, outer_lr=p.outer_lr,
                                   outer_momentum=p.outer_momentum, transfer_timeout=p.transfer_timeout,
                                   admission_timeout=p.max_time, watch_interval=p.heartbeat_interval,
                                   ckpt_every=p.inner_steps, eval_every=0, overlap=p.overlap,
                                   overlap_delay=tau)
        self.ring_cfg = RingConfig(mode="int8", block_size=32, piece_numel=64, deadline=p.ring_deadline)
        self.procs: list[Proc] = []
        self.disks: dict[str, dict[int, DilocoState]] = {}
        self.rows: list[tuple[str, int, dict[str, Any]]] = []  # (proc, inner step, row) as recorded
        self.groups: dict[tuple[int, int], _Group] = {}  # (epoch, boundary): an epoch spans steps
        self.by_addr: dict[str, Proc] = {}
        self.injected: Counter = Counter()
        self.forced: dict[str, str] = {}  # node -> how the operator wants it restarted
        self.rolled_back_to: list[int] = []  # operator rollbacks seen (the rows after them are discarded)
        self.discarded = 0
        rs = np.random.default_rng(12345)  # the task itself is the same for every seed
        self.targets = [rs.standard_normal(p.dim).astype(np.float32) for _ in range(p.nodes + p.late_joiners + 2)]
        self.init = {"w": rs.standard_normal(p.dim).astype(np.float32), "u": np.zeros((4, 8), np.float32)}

    # ---- log -----------------------------------------------------------------------------------
    def say(self, who: str, line: str) -> None:
        self.log.append(f"{self.clock.now():9.3f} [{who}] {line}")

    # ---- processes -----------------------------------------------------------------------------
    def _faults(self, joining: bool) -> list[Fault]:
        if self.rng.random() >= self.p.fault_prob:
            return []
        # a process that will join mostly faults where joiners are; founders also while donating
        weights = dict(zip(HOOKS, (1, 1, 1, 0, 3, 3) if joining else (2, 2, 2, 2, 0, 0)))
        hook = str(self.rng.choice(HOOKS, p=[weights[h] / sum(weights.values()) for h in HOOKS]))
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
        faults = (list(self.script.faults.get(f"{node_id}#{number}", [])) if self.script
                  else self._faults(joining=start_from != "fresh" or self.clock.now() > 0))
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
                    mode = self.forced.pop(node_id, None) or (
                        self.script.restarts.get(node_id, "latest") if self.script
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
        """What an operator does when the run has waited 20 s with no live node holding its
        newest state: restart a node whose disk has that state from its newest checkpoint, or,
        if no disk has it any more, restart the coordinator allowing a rollback to the newest
        state any disk still has (the history after it is discarded explicitly, and logged)."""
        rec = self.journal.load("sim")
        holders = [q for q in running if q.client is not None and q.client.member]
        if rec.hwm_step is None or rec.completed or pending_restarts or holders:
            self._stuck_since = None
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.diloco.sim", description=__doc__.split("\n\n")[0])
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
            print(f"seed {seed}: FAILED: {'; '.join(r['problems'])}  (replay: python -m intellect_jax.diloco.sim "
                  f"--seed {seed} -v)", flush=True)
    n = len(seeds)
    print(f"{n - bad}/{n} seeds passed in {time.monotonic() - t0:.1f}s; faults injected: {dict(total)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
