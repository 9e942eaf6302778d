"""Run membership of elastic DiLoCo as a pure state machine (no sockets, threads or clock).

Every method takes ``now`` (the coordinator's clock) so each protocol rule is unit-tested
deterministically; :mod:`.service` wraps it for the server. Numbering: *boundary k* is where a
member has completed ``k`` outer steps and finished the inner steps of step ``k+1``; ``sync(k)``
there returns the epoch whose ring all-reduces step ``k+1``'s pseudo-gradient.

One history: the run's :class:`~.journal.RunRecord` holds the hash recorded for every recent
outer step and the newest one (the high-water mark). A barrier records its step's hash (the
recorded one if there is one, else the members' majority) and evicts members whose state
differs; a node bringing state from an older step, or other bytes for a recorded step, is made
a joiner and takes a live peer's state. See ``docs/coordinator.md``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

from intellect_jax.coordinator.journal import RunRecord
from intellect_jax.coordinator.protocol import (
    PROTOCOL,
    Admission,
    CoordinatorConfig,
    Epoch,
    Evicted,
    Peer,
    ProtocolError,
    RegisterReply,
    RegistrationRefused,
    Resume,
    RunCompleted,
    StaleSession,
)


class Role(str, enum.Enum):
    MEMBER = "member"  # has the run's state; expected at every barrier
    PENDING = "pending"  # joiner waiting for the next boundary
    ADMITTED = "admitted"  # joiner with a donor; expected at the barrier ``admission.outer_step``


@dataclass(frozen=True)
class Arrival:
    step: int
    time: float
    state_hash: str | None
    retry: bool
    sits_out: str | None = None  # why this node contributes zeros to the next all-reduce
    report: dict | None = None  # on the all-reduce before: {"avg_failed": bool, "accused": [node, why] | None}


@dataclass(eq=False)  # identity semantics: nodes go in sets
class Node:
    node_id: str
    addr: str
    devices: int
    session: str
    role: Role
    order: tuple[int, int]  # ring order key (then node id)
    last_seen: float
    fresh: bool = False  # founding member of a fresh run (no progress to resume)
    arrival: Arrival | None = None
    outbox: Epoch | None = None  # result of the barrier it waits at
    admission: Admission | None = None
    received: bool = False  # admitted joiner reported state_received
    claim: Resume | None = None  # the state the node brought (a joiner's may resume a rebuild)
    sit_outs: int = 0  # barriers in a row at which it sat out
    strikes: int = 0  # failed rounds in which its ring successor blamed it


@dataclass(frozen=True)
class Barrier:
    """A completed barrier."""

    step: int
    epoch_id: int
    members: tuple[Peer, ...]
    sessions: tuple[str, ...] = ()  # of the members, to tell whether the epoch's ring is intact
    serve: dict[str, tuple[Peer, ...]] = field(default_factory=dict)
    hash_mismatch: tuple[Peer, ...] = ()
    changed: bool = True
    sitting_out: tuple[str, ...] = ()


class Membership:
    """Nodes, barriers, epochs, joiners and evictions of one run (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig | None = None, instance: str = "0",
                 record: RunRecord | None = None) -> None:
        self.config = config or CoordinatorConfig()
        self.instance = instance
        self.record = record or RunRecord()
        rec = self.record
        rec.fingerprint = rec.fingerprint or self.config.fingerprint
        rec.outer_steps = rec.outer_steps or self.config.outer_steps
        self._rollback = self.config.allow_rollback_to
        self._rollback_by = f"operator: allow_rollback_to={self._rollback}"  # who allowed it (journaled)
        self._nodes: dict[str, Node] = {}
        self._last: Barrier | None = None  # None: not started (fresh, restarted, or emptied)
        self._resumed = rec.hwm_step is not None  # the run has history: no fresh founders
        self._floor = self._lowest_resumable()  # not started: the lowest acceptable boundary
        self._seq = 0  # registrations (session ids) and joiner admissions (ring order)
        self._first_reg: float | None = None
        self._hashes: dict[int, dict[str, Any]] = {}
        self._evictions: list[dict[str, Any]] = []
        self._notes: list[str] = []  # changes since the last epoch, for its log line
        self._events: list[str] = []
        self._waiting_since: float | None = None  # not started with history: since when (auto rollback)
        self._unknown = False  # nodes bring history that the record lacks (a coordinator without its journal)
        self._quorum_said = False

    # ---- queries -------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str | None:
        return self.record.fingerprint

    @property
    def started(self) -> bool:
        return self._last is not None

    @property
    def outer_step(self) -> int:
        """The boundary the run is heading for."""
        return self._last.step + 1 if self._last else self._floor

    @property
    def epoch_id(self) -> int:
        return self._last.epoch_id if self._last else 0

    def alive(self, node_id: str, session: str) -> bool:
        """Whether this registration of the node is still in the run."""
        node = self._nodes.get(node_id)
        return node is not None and node.session == session

    def drain_events(self) -> list[str]:
        """Log lines produced since the last call."""
        ev, self._events = self._events, []
        return ev

    def status(self, now: float) -> dict[str, Any]:
        """Everything a launcher's live table or a test needs (JSON-serializable)."""
        nodes = [{"node_id": n.node_id, "addr": n.addr, "devices": n.devices, "role": n.role.value,
                  "heartbeat_age": round(now - n.last_seen, 3), "waiting_at": n.arrival.step if n.arrival else None,
                  "donor": n.admission.donor_id if n.admission and n.role is Role.ADMITTED else None,
                  "state_received": n.received} for n in self._sorted(self._nodes.values())]
        last, rec = self._last, self.record
        return {"outer_step": self.outer_step, "started": self.started, "fingerprint": self.fingerprint,
                "protocol": PROTOCOL, "epoch": {"epoch_id": last.epoch_id, "outer_step": last.step,
                                                "members": [list(p) for p in last.members]} if last else None,
                "next_epoch_id": rec.next_epoch, "nodes": nodes,
                "joiners": [n["node_id"] for n in nodes if n["role"] != "member"],
                "high_water_mark": {"outer_step": rec.hwm_step, "hash": rec.hwm_hash},
                "completed": rec.completed, "outer_steps": rec.outer_steps,
                "hashes": {str(k): v for k, v in self._hashes.items()}, "evictions": list(self._evictions)}

    # ---- requests ------------------------------------------------------------------------
    def register(self, node_id: str, addr: str, devices: int, protocol: int, fingerprint: str, now: float,
                 resume: Resume | None = None, founder: bool = True,
                 outer_steps: int | None = None) -> RegisterReply:
        """Admit a node as a member or a pending joiner, or refuse it.

        Members: founders of a fresh run (``founder``: the node has not seen this run started)
        and, while the run is being rebuilt (coordinator restart, or every holder of the state
        gone), nodes whose ``resume`` state is not behind the run's recorded history. Everyone
        else joins; a node whose state is behind or diverged is told why in ``note``.
        """
        if protocol != PROTOCOL:
            raise RegistrationRefused(f"node {node_id}: protocol version {protocol} != coordinator's {PROTOCOL}",
                                      "protocol")
        if not node_id or len(node_id) > 128 or not addr:
            raise RegistrationRefused(f"invalid node id {node_id!r} or ring address {addr!r}", "invalid")
        if node_id in self._nodes:
            raise RegistrationRefused(f"node id {node_id!r} is already registered and alive "
                                      f"(ring address {self._nodes[node_id].addr})", "duplicate")
        rec = self.record
        if rec.fingerprint is not None and fingerprint != rec.fingerprint:
            raise RegistrationRefused(f"node {node_id}: model config fingerprint {fingerprint} != run's "
                                      f"{rec.fingerprint}", "fingerprint")
        if outer_steps is not None and rec.outer_steps is not None and outer_steps != rec.outer_steps:
            raise RegistrationRefused(f"node {node_id}: run length {outer_steps} outer steps != run's "
                                      f"{rec.outer_steps}", "outer_steps")
        if rec.completed:
            raise RunCompleted(f"the run is complete: all {rec.outer_steps} outer steps are done "
                               f"(final state hash {str(rec.hwm_hash)[:16]})")
        rec.fingerprint = rec.fingerprint or fingerprint
        rec.outer_steps = rec.outer_steps or outer_steps
        self._seq += 1
        self._first_reg = now if self._first_reg is None else self._first_reg
        role, order, fresh, note = Role.PENDING, (1, 0), False, ""
        if resume is not None and resume.outer_step == 0 and rec.hwm_step is None and not self._resumed:
            resume = None  # no barrier ever completed: a fresh run, whoever restarted
        if resume is not None and rec.hwm_step is None and not self._unknown:
            self._unknown = True
            self._event(f"WARNING {node_id} brings the state of outer step {resume.outer_step} but this coordinator "
                        "has no record of the run (started without its journal?): the run's history is unknown; "
                        "it is rebuilt only once most members of the newest epoch the nodes report are back")
        if resume is not None:
            note = self._judge_claim(resume)
            if not note:
                role, order = Role.MEMBER, (0, resume.rank)
                rec.next_epoch = max(rec.next_epoch, resume.epoch_id + 1)
                if not self._resumed:
                    self._resumed = True
                    for n in [n for n in self._nodes.values() if n.fresh]:
                        self._remove(n, now, f"run resumes from outer step {resume.outer_step}: "
                                             "nodes without state join")
                self._raise_floor(resume.outer_step, now)
        elif founder and not self.started and not self._resumed:
            role, order, fresh = Role.MEMBER, (0, 0), True
        self._nodes[node_id] = Node(node_id, addr, devices, f"{self.instance}.{self._seq}", role, order, now, fresh,
                                    claim=resume)
        what = "resumed member" if role is Role.MEMBER and resume else (
            "founding member" if fresh else "joiner (pending)")
        self._event(f"registered {node_id} ({addr}, {devices} devices) as {what}" + (f": {note}" if note else ""))
        self._overdue(now)  # (starts the clock of an automatic rollback, if the run waits for its state)
        self._advance(now)
        return RegisterReply(node_id, self._nodes[node_id].session, role is Role.MEMBER, self.outer_step,
                             self.epoch_id, self.fingerprint or "", self.config.heartbeat_timeout, note)

    def heartbeat(self, node_id: str, session: str, now: float) -> dict[str, Any]:
        """Record a heartbeat; returns the node's view: its role, its admission, and whether the
        ring of the newest epoch is still whole (a member of it is gone: abort that ring)."""
        node = self._get(node_id, session)
        node.last_seen = now
        last, epoch_id = self._last, self.epoch_id
        broken = last is not None and any(not self.alive(n, s) for (n, _), s in zip(last.members, last.sessions))
        claim = node.claim
        if last is None and claim is not None and claim.members and self._first_reg is not None:
            # restarted (or rebuilding): the node may be inside its epoch's all-reduce; that ring
            # is broken once a member's process of that epoch has not come back within a
            # heartbeat timeout (a restarted process claims no epoch, or an older one)
            epoch_id = claim.epoch_id
            broken = now - self._first_reg > self.config.heartbeat_timeout and not all(
                m in self._nodes and self._nodes[m].claim is not None
                and self._nodes[m].claim.epoch_id >= claim.epoch_id for m in claim.members)  # type: ignore[union-attr]
        adm = node.admission if node.role is Role.ADMITTED else None
        serving = [j.node_id for j in self._nodes.values() if j.role is Role.ADMITTED and not j.received
                   and j.admission is not None and j.admission.donor_id == node_id]
        return {"role": node.role.value, "admission": adm.outer_step if adm else None,
                "donor": adm.donor_id if adm else None, "epoch_id": epoch_id, "epoch_broken": broken,
                "serving": serving, "completed": self.record.completed}

    def arrive(self, node_id: str, session: str, step: int, now: float, state_hash: str | None = None,
               retry_of: int | None = None, sits_out: str | None = None, report: dict | None = None) -> Epoch | None:
        """A node reached boundary ``step``; returns its epoch once the barrier completes (else None)."""
        node = self._get(node_id, session)
        node.last_seen = now
        if node.role is Role.PENDING:
            raise ProtocolError(f"node {node_id} is a joiner waiting for admission; call wait_admission()")
        retry = retry_of is not None
        last = self._last
        if last is None:
            if step < self._floor:
                self._expel(node, now, f"behind: at outer step {step}, the run resumes at {self._floor}")
            self._raise_floor(step, now)
        elif node.role is Role.ADMITTED:
            if step != node.admission.outer_step:  # type: ignore[union-attr]
                raise ProtocolError(f"joiner {node_id} must first sync at outer step "
                                    f"{node.admission.outer_step}, not {step}")  # type: ignore[union-attr]
            node.received = True
        elif step == last.step + 1:
            for n in self._waiting(last.step):
                self._remove(n, now, f"behind: its all-reduce of epoch {last.epoch_id} failed but {node_id}'s "
                                     f"completed outer step {step}")
        elif step == last.step:
            if not (node.arrival and node.arrival.step == step):
                if not self._waiting(step) and not (retry and retry_of >= last.epoch_id):  # type: ignore[operator]
                    return self._view(last, node_id)  # re-issued request: the barrier already completed
                if any(n.role is Role.MEMBER for n in self._waiting(step + 1)):
                    self._expel(node, now, f"behind: another member already completed outer step {step + 1}")
                retry = True
        elif step < last.step:
            self._expel(node, now, f"behind: at outer step {step}, the run is at {last.step + 1}")
        else:
            raise ProtocolError(f"node {node_id}: outer step {step} is ahead of the run (expected {last.step + 1})")
        again = node.arrival is not None and node.arrival.step == step  # a re-issued request
        t0 = node.arrival.time if again else now  # type: ignore[union-attr]
        retry = retry or (again and node.arrival.retry)  # type: ignore[union-attr]
        if again:  # a re-issued or retried sync keeps the first one's report (counted once)
            report = report or node.arrival.report  # type: ignore[union-attr]
        node.arrival, node.outbox = Arrival(step, t0, state_hash, retry, sits_out, report), None
        self._advance(now)
        return node.outbox

    def epoch_for(self, node_id: str, session: str) -> Epoch | None:
        """Poll the result of the barrier this node waits at (raises :class:`Evicted` if it was evicted)."""
        return self._get(node_id, session).outbox

    def request_admission(self, node_id: str, session: str, now: float, requeue: bool = False) -> Admission | None:
        """A joiner asks to be admitted; ``requeue``: its state transfer failed, assign a new donor.
        A joiner promoted to member with the state it brought gets itself as donor."""
        node = self._get(node_id, session)
        node.last_seen = now
        if requeue and node.role is Role.ADMITTED and not node.received:
            self._requeue(node, "its state transfer failed")
        return self.admission_for(node_id, session)

    def admission_for(self, node_id: str, session: str) -> Admission | None:
        node = self._get(node_id, session)
        if node.role is Role.MEMBER:  # promoted (rebuild) with its own state: no transfer
            step = node.claim.outer_step if node.claim else self.outer_step
            return Admission(node_id, node.addr, -1, step, self.epoch_id)
        if node.role is Role.PENDING and self.record.completed:
            raise RunCompleted(f"the run completed all {self.record.outer_steps} outer steps while {node_id} waited "
                               "for admission")
        return node.admission if node.role is Role.ADMITTED else None

    def state_received(self, node_id: str, session: str, step: int, now: float) -> bool:
        """The joiner holds the state after outer step ``step``; False: re-queued, wait for admission."""
        node = self._get(node_id, session)
        node.last_seen = now
        adm = node.admission
        if adm is None or adm.outer_step != step or (self.started and self.outer_step != step):
            return False
        if node.role is Role.PENDING:  # re-queued (donor gone) after the transfer had in fact finished
            node.role = Role.ADMITTED
        node.received = True
        self._event(f"joiner {node_id} received the state of outer step {step} from {adm.donor_id}")
        return node.role is Role.ADMITTED

    def leave(self, node_id: str, session: str, now: float) -> None:
        self._remove(self._get(node_id, session), now, "left", graceful=True)
        self._advance(now)

    def disconnect(self, node_id: str, session: str, now: float) -> None:
        """The node's session connection closed (a no-op if it already left or was evicted)."""
        node = self._nodes.get(node_id)
        if node is not None and node.session == session:
            self._remove(node, now, "connection lost")
            self._advance(now)

    def extend(self, gap: float) -> None:
        """The coordinator could not act for ``gap`` seconds (paused, starved, swapping): move
        every deadline that was running meanwhile (heartbeats, barriers, the join window, the
        wait before an automatic rollback) by that much, so nobody is judged for its stall."""
        for n in self._nodes.values():
            n.last_seen += gap
            if n.arrival is not None:
                n.arrival = replace(n.arrival, time=n.arrival.time + gap)
        if self._first_reg is not None:
            self._first_reg += gap
        if self._waiting_since is not None:
            self._waiting_since += gap

    def tick(self, now: float) -> None:
        """Evict on heartbeat timeout and boundary deadline; roll back by itself when the newest
        state has been lost for ``auto_rollback_after``; complete barriers that can."""
        self._auto_rollback(now)
        hb = self.config.heartbeat_timeout
        for n in [n for n in self._nodes.values() if now - n.last_seen > hb]:
            self._remove(n, now, f"no heartbeat for {now - n.last_seen:.1f}s")
        active = self._active()
        if active is not None:
            step, arrived, expected = active
            t0 = min(n.arrival.time for n in arrived)  # type: ignore[union-attr]
            if now - t0 > self.config.boundary_timeout:
                for n in self._sorted(expected - arrived):
                    self._remove(n, now, f"missed boundary {step} ({self.config.boundary_timeout:.0f}s after "
                                         "the first arrival)")
        self._advance(now)

    # ---- internals -----------------------------------------------------------------------
    def _event(self, line: str) -> None:
        self._events.append(line)

    def _overdue(self, now: float) -> bool:
        """Not started with history, for longer than ``auto_rollback_after``."""
        if self._last is not None or not self._resumed or self.record.completed:
            self._waiting_since = None
            return False
        self._waiting_since = now if self._waiting_since is None else self._waiting_since
        after = self.config.auto_rollback_after
        return after is not None and now - self._waiting_since >= after

    def _auto_rollback(self, now: float) -> None:
        """Nobody has brought the newest state for ``auto_rollback_after``: restart the run from
        the newest state that registered nodes hold (their claims), exactly as an operator's
        ``allow_rollback_to`` would (the barrier that forms journals it)."""
        if not self._overdue(now) or self._unknown:
            return
        rec = self.record
        held = [n.claim.outer_step for n in self._nodes.values()
                if n.claim is not None and not rec.judge(n.claim.outer_step, n.claim.state_hash, 0)]
        if not held or max(held) >= self._floor:
            return  # nothing to roll back to yet, or the state the run waits for is here
        to = max(held)
        self._rollback, self._rollback_by = to, f"automatic: no live node held it for {now - self._waiting_since:.0f}s"
        self._floor = to
        self._event(f"WARNING no live node has held the run's newest state (outer step {rec.hwm_step}) for "
                    f"{now - self._waiting_since:.0f}s: rolling back to outer step {to}, the newest state that "
                    "registered nodes hold (auto_rollback_after)")
        self._waiting_since = None
        self._promote_claims(now)

    def _promote_claims(self, now: float) -> None:
        """Not started: joiners whose claimed state can resume the run become its members."""
        for j in self._sorted(self._nodes.values()):
            if j.role is not Role.MEMBER and j.claim is not None and not self._judge_claim(j.claim):
                j.role, j.order, j.admission = Role.MEMBER, (0, j.claim.rank), None
                self._raise_floor(j.claim.outer_step, now)
                self._event(f"joiner {j.node_id} resumes the run with its state of outer step {j.claim.outer_step}")

    def _quorum(self, now: float) -> bool:
        """History unknown: whether most members of the newest epoch that the registered nodes
        report are back (or the wait has lasted ``auto_rollback_after``)."""
        claims = [n.claim for n in self._nodes.values() if n.claim is not None and n.claim.outer_step > 0]
        if not claims:
            return True
        newest = max(claims, key=lambda c: (c.epoch_id, c.outer_step))
        last = set(newest.members)
        back = {node_id for node_id, n in self._nodes.items() if node_id in last and n.claim is not None
                and n.claim.outer_step > 0}  # (back with state: one that lost its disk does not count)
        if not last or 2 * len(back) > len(last):  # (a claim without its epoch's members says nothing)
            return True
        if self._overdue(now):
            self._event(f"WARNING the run's history is unknown and only {len(back)} of epoch {newest.epoch_id}'s "
                        f"{len(last)} members came back in {now - self._waiting_since:.0f}s: rebuilding the run "
                        "from the newest state here")  # type: ignore[operator]
            self._unknown = False
            return True
        if not self._quorum_said:
            self._quorum_said = True
            self._event(f"the run's history is unknown: waiting for most of epoch {newest.epoch_id}'s members "
                        f"({', '.join(sorted(last))}) before rebuilding it (have {', '.join(sorted(back)) or 'none'})")
        return False

    def _lowest_resumable(self) -> int:
        """The oldest outer step a resumed node may bring (the high-water mark, unless the
        operator allowed a rollback)."""
        hwm = self.record.hwm_step or 0
        return min(hwm, self._rollback) if self._rollback is not None else hwm

    def _judge_claim(self, claim: Resume) -> str:
        """Why state from ``claim`` cannot resume the run ('' if it can): it must not be behind
        the run's history, nor differ from the hash recorded for its step."""
        if self.started:
            return (f"the run is in progress at outer step {self.outer_step}; state from step "
                    f"{claim.outer_step} joins")
        return self.record.judge(claim.outer_step, claim.state_hash, self._floor)

    def _get(self, node_id: str, session: str) -> Node:
        node = self._nodes.get(node_id)
        if node is not None and node.session == session:
            return node
        if session.split(".")[0] != self.instance:
            raise StaleSession(f"node {node_id}: session {session} is from another coordinator instance "
                               "(restarted); re-register", "stale_session")
        why = next((e["reason"] for e in reversed(self._evictions) if e["node_id"] == node_id), "unknown session")
        raise Evicted(f"node {node_id} was evicted ({why}); re-register as a joiner")

    def _sorted(self, nodes: Any) -> list[Node]:
        return sorted(nodes, key=lambda n: (n.order, n.node_id))

    def _waiting(self, step: int) -> list[Node]:
        return [n for n in self._nodes.values() if n.arrival is not None and n.arrival.step == step]

    def _expel(self, node: Node, now: float, reason: str) -> None:
        self._remove(node, now, reason)
        self._advance(now)
        raise Evicted(f"node {node.node_id} was evicted ({reason}); re-register as a joiner")

    def _raise_floor(self, step: int, now: float) -> None:
        """Not started: boundary ``step`` is the highest claimed; nodes waiting below it are behind."""
        if step > self._floor:
            self._floor = step
            for n in [n for n in self._nodes.values() if n.arrival and n.arrival.step < step]:
                self._remove(n, now, f"behind: at outer step {n.arrival.step}, the run resumes at {step}")  # type: ignore[union-attr]

    def _requeue(self, joiner: Node, why: str) -> None:
        joiner.role, joiner.received = Role.PENDING, False
        self._event(f"joiner {joiner.node_id} re-queued: {why}")

    def _remove(self, node: Node, now: float, reason: str, graceful: bool = False) -> None:
        """Drop a node (callers run :meth:`_advance` once their whole change is made)."""
        if self._nodes.get(node.node_id) is not node:
            return
        del self._nodes[node.node_id]
        self._evictions.append({"node_id": node.node_id, "reason": reason, "outer_step": self.outer_step,
                                "time": round(now, 3), "graceful": graceful})
        del self._evictions[: -self.config.history]
        verb = "left" if graceful else "evicted"
        self._notes.append(f"{node.node_id} left" if graceful else f"evicted {node.node_id}: {reason}")
        self._event(f"{verb} {node.node_id}" + ("" if graceful else f": {reason}"))
        for j in self._nodes.values():
            if j.role is Role.ADMITTED and not j.received and j.admission and j.admission.donor_id == node.node_id:
                self._requeue(j, f"donor {node.node_id} gone")
        holders = [n for n in self._nodes.values() if n.role is Role.MEMBER or n.received]
        if self.started and not holders and not self.record.completed:  # nobody holds the run's state any more: rebuild from checkpoints
            self._last, self._resumed, self._first_reg = None, True, now
            self._floor = max(self._floor, self._lowest_resumable())
            self._waiting_since = now
            self._event(f"no live node holds the run's state any more; waiting for a node with the state of "
                        f"outer step {self._floor} or later (from a checkpoint)")
            self._promote_claims(now)  # joiners that brought such state resume the run

    def _active(self) -> tuple[int, set[Node], set[Node]] | None:
        """The barrier being formed: (step, nodes arrived, nodes expected)."""
        members = {n for n in self._nodes.values() if n.role is Role.MEMBER}
        if self._last is None:
            arrived = set(self._waiting(self._floor))
            return (self._floor, arrived, members | arrived) if arrived else None
        k = self._last.step
        retry = set(self._waiting(k))
        if retry:  # (members already at k+1 would have evicted them)
            return k, retry, members
        nxt = set(self._waiting(k + 1))
        if not nxt:
            return None
        joiners = {n for n in self._nodes.values() if n.role is Role.ADMITTED and n.admission
                   and n.admission.outer_step == k + 1}
        return k + 1, nxt, members | joiners

    def _advance(self, now: float) -> None:
        active = self._active()
        if active is None or not active[2] <= active[1]:
            return
        step, arrived, _ = active
        if self._last is None:
            assert self._first_reg is not None
            if now < self._first_reg + self.config.join_window:
                return
            if not self._resumed and len(arrived) < self.config.min_nodes:
                return
            if self._unknown and not self._quorum(now):
                return
        members = self._police(self._agree(step, self._sorted(arrived), now), now)
        if members:
            self._complete(step, members)
        else:
            self._advance(now)

    def _police(self, members: list[Node], now: float) -> list[Node]:
        """Evict members whose own checks failed at ``sit_out_limit`` barriers in a row, and members
        their ring successor blamed in ``strikes`` rounds whose average most members found bad."""
        reports = [n.arrival.report or {} for n in members]  # type: ignore[union-attr]
        failed = sum(1 for r in reports if r.get("avg_failed")) * 2 > len(members)
        blamed = {r["accused"][0]: r["accused"][1] for r in reports if r.get("accused")}
        keep = []
        for n in members:
            n.sit_outs = n.sit_outs + 1 if n.arrival.sits_out else 0  # type: ignore[union-attr]
            n.strikes += int(failed and n.node_id in blamed)
            if n.sit_outs >= self.config.sit_out_limit:
                self._remove(n, now, f"its own pseudo-gradient checks failed at {n.sit_outs} barriers in a row "
                                     f"({n.arrival.sits_out})")  # type: ignore[union-attr]
            elif n.strikes >= self.config.strikes:
                self._remove(n, now, f"poisoned contributions: blamed by its ring successor in {n.strikes} "
                                     f"rounds whose average failed ({blamed.get(n.node_id)})")
            else:
                keep.append(n)
        return keep

    def _agree(self, step: int, members: list[Node], now: float) -> list[Node]:
        """Record the run's hash of outer step ``step`` (the one already recorded, else the
        members' majority, ties to ring order) and evict the members whose state differs."""
        rec = self.record
        hashes = {n.node_id: n.arrival.state_hash for n in members if n.arrival.state_hash}  # type: ignore[union-attr]
        recorded = rec.reference(step, list(hashes.values()))
        mismatch = tuple(sorted(hashes.items())) if len(set(hashes.values()) | {recorded} - {None}) > 1 else ()
        rec_step = self._hashes.setdefault(step, {"hashes": {}, "mismatch": []})
        rec_step["hashes"].update(hashes)
        for k in sorted(self._hashes)[: -self.config.history]:
            del self._hashes[k]
        if mismatch:
            rec_step["mismatch"] = [list(p) for p in mismatch]
            self._event("WARNING state hash mismatch at outer step "
                        f"{step}: " + ", ".join(f"{n}={h[:16]}" for n, h in mismatch)
                        + f"; the run's is {str(recorded)[:16]}")
        if rec.hwm_step is not None and step < rec.hwm_step and (self._rollback is None or step < self._rollback):
            for n in members:  # (unreachable: arrivals below the floor are expelled) never rewrite history
                self._remove(n, now, f"behind: at outer step {step}, the run has reached {rec.hwm_step}")
            return []
        if recorded is None:
            return members
        if rec.hwm_step is not None and step < rec.hwm_step:  # allow_rollback_to, an operator's or automatic
            rec.rollbacks.append({"from": rec.hwm_step, "to": step, "by": self._rollback_by})
            self._event(f"WARNING rolled the run back from outer step {rec.hwm_step} to {step} ({self._rollback_by})")
            rec.truncate(step)
            self._rollback = None
        rec.record(step, recorded, self.config.history)
        keep = []
        for n in members:
            h = n.arrival.state_hash  # type: ignore[union-attr]
            if h and h != recorded:
                self._remove(n, now, f"diverged: state hash {h[:16]} at outer step {step}, the run's is "
                                     f"{recorded[:16]}")
            else:
                keep.append(n)
        if rec.outer_steps is not None and step >= rec.outer_steps and keep:
            rec.completed = True
            self._event(f"run complete: outer step {step} of {rec.outer_steps}, state hash {recorded[:16]}")
        return keep

    def _complete(self, step: int, members: list[Node]) -> None:
        prev, rec = self._last, self.record
        pairs = tuple((n.node_id, n.addr) for n in members)
        retry = any(n.arrival.retry for n in members)  # type: ignore[union-attr]
        changed = prev is None or retry or pairs != prev.members
        if changed:
            epoch_id, rec.next_epoch = rec.next_epoch, rec.next_epoch + 1
        else:
            epoch_id = prev.epoch_id  # type: ignore[union-attr]
        mismatch = tuple(tuple(p) for p in self._hashes.get(step, {}).get("mismatch", ()))
        sitting_out = tuple(n.node_id for n in members if n.arrival.sits_out)  # type: ignore[union-attr]
        self._unknown, self._waiting_since = False, None
        for n in members:
            n.arrival, n.fresh = None, False
            if n.role is Role.ADMITTED:
                n.role = Role.MEMBER
                self._notes.append(f"joined {n.node_id}")
        if rec.outer_steps is None or step + 1 < rec.outer_steps:  # no joiner for the final step
            pending = self._sorted(n for n in self._nodes.values() if n.role is Role.PENDING)
            for i, j in enumerate(pending):
                donor = members[i % len(members)]
                self._seq += 1
                j.role, j.order, j.received = Role.ADMITTED, (1, self._seq), False
                j.admission = Admission(donor.node_id, donor.addr, step, step + 1, epoch_id)
                self._event(f"admitted joiner {j.node_id} at boundary {step}: state of outer step {step + 1} "
                            f"from donor {donor.node_id}")
        serve: dict[str, list[Peer]] = {}
        for j in self._sorted(self._nodes.values()):
            if j.role is Role.ADMITTED and not j.received and j.admission and j.admission.outer_step == step + 1:
                serve.setdefault(j.admission.donor_id, []).append((j.node_id, j.addr))
        self._last = Barrier(step, epoch_id, pairs, tuple(n.session for n in members),
                             {d: tuple(s) for d, s in serve.items()}, mismatch, changed, sitting_out)  # type: ignore[arg-type]
        for n in members:
            n.outbox = self._view(self._last, n.node_id)
        if changed:
            why = f" ({'; '.join(self._notes)})" if self._notes else ""
            retry_note = " retry" if retry else ""
            self._event(f"epoch {epoch_id}: members [{', '.join(p[0] for p in pairs)}] at boundary "
                        f"{step}{retry_note}{why}")
            self._notes = []

    def _view(self, b: Barrier, node_id: str) -> Epoch:
        rank = [p[0] for p in b.members].index(node_id)
        return Epoch(b.epoch_id, b.step, b.members, rank, b.serve.get(node_id, ()), b.hash_mismatch, b.changed,
                     b.sitting_out)
