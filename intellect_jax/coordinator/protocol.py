"""Wire-level types of the coordinator protocol: version, errors, config, and the messages a
node receives (registration reply, epoch, admission). Shared by the membership state machine,
the server and the client."""

from __future__ import annotations

from dataclasses import dataclass

# coordinator protocol version; bump on any incompatible change (6: data leases, 7: data plans,
# 8: the last average's verdict in the state hash and the transfer header, 11: audits of the
# butterfly's owners in the all-reduce header and the barrier report, 12: whose pieces a failed
# butterfly call lacked, in the retry's report; BLAKE3 digests in signed pieces and audits,
# 13: an owner's own row in an audit case or as evidence is in the call's codec, not float32,
# 14: the butterfly cuts each segment into at least 16 pieces where they keep 4,096 values;
# clip and cclip take float32 norms, cclip one step: a judge of 13 would see other bits,
# 15: the butterfly's audit pairing drawn from nonces bound in the call's header,
# 16: cclip back to three steps, its norms float32 still, 17: rows outsized against the
# others', shown by their owners in the report after a butterfly call that succeeded,
# 18: a gathered codec's pieces are signed to every rank, not to the successor: evidence of 17
# would not verify, 19: barrier replies carry the coordinator's signed record and claims the
# record that proves them, coordinator.claims)
PROTOCOL = 19


class CoordinatorError(Exception):
    """Base class of coordinator errors; ``reason`` is a short machine-readable code."""

    reason = "error"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or type(self).reason


class RegistrationRefused(CoordinatorError):
    """Another run authority's or a revoked certificate, protocol, model fingerprint, or a duplicate live node id."""


class Evicted(CoordinatorError):
    """This node is no longer in the run; it must re-register as a joiner."""


class ProtocolError(CoordinatorError):
    """A malformed message, a request in another node's name (``reason="identity"``), or one
    that makes no sense in the node's state (e.g. sync by a pending joiner)."""


class StaleSession(CoordinatorError):
    """The session belongs to another coordinator instance (it restarted): re-register."""


class CoordinatorUnavailable(CoordinatorError):
    """The coordinator could not be reached within the reconnect timeout (client side)."""


class RunCompleted(CoordinatorError):
    """The run has already done all its outer steps: nothing left to join (exit cleanly)."""


@dataclass(frozen=True)
class DataPlan:
    """How a node reads its training data: units leased by the coordinator (``leases``,
    coordinator/leases.py), or the fixed shard ``rank`` of ``ranks`` (``diloco.data_rank`` /
    ``data_ranks``). A run takes one plan (its first barrier's): the coordinator refuses a node
    of another, and a fixed shard that a live node already reads."""

    leases: bool
    rank: int = 0
    ranks: int = 1

    @property
    def mode(self) -> str:
        """The run-wide part (journaled): every node of the run must have the same."""
        return "leases" if self.leases else f"{self.ranks} fixed shards"

    def describe(self) -> str:
        return "data leased from the coordinator" if self.leases else f"fixed data shard {self.rank} of {self.ranks}"


@dataclass(frozen=True)
class CoordinatorConfig:
    """Timeouts and run-start rules of the coordinator (seconds on its monotonic clock)."""

    heartbeat_timeout: float = 5.0  # no heartbeat for this long -> evicted
    boundary_timeout: float = 300.0  # not at the barrier this long after its first arrival (or its own start) -> evicted
    join_window: float = 5.0  # the first barrier never closes earlier than this after the first registration
    min_nodes: int = 1  # a fresh run's first barrier waits for this many founding members
    fingerprint: str | None = None  # the run's model config fingerprint (None: the first registrant's)
    keepalive_interval: float = 1.0  # server -> client "still waiting" frames during a blocked request
    tick_interval: float = 0.1  # how often timeouts are checked
    history: int = 200  # per-step hash records and eviction log entries kept
    outer_steps: int | None = None  # the run's length in outer steps (None: the first registrant's)
    sit_out_limit: int = 3  # a node whose own checks fail at this many barriers in a row is evicted
    strikes: int = 2  # a node shown to have sent bad pieces in this many rounds is evicted (policing.py)
    stall_calls: int = 2  # a node most others name as withholding its pieces in this many failed calls in a row
    allow_rollback_to: int | None = None  # operator: the run may restart from this outer step or later
    # with no live node holding the run's newest state for this long, roll back by itself to the
    # newest state registered nodes hold from their checkpoints (None: wait for an operator)
    auto_rollback_after: float | None = 600.0
    max_handlers: int = 4096  # connections served at once (a thread each); more are refused
    handlers_per_identity: int = 16  # ... of them from one node identity

    def __post_init__(self) -> None:
        if min(self.heartbeat_timeout, self.boundary_timeout, self.keepalive_interval, self.tick_interval) <= 0:
            raise ValueError(f"timeouts and intervals must be positive: {self}")
        if self.auto_rollback_after is not None and self.auto_rollback_after <= 0:
            raise ValueError(f"auto_rollback_after must be positive (or None: never): {self}")
        if self.join_window < 0 or self.min_nodes < 1:
            raise ValueError(f"join_window must be >= 0 and min_nodes >= 1: {self}")
        if min(self.max_handlers, self.handlers_per_identity, self.stall_calls) < 1:
            raise ValueError(f"max_handlers, handlers_per_identity and stall_calls must be >= 1: {self}")


Peer = tuple[str, str]  # (node_id, "host:port")


@dataclass(frozen=True)
class Record:
    """A barrier's record as the run's coordinator signed it (``net.identity.record``): the hash
    it recorded for ``outer_step``, the epoch it formed and that epoch's members (ring order);
    ``signature`` and the coordinator's ``cert`` (DER), both hex. A node keeps the newest with its
    checkpoints: a coordinator that lost the run's history takes a claim only with one."""

    outer_step: int
    state_hash: str
    epoch_id: int
    members: tuple[str, ...]
    signature: str
    cert: str


@dataclass(frozen=True)
class Resume:
    """What a node registering with state claims: the outer step its state is at, that state's
    hash, and (after a coordinator restart) its last epoch, its rank and that epoch's members (a
    coordinator that lost the run's history waits for most of them before rebuilding the run);
    ``record``: the newest barrier record it holds, of its step or the one before
    (``coordinator.claims``)."""

    outer_step: int
    epoch_id: int = 0
    rank: int = 0
    state_hash: str | None = None
    members: tuple[str, ...] = ()
    record: Record | None = None


@dataclass(frozen=True)
class RegisterReply:
    """Answer to ``register``: ``member`` (has state, syncs at ``outer_step``) or joiner."""

    node_id: str
    session: str
    member: bool
    outer_step: int  # the boundary the run is heading for (0 for a fresh run)
    epoch_id: int  # last epoch formed (0: none yet)
    fingerprint: str
    heartbeat_timeout: float
    note: str = ""  # why a node that brought state was made a joiner (behind, diverged, run in progress)


@dataclass(frozen=True)
class Epoch:
    """Result of a barrier: the ring (in order) that all-reduces outer step ``outer_step + 1``."""

    epoch_id: int
    outer_step: int
    members: tuple[Peer, ...]
    rank: int
    serve: tuple[Peer, ...] = ()  # joiners this node streams its state to after outer step k+1
    hash_mismatch: tuple[Peer, ...] = ()  # (node_id, state hash) of every member when they disagree
    changed: bool = True  # membership differs from the previous epoch (or a retry)
    sitting_out: tuple[str, ...] = ()  # members that contribute zeros to this all-reduce (failed own checks)
    data: tuple[int, int] | None = None  # data leases: the run's tokens trained and discarded so far
    record: Record | None = None  # this barrier's record, signed by the coordinator (None: it signs none)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def addresses(self) -> list[str]:
        """Ring addresses in ring order (the ring itself: ``NetNode.ring(epoch.members, epoch.rank, ...)``)."""
        return [a for _, a in self.members]

    @property
    def node_ids(self) -> list[str]:
        return [n for n, _ in self.members]


@dataclass(frozen=True)
class Admission:
    """A joiner's admission: fetch the state after outer step ``outer_step`` from the donor.
    ``state_hash``: the hash the run recorded for that step, which the received state must
    have (None while the step is not recorded yet: then the barrier at ``outer_step`` checks it)."""

    donor_id: str
    donor_addr: str
    admitted_at: int  # the boundary k that admitted it (-1: resumes with the state it brought)
    outer_step: int  # k + 1: the state it receives, and the k of its first sync
    epoch_id: int
    state_hash: str | None = None
