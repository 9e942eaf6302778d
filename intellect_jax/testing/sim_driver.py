"""The driver of the fault simulation (see :mod:`.sim` for what it simulates and checks):
:class:`Sim` starts the node processes (each a thread running the real :class:`~.loop.NodeLoop`
with the stand-ins of :mod:`.sim_parts`) and the coordinator, plays the schedule of
:mod:`.sim_plan` against them (kills, stalls, coordinator crashes and pauses, outages, joins,
an operator's restarts and rollbacks), and checks the invariants of :mod:`.sim_checks`."""

from __future__ import annotations

import bisect
import copy
import dataclasses
import math
import re
import time
from typing import Any

import numpy as np

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.coordinator.journal import MemoryJournal
from intellect_jax.coordinator.protocol import CoordinatorConfig, DataPlan
from intellect_jax.coordinator.service import ServiceStopped
from intellect_jax.net.codecs import gathered
from intellect_jax.diloco.loop import NodeLoop
from intellect_jax.diloco.parts import LoopConfig, NodeParts, Outcome
from intellect_jax.diloco.state import DilocoState, state_hash
from intellect_jax.testing import sim_checks
from intellect_jax.testing.local_coordinator import LocalCoordinator
from intellect_jax.testing.sim_parts import SimInner, _Comm, _Disk, _Gated, _StallWire, _Transport
from intellect_jax.testing.sim_plan import (Fault, Script, SimParams, draw_faults, draw_forgers, draw_frames, draw_schedule,
                                           draw_steerers, draw_withholder, unit_steps)
from intellect_jax.testing.sim_world import Killed, Proc, World

__all__ = ["Sim"]


class Sim(World):
    """One seeded run; :meth:`run` returns a report dict (``ok``, ``problems``, counts, log)."""

    def __init__(self, seed: int, params: SimParams | None = None, *, script: Script | None = None,
                 verbose: bool = False) -> None:
        super().__init__(seed, params)
        self.script, self.verbose = script, verbose
        self.frame_rng = np.random.default_rng([seed, 21])  # its own stream: a seed's other draws stay put
        self.forge_rng = np.random.default_rng([seed, 22])  # likewise
        self.steer_rng = np.random.default_rng([seed, 24])  # likewise
        self.withholder = draw_withholder(np.random.default_rng([seed, 23]), self.p)  # likewise
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
                                   overlap_delay=tau, feedback=p.feedback if gathered(p.mode) else 0.0,
                                   feedback_local=p.feedback_local if gathered(p.mode) else 0.0,
                                   data_units=(unit_steps(p.inner_steps), 1000 * unit_steps(p.inner_steps), "sim")
                                   if p.leases else None)
        self.procs: list[Proc] = []
        self.disks: dict[str, dict[int, DilocoState]] = {}
        self.forced: dict[str, str] = {}  # node -> how the operator wants it restarted
        self.rolled_back_to: list[int] = []  # rollbacks seen, operator's or automatic (later rows discarded)
        self.discarded = 0
        self.coord_events: list[tuple[float, str]] = []  # (time, line) of every coordinator event
        self.newest_epoch = 0  # the newest epoch id any coordinator formed so far
        self.rollbacks_seen: list[tuple[int, float]] = []  # (to, newest epoch of the abandoned history)
        self.completed_at: float | None = None  # when the run completed (the newest time)
        self.pauses: list[tuple[float, float]] = []  # (from, until) of each coordinator pause
        self.paused_services: list[Any] = []  # the coordinator service each pause stopped (its .stalls)
        self.coord_up_at: float | None = None  # a crashed coordinator restarts then
        self.downtimes: list[tuple[float, float]] = []  # (from, until) of each coordinator crash
        self.restart_delay: dict[str, float] = {}  # node -> seconds before its restart (else drawn)

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
    def start(self, node_id: str, start_from: str, faults: list[Fault] | None = None) -> Proc:
        disk = self.disks.setdefault(node_id, {})
        number = sum(1 for q in self.procs if q.node_id == node_id)
        if faults is None:
            faults = (list(self.script.faults.get(f"{node_id}#{number}", [])) if self.script
                      else draw_faults(self.rng, self.p, joining=start_from != "fresh" or self.clock.now() > 0)
                      + draw_frames(self.frame_rng, self.p) + draw_forgers(self.forge_rng, self.p)
                      + draw_steerers(self.steer_rng, self.p))
            if self.script is None and self.withholder and self.withholder[0] == node_id:
                faults += [Fault("withhold", s, "withhold") for s in range(self.withholder[1], self.p.outer_steps + 1)]
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
        wire = _StallWire(self.coord.wire(proc.node_id), proc, self)
        client = CoordinatorClient(None, None, proc.node_id, proc.addr, wire=wire, clock=clock,
                                   heartbeat_interval=p.heartbeat_interval, reconnect_timeout=p.reconnect_timeout,
                                   connect_timeout=p.connect_timeout, fingerprint="sim", outer_steps=p.outer_steps,
                                   say=lambda line: self.say(proc.name, line),
                                   data=DataPlan(True) if p.leases else None)
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
                                                                "register": "register", "lease": "lease"}),
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

    # ---- the coordinator ------------------------------------------------------------------------
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
        self.coord = LocalCoordinator(self.coord_cfg, run_id=self.run_id, clock=clock, journal=self.journal,
                                      on_event=self._coord_event, ca=self.ca)
        events = sorted(self.script.events if self.script is not None else draw_schedule(self.rng, self.p))
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

    # ---- the invariants (sim_checks) ------------------------------------------------------------
    def stall_evictions(self) -> list[str]:
        """Evictions that only the coordinator's own stall explains (:func:`.sim_checks.stall_evictions`)."""
        return sim_checks.stall_evictions(self.coord_events, self.procs, self.pauses, self.downtimes, self.p,
                                          self.coord_cfg)

    def withheld_window(self) -> float:
        """How far back a stall explains an eviction for withholding pieces: ``stall_calls``
        failed calls, each up to a barrier and a ring deadline, and the coordinator's pauses."""
        per_call = self.p.ring_deadline + self.coord_cfg.boundary_timeout
        return (self.coord_cfg.stall_calls + 1) * per_call + sum(b - a for a, b in self.pauses + self.downtimes)

    def late_ends(self) -> list[str]:
        """Processes that lingered after the run completed (:func:`.sim_checks.late_ends`)."""
        return sim_checks.late_ends(self.procs, self.completed_at, self.pauses + self.downtimes, self.p.end_bound,
                                    self.log)

    def check(self, final: bool = False) -> list[str]:
        """The invariants (see the module docstring); raises nothing, returns the violations."""
        self._note_rollbacks()
        rec = self.journal.load("sim")
        problems = sim_checks.forks(self.rows, rec)
        problems += sim_checks.leases(self.rows, rec, self.groups, final and rec.completed, self.verdicts)
        if final:
            if not rec.completed or rec.hwm_step != self.p.outer_steps:
                problems.append(f"run not completed: high-water mark {rec.hwm_step}, completed {rec.completed}")
            problems += sim_checks.ends(self.procs)
            problems += self.stall_evictions()
            problems += sim_checks.framed(self.coord_events, self.procs)
            problems += sim_checks.banned(self.coord_events, self.procs)
            problems += sim_checks.withheld(self.coord_events, self.procs, self.withheld_window())
            problems += sim_checks.steered(self.coord_events, self.procs)
            problems += self.late_ends()
        if problems and not final:
            self.say("driver", "INVARIANT " + "; ".join(problems))
        return problems
