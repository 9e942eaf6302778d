"""The membership's node table: who a registered node is to the run (its :class:`Role`), what it
brought and where it waits, and the barriers formed from it.

Plain records and pure queries over them, shared by :mod:`.membership` (which owns the table)
and the rules split out of it (:mod:`.admission`, :mod:`.history`, :mod:`.policing`), so none of
those needs the :class:`~.membership.Membership` itself.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from intellect_jax.coordinator.protocol import (Admission, DataPlan, Epoch, Peer, ProtocolError, Record, Resume,
                                                StaleSession)
from intellect_jax.coordinator.schema import Report


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
    report: Report | None = None  # on the all-reduce before
    vote: tuple[str, str] | None = None  # (signature, signer's certificate), both hex: see journal.RunRecord.votes


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
    strikes: int = 0  # rounds in which it was shown to have sent a bad piece (policing.py)
    false_accusations: int = 0  # accusations without valid evidence (policing.py)
    stalls: int = 0  # failed calls in a row in which most others named it as withholding its pieces (policing.py)
    data: DataPlan | None = None  # how it reads its data (None: it did not say)
    donors: set[str] = field(default_factory=set)  # its donors so far (a joiner admitted again gets another)
    since: float = 0.0  # when barriers began to wait for it (registered as a member, or promoted to one)


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
    data: tuple[int, int] | None = None  # data leases: tokens trained and discarded when it formed
    record: Record | None = None  # signed by the coordinator (claims.Notary), when it signs


class Sessions:
    """Session tokens: random (``secrets``), each bound to the node it was issued to; the newest
    ``keep`` are remembered (an older or unknown one is another coordinator's: stale)."""

    def __init__(self, keep: int) -> None:
        self._owner: dict[str, str] = {}
        self._keep = keep

    def issue(self, node_id: str) -> str:
        token = secrets.token_hex(16)
        self._owner[token] = node_id
        if len(self._owner) > self._keep:
            del self._owner[next(iter(self._owner))]
        return token

    def check(self, node_id: str, token: str) -> None:
        """A token that is no longer ``node_id``'s current one: raise unless this coordinator
        issued it to ``node_id`` (then the caller says why the node is gone)."""
        owner = self._owner.get(token)
        if owner is None:
            raise StaleSession(f"node {node_id}: its session is not one this coordinator issued (it restarted); "
                               "re-register", "stale_session")
        if owner != node_id:
            raise ProtocolError(f"node {node_id}: the session is another node's", "identity")


def ordered(nodes: Iterable[Node]) -> list[Node]:
    """Ring order: members first (by their resumed rank), then joiners by admission."""
    return sorted(nodes, key=lambda n: (n.order, n.node_id))


def waiting(nodes: Iterable[Node], step: int) -> list[Node]:
    """The nodes waiting at boundary ``step``."""
    return [n for n in nodes if n.arrival is not None and n.arrival.step == step]


def forming(nodes: Iterable[Node], last: Barrier | None, floor: int) -> tuple[int, set[Node], set[Node]] | None:
    """The barrier being formed: (step, nodes arrived, nodes expected); ``floor``: the boundary a
    run that has not started (``last`` None) waits at."""
    nodes = list(nodes)
    members = {n for n in nodes if n.role is Role.MEMBER}
    if last is None:
        arrived = set(waiting(nodes, floor))
        return (floor, arrived, members | arrived) if arrived else None
    k = last.step
    retry = set(waiting(nodes, k))
    if retry:  # (members already at k+1 would have evicted them)
        return k, retry, members
    nxt = set(waiting(nodes, k + 1))
    if not nxt:
        return None
    joiners = {n for n in nodes if n.role is Role.ADMITTED and n.admission and n.admission.outer_step == k + 1}
    return k + 1, nxt, members | joiners


def describe(n: Node, now: float) -> dict[str, Any]:
    """A node as ``status()`` lists it."""
    return {"node_id": n.node_id, "addr": n.addr, "devices": n.devices, "role": n.role.value,
            "heartbeat_age": round(now - n.last_seen, 3), "waiting_at": n.arrival.step if n.arrival else None,
            "donor": n.admission.donor_id if n.admission and n.role is Role.ADMITTED else None,
            "state_received": n.received}


def view(b: Barrier, node_id: str) -> Epoch:
    """Barrier ``b`` as member ``node_id`` receives it."""
    rank = [p[0] for p in b.members].index(node_id)
    return Epoch(b.epoch_id, b.step, b.members, rank, b.serve.get(node_id, ()), b.hash_mismatch, b.changed,
                 b.sitting_out, b.data, b.record)
