"""Run membership of elastic DiLoCo as a pure state machine (no sockets, threads or clock).

Every method takes ``now`` (the coordinator's ``time.monotonic()``) so each protocol rule is
unit-tested deterministically; :mod:`.coordinator` wraps it in a threaded server. Numbering:
*boundary k* is where a member has completed ``k`` outer steps and finished the inner steps of
step ``k+1``; ``sync(k)`` there returns the epoch whose ring all-reduces step ``k+1``'s
pseudo-gradient. See ``docs/coordinator.md`` for the whole protocol.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from intellect_jax.diloco.protocol import (
    PROTOCOL,
    RegistrationRefused,
    Evicted,
    ProtocolError,
    StaleSession,
    CoordinatorConfig,
    Peer,
    Resume,
    RegisterReply,
    Epoch,
    Admission,
)

class Role(str, enum.Enum):
    MEMBER = "member"  # has the run's state; expected at every barrier
    PENDING = "pending"  # joiner waiting for the next boundary
    ADMITTED = "admitted"  # joiner with a donor; expected at the barrier ``first_step``


@dataclass(frozen=True)
class Arrival:
    step: int
    time: float
    state_hash: str | None
    retry: bool


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


@dataclass(frozen=True)
class Barrier:
    """A completed barrier."""

    step: int
    epoch_id: int
    members: tuple[Peer, ...]
    serve: dict[str, tuple[Peer, ...]] = field(default_factory=dict)
    hash_mismatch: tuple[Peer, ...] = ()
    changed: bool = True


class Membership:
    """Nodes, barriers, epochs, joiners and evictions of one run (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig | None = None, instance: str = "0") -> None:
        self.config = config or CoordinatorConfig()
        self.instance = instance
        self.fingerprint = self.config.fingerprint
        self._nodes: dict[str, Node] = {}
        self._last: Barrier | None = None  # None: not started (fresh, restarted, or emptied)
        self._resumed = False  # some registrant brought state (restart): no fresh founders
        self._floor = 0  # not started: the lowest acceptable boundary
        self._next_epoch = 1
        self._seq = 0  # registrations (session ids) and joiner admissions (ring order)
        self._first_reg: float | None = None
        self._hashes: dict[int, dict[str, Any]] = {}
        self._evictions: list[dict[str, Any]] = []
        self._notes: list[str] = []  # changes since the last epoch, for its log line
        self._events: list[str] = []

    # ---- queries -------------------------------------------------------------------------
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
        last = self._last
        return {"outer_step": self.outer_step, "started": self.started, "fingerprint": self.fingerprint,
                "protocol": PROTOCOL, "epoch": {"epoch_id": last.epoch_id, "outer_step": last.step,
                                                "members": [list(p) for p in last.members]} if last else None,
                "next_epoch_id": self._next_epoch, "nodes": nodes,
                "joiners": [n["node_id"] for n in nodes if n["role"] != "member"],
                "hashes": {str(k): v for k, v in self._hashes.items()}, "evictions": list(self._evictions)}

    # ---- requests ------------------------------------------------------------------------
    def register(self, node_id: str, addr: str, devices: int, protocol: int, fingerprint: str, now: float,
                 resume: Resume | None = None, founder: bool = True) -> RegisterReply:
        """Admit a node as a member or a pending joiner, or refuse it.

        Members: founders of a fresh run (``founder``: the node has not seen this run started) and,
        after a coordinator restart, nodes that ``resume`` with state. Everyone else joins.
        """
        if protocol != PROTOCOL:
            raise RegistrationRefused(f"node {node_id}: protocol version {protocol} != coordinator's {PROTOCOL}",
                                      "protocol")
        if not node_id or len(node_id) > 128 or not addr:
            raise RegistrationRefused(f"invalid node id {node_id!r} or ring address {addr!r}", "invalid")
        if node_id in self._nodes:
            raise RegistrationRefused(f"node id {node_id!r} is already registered and alive "
                                      f"(ring address {self._nodes[node_id].addr})", "duplicate")
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            raise RegistrationRefused(f"node {node_id}: model config fingerprint {fingerprint} != run's "
                                      f"{self.fingerprint}", "fingerprint")
        if resume is not None and self.started:
            raise Evicted(f"node {node_id}: the run is already at outer step {self.outer_step} (epoch "
                          f"{self.epoch_id}); state from step {resume.outer_step} is not resumed, join instead",
                          "stale")
        self.fingerprint = fingerprint if self.fingerprint is None else self.fingerprint
        self._seq += 1
        self._first_reg = now if self._first_reg is None else self._first_reg
        role, order, fresh = Role.PENDING, (1, 0), False
        if resume is not None:
            role, order = Role.MEMBER, (0, resume.rank)
            self._next_epoch = max(self._next_epoch, resume.epoch_id + 1)
            if not self._resumed:
                self._resumed = True
                for n in [n for n in self._nodes.values() if n.fresh]:
                    self._remove(n, now, f"run resumes from outer step {resume.outer_step}: nodes without state join")
            self._raise_floor(resume.outer_step, now)
        elif founder and not self.started and not self._resumed:
            role, order, fresh = Role.MEMBER, (0, 0), True
        self._nodes[node_id] = Node(node_id, addr, devices, f"{self.instance}.{self._seq}", role, order, now, fresh)
        what = "resumed member" if resume else ("founding member" if fresh else "joiner (pending)")
        self._event(f"registered {node_id} ({addr}, {devices} devices) as {what}")
        self._advance(now)
        return RegisterReply(node_id, self._nodes[node_id].session, role is Role.MEMBER, self.outer_step,
                             self.epoch_id, self.fingerprint or "", self.config.heartbeat_timeout)

    def heartbeat(self, node_id: str, session: str, now: float) -> None:
        self._get(node_id, session).last_seen = now

    def arrive(self, node_id: str, session: str, step: int, now: float, state_hash: str | None = None,
               retry_of: int | None = None) -> Epoch | None:
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
        node.arrival, node.outbox = Arrival(step, t0, state_hash, retry), None
        self._advance(now)
        return node.outbox

    def epoch_for(self, node_id: str, session: str) -> Epoch | None:
        """Poll the result of the barrier this node waits at (raises :class:`Evicted` if it was evicted)."""
        return self._get(node_id, session).outbox

    def request_admission(self, node_id: str, session: str, now: float, requeue: bool = False) -> Admission | None:
        """A joiner asks to be admitted; ``requeue``: its state transfer failed, assign a new donor."""
        node = self._get(node_id, session)
        node.last_seen = now
        if node.role is Role.MEMBER:
            raise ProtocolError(f"node {node_id} is already a member; call sync()")
        if requeue and node.role is Role.ADMITTED and not node.received:
            self._requeue(node, "its state transfer failed")
        return self.admission_for(node_id, session)

    def admission_for(self, node_id: str, session: str) -> Admission | None:
        node = self._get(node_id, session)
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

    def tick(self, now: float) -> None:
        """Evict on heartbeat timeout and boundary deadline; complete barriers that can."""
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
        if self.started and not holders:  # nobody holds the state any more: back to rebuild mode
            self._last, self._resumed, self._floor, self._first_reg = None, True, 0, now
            self._event("no member holds the run's state any more; waiting for nodes to resume from a checkpoint")

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
        self._complete(step, self._sorted(arrived))

    def _complete(self, step: int, members: list[Node]) -> None:
        prev = self._last
        pairs = tuple((n.node_id, n.addr) for n in members)
        retry = any(n.arrival.retry for n in members)  # type: ignore[union-attr]
        changed = prev is None or retry or pairs != prev.members
        if changed:
            epoch_id, self._next_epoch = self._next_epoch, self._next_epoch + 1
        else:
            epoch_id = prev.epoch_id  # type: ignore[union-attr]
        hashes = {n.node_id: n.arrival.state_hash for n in members if n.arrival.state_hash}  # type: ignore[union-attr]
        mismatch = tuple(sorted(hashes.items())) if len(set(hashes.values())) > 1 else ()
        rec = self._hashes.setdefault(step, {"hashes": {}, "mismatch": []})
        rec["hashes"].update(hashes)
        if mismatch:
            rec["mismatch"] = [list(p) for p in mismatch]
            self._event("WARNING state hash mismatch at outer step "
                        f"{step}: " + ", ".join(f"{n}={h[:16]}" for n, h in mismatch))
        for k in sorted(self._hashes)[: -self.config.history]:
            del self._hashes[k]
        for n in members:
            n.arrival, n.fresh = None, False
            if n.role is Role.ADMITTED:
                n.role = Role.MEMBER
                self._notes.append(f"joined {n.node_id}")
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
        self._last = Barrier(step, epoch_id, pairs, {d: tuple(s) for d, s in serve.items()}, mismatch, changed)
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
        return Epoch(b.epoch_id, b.step, b.members, rank, b.serve.get(node_id, ()), b.hash_mismatch, b.changed)
