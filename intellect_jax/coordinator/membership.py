"""Run membership of elastic DiLoCo as a pure state machine (no sockets, threads or clock).

Every method takes ``now`` (the coordinator's clock) so each protocol rule is unit-tested
deterministically; :mod:`.service` wraps it for the server. Numbering: *boundary k* is where a
member has completed ``k`` outer steps and finished the inner steps of step ``k+1``; ``sync(k)``
there returns the epoch whose ring all-reduces step ``k+1``'s pseudo-gradient.

One history (:mod:`.history`): the run's :class:`~.journal.RunRecord` holds the hash recorded
for every recent outer step and the newest one (the high-water mark). A barrier records its
step's hash (the recorded one if there is one, else a strict majority's, else it waits) and
evicts members whose state differs; a node bringing state from an older step, or other bytes
for a recorded step, is made a joiner and takes a live peer's state. See ``docs/coordinator.md``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from intellect_jax.coordinator import admission
from intellect_jax.coordinator.claims import Notary, proven
from intellect_jax.coordinator.history import History
from intellect_jax.coordinator.journal import RunRecord
from intellect_jax.coordinator.leases import LeaseError, Ledger, Ranges
from intellect_jax.coordinator.policing import Police, average_skipped
from intellect_jax.coordinator.protocol import (PROTOCOL, Admission, CoordinatorConfig, DataPlan, Epoch, Evicted,
                                                ProtocolError, RegisterReply, Resume, RunCompleted, StaleSession)
from intellect_jax.coordinator.roster import (Arrival, Barrier, Node, Role, Sessions, describe, forming, ordered, view,
                                              waiting)
from intellect_jax.coordinator.schema import Report

__all__ = ["Membership"]


class Membership:
    """Nodes, barriers, epochs, joiners and evictions of one run (see the module docstring).

    It owns the node table and the barriers; the rules over them live beside it: who may register
    and how joiners get their donors (:mod:`.admission`), the run's hash history and its
    rollbacks (:class:`~.history.History`), whom a barrier evicts for its contributions
    (:mod:`.policing`)."""

    def __init__(self, config: CoordinatorConfig | None = None, instance: str = "0",
                 record: RunRecord | None = None) -> None:
        self.config = config or CoordinatorConfig()
        self.instance = instance
        self.record = record or RunRecord()
        rec = self.record
        rec.fingerprint = rec.fingerprint or self.config.fingerprint
        rec.outer_steps = rec.outer_steps or self.config.outer_steps
        self.history = History(rec, self.config, self._event)
        self.police = Police(self.config, self._event)
        self.notary: Notary | None = None  # signs barrier records and demands them without history (.claims)
        self._sessions = Sessions(max(1024, 4 * self.config.max_handlers))
        self._nodes: dict[str, Node] = {}
        self._last: Barrier | None = None  # None: not started (fresh, restarted, or emptied)
        self._resumed = rec.hwm_step is not None  # the run has history: no fresh founders
        self._floor = self.history.lowest_resumable()  # not started: the lowest acceptable boundary
        self._seq = 0  # joiner admissions (ring order)
        self._first_reg: float | None = None
        self._member_since: dict[str, tuple[Any, float]] = {}  # node -> (the barrier forming, when it joined it)
        self._evictions: list[dict[str, Any]] = []
        self._notes: list[str] = []  # changes since the last epoch, for its log line
        self._events: list[str] = []

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
        nodes = [describe(n, now) for n in ordered(self._nodes.values())]
        last, rec = self._last, self.record
        return {"outer_step": self.outer_step, "started": self.started, "fingerprint": self.fingerprint,
                "protocol": PROTOCOL, "epoch": {"epoch_id": last.epoch_id, "outer_step": last.step,
                                                "members": [list(p) for p in last.members]} if last else None,
                "next_epoch_id": rec.next_epoch, "nodes": nodes,
                "joiners": [n["node_id"] for n in nodes if n["role"] != "member"],
                "high_water_mark": {"outer_step": rec.hwm_step, "hash": rec.hwm_hash},
                "completed": rec.completed, "outer_steps": rec.outer_steps, "waiting": self.history.waiting,
                "hashes": {str(k): v for k, v in self.history.hashes.items()}, "evictions": list(self._evictions),
                "data": rec.leases.status() if rec.leases is not None else None,
                "data_plan": admission.data_plan(rec)}

    # ---- requests ------------------------------------------------------------------------
    def register(self, node_id: str, addr: str, devices: int, protocol: int, fingerprint: str, now: float,
                 resume: Resume | None = None, founder: bool = True,
                 outer_steps: int | None = None, data: DataPlan | None = None) -> RegisterReply:
        """Admit a node as a member or a pending joiner, or refuse it.

        Members: founders of a fresh run (``founder``: the node has not seen this run started)
        and, while the run is being rebuilt (coordinator restart, or every holder of the state
        gone), nodes whose ``resume`` state is not behind the run's recorded history. Everyone
        else joins; a node whose state is behind or diverged is told why in ``note``.
        """
        rec = self.record
        admission.check_registration(node_id, addr, protocol, fingerprint, outer_steps, self._nodes, rec, data,
                                     (rec.hwm_step or 0) > 0 or bool(self.history.unknown))
        rec.fingerprint = rec.fingerprint or fingerprint
        rec.outer_steps = rec.outer_steps or outer_steps
        self._first_reg = now if self._first_reg is None else self._first_reg
        role, order, fresh, note = Role.PENDING, (1, 0), False, ""
        if resume is not None and resume.outer_step > 0 and rec.hwm_step is None and not self.started \
                and self.notary is not None:
            why = self.notary.unproven(resume, node_id)  # no history here to judge it by: it must show a record
            if why:  # as good as no claim, and no founder either (it holds state): a joiner
                note, resume, founder = f"its claim of outer step {resume.outer_step} is not proven ({why}): it joins", \
                    None, False
            else:
                resume = proven(resume, node_id)
        if resume is not None and resume.outer_step == 0 and rec.hwm_step is None and not self._resumed:
            resume = None  # no barrier ever completed: a fresh run, whoever restarted
        if resume is not None and rec.hwm_step is None:
            self.history.note_unknown(node_id, resume.outer_step)
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
        self._nodes[node_id] = Node(node_id, addr, devices, self._sessions.issue(node_id), role, order, now, fresh,
                                    claim=resume, data=data,
                                    since=self._since(node_id, now) if role is Role.MEMBER else now)
        what = "resumed member" if role is Role.MEMBER and resume else (
            "founding member" if fresh else "joiner (pending)")
        self._event(f"registered {node_id} ({addr}, {devices} devices) as {what}" + (f": {note}" if note else ""))
        self.history.overdue(now, self._resuming)  # (starts the clock of an automatic rollback, if the run waits)
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
        claimed = None if last else self.history.claimed_ring(node.claim, self._nodes, self._first_reg, now)
        if claimed is not None:  # restarted (or rebuilding): the node may be inside its epoch's all-reduce
            epoch_id, broken = claimed
        adm = node.admission if node.role is Role.ADMITTED else None
        serving = [j.node_id for j in admission.served_by(self._nodes.values(), node_id)]
        return {"role": node.role.value, "admission": adm.outer_step if adm else None,
                "donor": adm.donor_id if adm else None, "epoch_id": epoch_id, "epoch_broken": broken,
                "serving": serving, "completed": self.record.completed}

    def arrive(self, node_id: str, session: str, step: int, now: float, state_hash: str | None = None,
               retry_of: int | None = None, sits_out: str | None = None, report: Report | None = None,
               vote: tuple[str, str] | None = None) -> Epoch | None:
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
            for n in waiting(self._nodes.values(), last.step):
                self._remove(n, now, f"behind: its all-reduce of epoch {last.epoch_id} failed but {node_id}'s "
                                     f"completed outer step {step}")
        elif step == last.step:
            if not (node.arrival and node.arrival.step == step):
                if not waiting(self._nodes.values(), step) and not (retry and retry_of >= last.epoch_id):  # type: ignore[operator]
                    return view(last, node_id)  # re-issued request: the barrier already completed
                if any(n.role is Role.MEMBER for n in waiting(self._nodes.values(), step + 1)):
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
        node.arrival, node.outbox = Arrival(step, t0, state_hash, retry, sits_out, report, vote), None
        self._advance(now)
        return node.outbox

    def lease(self, node_id: str, session: str, rnd: int, round_steps: int, unit_steps: int, unit_tokens: int,
              now: float, stream: str = "") -> Ranges:
        """The units of the training stream ``node_id`` trains in round ``rnd`` (the same ones if
        asked again): a member's or an admitted joiner's, for the round it trains now or next."""
        node = self._get(node_id, session)
        node.last_seen = now
        if node.role is Role.PENDING:
            raise ProtocolError(f"node {node_id} is a joiner waiting for admission: no data before it is admitted")
        if node.data is None or not node.data.leases:
            said = node.data.describe() if node.data else "no data plan"
            raise ProtocolError(f"node {node_id} registered with {said}: only a node that registered leasing its "
                                "data (diloco.leases) is leased any", "lease")
        if self.record.completed:
            raise RunCompleted(f"the run is complete: no round {rnd} to train")
        lo = self._last.step if self._last else self._floor
        if rnd < lo:
            self._expel(node, now, f"behind: asked for the data of round {rnd}, the run trains round {lo} or later")
        if rnd > lo + 2:
            raise ProtocolError(f"node {node_id}: round {rnd} is not one the run trains now (rounds {lo} to "
                                f"{lo + 2})", "lease")
        rec = self.record
        if rec.leases is None and ((rec.hwm_step or 0) > 0 or self.history.unknown):
            raise ProtocolError(f"node {node_id}: this run's journal holds no data leases, yet the run is past "
                                f"outer step 0 (it started without leases, or the journal was lost): leases "
                                "cannot start mid-run, or units already trained would be trained again", "lease")
        led = rec.leases or Ledger()
        try:
            units = led.lease(node_id, rnd, round_steps, unit_steps, unit_tokens, stream)
        except LeaseError as e:
            raise ProtocolError(f"node {node_id}: {e}", "lease") from None
        rec.leases = led
        return units

    def epoch_for(self, node_id: str, session: str) -> Epoch | None:
        """Poll the result of the barrier this node waits at (raises :class:`Evicted` if it was evicted)."""
        return self._get(node_id, session).outbox

    def request_admission(self, node_id: str, session: str, now: float, requeue: bool = False) -> Admission | None:
        """A joiner asks to be admitted; ``requeue``: its state transfer failed, assign a new donor.
        A joiner promoted to member with the state it brought gets itself as donor."""
        node = self._get(node_id, session)
        node.last_seen = now
        if requeue and node.role is Role.ADMITTED and not node.received:
            admission.requeue(node, "its state transfer failed", self._event)
        return self.admission_for(node_id, session)

    def admission_for(self, node_id: str, session: str) -> Admission | None:
        return admission.admission_of(self._get(node_id, session), self.outer_step, self.epoch_id, self.record)

    def state_received(self, node_id: str, session: str, step: int, now: float) -> bool:
        """The joiner holds the state after outer step ``step``; False: re-queued, wait for admission."""
        node = self._get(node_id, session)
        node.last_seen = now
        return admission.received(node, step, self.outer_step if self.started else None, self._event)

    def leave(self, node_id: str, session: str, now: float) -> None:
        self._remove(self._get(node_id, session), now, "left", graceful=True)
        self._advance(now)

    def disconnect(self, node_id: str, session: str | None, now: float, why: str = "connection lost") -> None:
        """The node's session connection closed, or (``session`` None) it must go for ``why``; a
        no-op if it already left or was evicted."""
        node = self._nodes.get(node_id)
        if node is not None and session in (None, node.session):
            self._remove(node, now, why)
            self._advance(now)

    def extend(self, gap: float) -> None:
        """The coordinator could not act for ``gap`` seconds (paused, starved, swapping): move
        every deadline that was running meanwhile (heartbeats, barriers, the join window, the
        wait before an automatic rollback) by that much, so nobody is judged for its stall."""
        for n in self._nodes.values():
            n.last_seen += gap
            n.since += gap
            if n.arrival is not None:
                n.arrival = replace(n.arrival, time=n.arrival.time + gap)
        self._member_since = {k: (b, t + gap) for k, (b, t) in self._member_since.items()}
        if self._first_reg is not None:
            self._first_reg += gap
        self.history.extend(gap)

    def tick(self, now: float) -> None:
        """Evict on heartbeat timeout and boundary deadline; roll back by itself when the newest
        state has been lost for ``auto_rollback_after``; complete barriers that can."""
        claims = [n.claim for n in self._nodes.values() if n.claim is not None]
        to = self.history.auto_rollback(claims, self._floor, now, self._resuming)
        if to is not None:
            self._floor = to
            self._promote_claims(now)
        hb = self.config.heartbeat_timeout
        for n in [n for n in self._nodes.values() if now - n.last_seen > hb]:
            self._remove(n, now, f"no heartbeat for {now - n.last_seen:.1f}s")
        active = forming(self._nodes.values(), self._last, self._floor)
        if active is not None:
            step, arrived, expected = active
            # each has boundary_timeout from the first arrival or, if later, from when the barrier began
            # to wait for it: a founder (or resumed member) registering after the deadline is not
            # evicted before it could sync, which would repeat at each registration and never let a
            # run that waits for min_nodes start
            t0 = min(n.arrival.time for n in arrived)  # type: ignore[union-attr]
            for n in ordered(expected - arrived):
                if now - max(t0, n.since) > self.config.boundary_timeout:
                    self._remove(n, now, f"missed boundary {step} ({self.config.boundary_timeout:.0f}s after "
                                         f"the first arrival{' or since it became a member' if n.since > t0 else ''})")
        self._advance(now)

    # ---- internals -----------------------------------------------------------------------
    def _event(self, line: str) -> None:
        self._events.append(line)

    @property
    def _resuming(self) -> bool:
        """Not started, with history: the run waits for a node with its state."""
        return self._last is None and self._resumed

    def _since(self, node_id: str, now: float) -> float:
        """When the barrier being formed began to wait for member ``node_id``: now, unless it was a
        member at this barrier before (evicted, it registered again): a node that comes back, or
        two that take turns, get no fresh ``boundary_timeout`` and cannot hold the barrier forever."""
        key = (self._last.step if self._last is not None else None, self._floor)
        if any(b != key for b, _ in self._member_since.values()):  # another barrier: forget the last one's
            self._member_since = {k: v for k, v in self._member_since.items() if v[0] == key}
        return self._member_since.setdefault(node_id, (key, now))[1]

    def _promote_claims(self, now: float) -> None:
        """Not started: joiners whose claimed state can resume the run become its members."""
        for j in ordered(self._nodes.values()):
            if j.role is not Role.MEMBER and j.claim is not None and not self._judge_claim(j.claim):
                j.role, j.order, j.admission, j.since = Role.MEMBER, (0, j.claim.rank), None, self._since(j.node_id, now)
                self._raise_floor(j.claim.outer_step, now)
                self._event(f"joiner {j.node_id} resumes the run with its state of outer step {j.claim.outer_step}")

    def _judge_claim(self, claim: Resume) -> str:
        """Why state from ``claim`` cannot resume the run ('' if it can): it must not be behind
        the run's history, nor differ from the hash recorded for its step."""
        if self.started:
            return (f"the run is in progress at outer step {self.outer_step}; state from step "
                    f"{claim.outer_step} joins")
        return self.record.judge(claim.outer_step, claim.state_hash, self._floor, claim.epoch_id)

    def _get(self, node_id: str, session: str) -> Node:
        node = self._nodes.get(node_id)
        if node is not None and node.session == session:
            return node
        self._sessions.check(node_id, session)  # another coordinator's session, or another node's
        if node is not None:  # one of ours, since replaced by a newer registration of the same identity
            raise StaleSession(f"node {node_id}: that session was replaced by its newer registration; use that one",
                               "stale_session")
        why = next((e["reason"] for e in reversed(self._evictions) if e["node_id"] == node_id), "unknown session")
        raise Evicted(f"node {node_id} was evicted ({why}); re-register as a joiner")

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
        for j in admission.served_by(self._nodes.values(), node.node_id):
            admission.requeue(j, f"donor {node.node_id} gone", self._event)
        holders = [n for n in self._nodes.values() if n.role is Role.MEMBER or n.received]
        if self.started and not holders and not self.record.completed:  # nobody holds the run's state any more: rebuild from checkpoints
            self._last, self._resumed, self._first_reg = None, True, now
            self._floor = max(self._floor, self.history.lowest_resumable())
            self.history.waiting_since = now
            self._event(f"no live node holds the run's state any more; waiting for a node with the state of "
                        f"outer step {self._floor} or later (from a checkpoint)")
            self._promote_claims(now)  # joiners that brought such state resume the run

    def _advance(self, now: float) -> None:
        """Complete the barrier being formed if everyone expected has arrived (and, before the
        run has started, its join window, founders or quorum allow)."""
        active = forming(self._nodes.values(), self._last, self._floor)
        if active is None or not active[2] <= active[1]:
            self.history.waiting = None  # (nobody waits for a quorum at a barrier still forming)
            return
        step, arrived, _ = active
        if self._last is None:
            assert self._first_reg is not None
            if now < self._first_reg + self.config.join_window:
                return
            if not self._resumed and len(arrived) < self.config.min_nodes:
                return
            if self.history.unknown and not self.history.quorum(self._nodes, now, self._resuming):
                return
        agreed = self.history.agree(step, ordered(arrived))
        if agreed is None:
            return  # no quorum: the barrier waits (history.waiting says why)
        members, diverged, recorded = agreed
        for n, why in diverged:
            self._remove(n, now, why)
        if members and recorded is not None:
            self.history.complete(step, recorded)
            led = self.record.leases
            if led is not None:  # the contributions to outer step ``step`` made it (or were skipped by all)
                led.recorded(step, average_skipped(members), self.config.history)
                if self.record.completed:
                    led.finish()
        members, evict = self.police.judge(step, members, self.record.run_id, self.record.hashes.get(step - 1))
        self.record.banned.update(self.police.frauds)  # proven by its own signatures: it may not come back
        gone = {n.node_id for n, _ in evict}
        for node_id, why in self.police.frauds.items():  # one that left the ring: a joiner by now, say
            if node_id not in gone and node_id in self._nodes and self._nodes[node_id] not in members:
                self._remove(self._nodes[node_id], now, f"banned: {why}")
        for n, why in evict:
            self._remove(n, now, why)
        if members:
            self._complete(step, members)
        else:
            self._advance(now)

    def _complete(self, step: int, members: list[Node]) -> None:
        """Barrier ``step`` forms with ``members`` (ring order): its epoch (a new one if the ring
        changed), joiners admitted, every member's reply in its outbox."""
        prev, rec = self._last, self.record
        pairs = tuple((n.node_id, n.addr) for n in members)
        retry = any(n.arrival.retry for n in members)  # type: ignore[union-attr]
        changed = prev is None or retry or pairs != prev.members
        if changed:
            epoch_id, rec.next_epoch = rec.next_epoch, rec.next_epoch + 1
        else:
            epoch_id = prev.epoch_id  # type: ignore[union-attr]
        mismatch = self.history.mismatch(step)
        sitting_out = tuple(n.node_id for n in members if n.arrival.sits_out)  # type: ignore[union-attr]
        plans = {n.data.mode for n in members if n.data is not None}
        if rec.data is None and len(plans) == 1:  # the run's data plan: the first barrier's members'
            rec.data = plans.pop()
        if rec.leases is not None:  # the round-``step`` units of those not sitting out go into step + 1
            rec.leases.contributions(step, [p[0] for p in pairs if p[0] not in sitting_out])
        self.history.formed()
        self.police.formed(step, epoch_id, tuple(p[0] for p in pairs), sitting_out)
        for n in members:
            n.arrival, n.fresh = None, False
            if n.role is Role.ADMITTED:
                n.role = Role.MEMBER
                self._notes.append(f"joined {n.node_id}")
        if rec.outer_steps is None or step + 1 < rec.outer_steps:  # no joiner for the final step
            pending = ordered(n for n in self._nodes.values() if n.role is Role.PENDING)
            self._seq = admission.admit(pending, members, step, epoch_id, self._seq, self._event)
        serve = admission.serving(ordered(self._nodes.values()), step + 1)
        data = None
        if rec.leases is not None:
            d = rec.leases.status()
            data = (d["tokens_trained"], d["tokens_discarded"])
        recorded = rec.hashes.get(step)
        signed = None if self.notary is None or recorded is None else \
            self.notary.sign(step, recorded, epoch_id, [p[0] for p in pairs])
        self._last = Barrier(step, epoch_id, pairs, tuple(n.session for n in members), serve, mismatch, changed,
                             sitting_out, data, signed)
        for n in members:
            n.outbox = view(self._last, n.node_id)
        if changed:
            why = f" ({'; '.join(self._notes)})" if self._notes else ""
            retry_note = " retry" if retry else ""
            self._event(f"epoch {epoch_id}: members [{', '.join(p[0] for p in pairs)}] at boundary "
                        f"{step}{retry_note}{why}")
            self._notes = []
