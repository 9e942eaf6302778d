"""Butterfly all-reduce: every member's contribution reaches the owner of each segment whole.

The ring sums contributions as they travel, so no rank but a sender's successor ever sees one
unsummed, and that successor sees only 1/N of it. Here (hivemind's butterfly layout) the flat
vector is cut into ``world`` segments (:func:`~.plan.butterfly_plan`, pipeline pieces included) and
rank ``c`` owns segment ``c``:

1. **Scatter.** Every rank sends its own piece ``j`` of segment ``c`` to rank ``c``, encoded once
   in the ring's codec and followed by its signature (:mod:`.evidence`, the receiver named in
   the statement is the owner). So each owner holds every member's own piece of its segment,
   as its sender signed it: a bad piece anywhere in a contribution is evidence against its
   sender and nobody else.
2. **Aggregate.** The owner decodes the ``world - 1`` rows of piece ``j`` it received and its
   own row through the same codec (every row is what its sender encoded: an auditor then checks
   the owner's in the codec's bytes too), shows each other member's to ``inspect``, and
   aggregates them with :func:`~.robust.aggregate` (a row that is not finite is dropped by every
   aggregator). It
   encodes the aggregate once and adopts the decoded value itself. The rows of members that
   sit the round out (``absent``: their own checks failed, and the coordinator told every
   member) are left out, so the result averages the contributors only; such a member must
   send zeros, and a piece of it that is not all zeros is evidence against it too.
3. **Gather.** The owner sends those bytes to every other rank, which decodes exactly them: the
   result is bit-identical on every rank that the owners were honest to.

With ``auditing`` (:mod:`.audit`) each owner then commits to its aggregates under its signature
as soon as it has them all (the audit's frames go out between the aggregates, each once it is
ready), and every rank audits one owner's segment (one piece
drawn at random, recomputed from every member's signed piece of it); a fault fails the call
everywhere, with the case that names the culprit.

A call reduces every bucket of the tree (one flat vector each) over the same links, and each
link carries every bucket's step 1 before any bucket's step 3 (:class:`~.mesh_call.MeshCall`): what a rank sends
in step 1 depends on nobody, so no failure in one bucket's gather keeps an honest rank's pieces
of a later bucket from their owners. A failure on one link does not cut step 1 short on the
others either: every link sends and reads its own pieces to their end (or the deadline) before
it is shut. So when a call fails, the ranks whose own pieces of any bucket never reached an
owner (its ``gaps``) are those that withheld them, whatever else failed. The coordinator evicts
a member that most others name so in consecutive calls (``coordinator.policing``).

Each rank sends ``(N - 1)/N`` of its contribution and ``N - 1`` copies of its segment's
aggregate: ``2 (N - 1)/N`` of the vector, as the ring does, plus one signature frame per piece
sent in step 1 and, when auditing, about one piece per link. Links form a full mesh: one
connection to and one from every other rank (:class:`~.ring.Links` whose ``out[k]`` and
``inn[k]`` join rank ``(rank + 1 + k) mod N``).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from intellect_jax.net import quant, robust
from intellect_jax.net.robust import aggregate_piece
from intellect_jax.net.audit import DIGEST, ENTRY, Auditing, Case, Ledger, left_cap, passed
from intellect_jax.net.audit_frames import AuditFrames
from intellect_jax.net.errors import FrameError, PeerTimeout
from intellect_jax.net.evidence import OUTSIZE, SAT_OUT, SIG_BYTES, digest, outsized, row_norm
from intellect_jax.net.frames import HEADER_LEN, MsgType
from intellect_jax.net.mesh_call import ROW_LOOK, MeshCall
from intellect_jax.net.plan import RingPlan, butterfly_plan
from intellect_jax.net.relay import Posted, Skipped
from intellect_jax.net.ring import Finding, Inspect, Links, Pipeline, Workspace
from intellect_jax.net.tree import Flat, overlaps

Vector = np.ndarray | Flat  # a bucket: one flat float32 array, or several seen as one

RING_MODES = ("fp32", "bf16", "int8", "int4")  # codecs whose contributions can be cut into segments
TAIL = 4  # bytes of an auditor's last aggregate piece held back until its audit passed (no rank completes without)
BUCKET_MARK = struct.Struct("<4sI")  # with audits, each bucket's gather on a link starts with MARK and its index (AUDIT)
MARK = b"MARK"  # (no other audit frame of 8 bytes starts so: a request for rows is bytes 0 and 1)
_STOPPED = object()  # (the call failed while a link's thread waited)


@dataclass(frozen=True)
class Outsize:
    """A piece of our segment in which a sender's row was outsized (:func:`~.evidence.outsized`):
    every row we may show of it as it arrived (``payloads``, by rank; None for ours and a
    sitter's) with its sender's signature to us, and how many times the median its row was."""

    piece: int
    numel: int
    ratio: float
    payloads: tuple[bytes | None, ...]
    signatures: tuple[bytes | None, ...]


@dataclass
class Weighing:
    """One call's weighing of the senders' rows of our segment, every bucket's, once the call
    succeeded: ``pieces`` weighed, per sender the pieces its row was outsized in
    (:func:`~.evidence.outsized`), and its first such piece (every row of it signed, each
    signature checked as it arrived), with the bucket it was in."""

    pieces: int = 0
    outsized: dict[int, int] = field(default_factory=dict)
    first: dict[int, tuple[int, Outsize]] = field(default_factory=dict)

    def steering(self) -> list[tuple[int, int, Outsize]]:
        """(sender, bucket, its first outsized piece) for each sender outsized in most pieces."""
        return [(i, *self.first[i]) for i, n in sorted(self.outsized.items())
                if 2 * n > self.pieces and i in self.first]


@dataclass(frozen=True)
class MeshSeal:
    """How one call signs this rank's own pieces for each owner and checks a sender's:
    ``sign(owner, segment, piece, numel, payload) -> signature`` and ``verify(sender, segment,
    piece, numel, payload, signature) -> bool`` (ranks, not identities)."""

    sign: Callable[[int, int, int, int, bytes], bytes]
    verify: Callable[[int, int, int, int, bytes, bytes], bool]


def peer_of(rank: int, world: int, k: int) -> int:
    """The rank that mesh link ``k`` of ``rank`` joins."""
    return (rank + 1 + k) % world


def roundtrip(x: np.ndarray, mode: str, block: int) -> np.ndarray:
    """What a row is to its owner: ``decode(encode(x))`` (float32)."""
    return quant.decode(quant.encode(np.ascontiguousarray(x, np.float32), mode, block), x.shape[0], mode, block)


def simulate(inputs: Sequence[np.ndarray], mode: str, block: int, piece_numel: int, how: str = "mean",
             absent: frozenset[int] = frozenset(), left: Mapping[int, Mapping[int, int]] | None = None) -> np.ndarray:
    """What :func:`butterfly_all_reduce` returns on every rank, computed in one process
    (``left[c][i]``: the first piece of segment ``c`` from which its owner left out ``i``'s rows)."""
    world, numel = len(inputs), inputs[0].shape[0]
    if world == 1:
        return np.zeros(numel, np.float32) if absent else np.array(inputs[0], np.float32, copy=True)
    p = butterfly_plan(numel, world, block, piece_numel)
    out = np.empty(numel, np.float32)
    for c in range(world):
        for j in range(p.pieces):
            a, b = p.piece(c, j)
            rows = [roundtrip(x[a:b], mode, block) for x in inputs]
            out_j = frozenset(i for i, f in (left or {}).get(c, {}).items() if f <= j)
            wire = aggregate_piece(rows, b - a, mode, block, how, absent=absent | out_j)
            quant.decode(wire, b - a, mode, block, out=out[a:b])
    return out


class _ButterflyRun(AuditFrames):
    """State of one bucket (one flat vector) of a butterfly call (``mesh``)."""

    def __init__(self, mesh: MeshCall, x: Vector, out: Vector, mode: str, block: int, piece_numel: int,
                 how: str, inspect: Inspect | None, seal: MeshSeal | None, ws: Workspace, absent: frozenset[int],
                 auditing: Auditing | None = None) -> None:
        rank, world = mesh.rank, mesh.world
        self.mesh, self.cond, self.deadline = mesh, mesh.cond, mesh.deadline
        self.ws, self.absent = ws, absent
        self.x, self.out, self.rank, self.world = x, out, rank, world
        self.mode, self.block, self.how = mode, block, how
        self.inspect, self.mseal = inspect, seal
        self.plan: RingPlan = butterfly_plan(x.shape[0], world, block, piece_numel)
        self.index = len(mesh.buckets)  # our place among the call's buckets
        self.first = sum(b.plan.pieces for b in mesh.buckets)  # pieces each link carries in the buckets before
        self.rows: list[list[np.ndarray | None]] = [[None] * world for _ in range(self.plan.pieces)]
        self.agg: list[np.ndarray | None] = [None] * self.plan.pieces
        self.findings: list[tuple[int, Finding]] = []  # (sender rank, its bad piece), first per sender
        self.got = [0] * world  # own pieces of our segment received whole from each rank (step 1)
        # (piece, sender, its payload, its signature) received while the owner's aggregation was 2 or
        # more buckets behind ours: kept as they came, decoded once it reaches us (see _scatter_from)
        self.early: list[tuple[int, int, np.ndarray, bytes | None]] = []
        # signed calls: each sender's own piece as it came with its signature, until aggregated (_weigh)
        self.wires: list[list[tuple[np.ndarray, bytes] | None]] = [[None] * world for _ in range(self.plan.pieces)]
        self.norms = [[0.0] * world for _ in range(self.plan.pieces)]  # of the rows kept in wires (row_norm)
        self.weighed = 0  # pieces of our segment weighed (_weigh)
        self.outsize: dict[int, list] = {}  # sender -> [pieces its row was outsized in, the first one's Outsize]
        # when auditing, each sender's own piece of our segment as it came, kept until our auditor's
        # challenge (then only the challenged piece's) so that we can supply it (audit_frames._supply)
        self.kept_rows: list[list[np.ndarray | None]] = [[None] * world for _ in range(self.plan.pieces)]
        if auditing is not None and seal is None:
            raise ValueError("auditing owners needs signed pieces (a seal)")
        self.ledger = None if auditing is None else Ledger(auditing, rank, x.shape[0], piece_numel, mode, block, how,
                                                           absent)
        # per sender, the first piece whose row we left out at the row deadline (P: none; see _rows_in)
        self.left = [self.plan.pieces] * world if self.ledger is None else self.ledger.left
        self.verdict: tuple[int, str, Case] | None = None  # (guilty rank, why, the case) from our audit
        self.judging, self.judged = threading.Lock(), None  # (judged: our audit's Judgement)
        self.audit_sent = {}
        # the gather (relay.py): each owner's aggregates placed from its own link (in order) and by
        # relay; those received, kept to relay them in turn (with audits: checkable by the asker)
        self.via_link = [0] * world
        self.wrong: list[set[int]] = [set() for _ in range(world)]  # read from the link, but not the committed ones
        self.relayed: list[set[int]] = [set() for _ in range(world)]
        self.kept: dict[tuple[int, int], np.ndarray] = {}
        self.passes: dict[int, bytes] = {}  # owner -> its signature that its audit passed (audit.passed)
        self.pushed: dict[int, Any] = {}  # owner -> the header of our first frame from it, read in the bucket before
        # owners whose links to us went out of step in this bucket (read on from a later bucket's
        # mark: resync), and those whose mark of this bucket that read already
        self.gone: set[int] = set()
        self.marked: set[int] = set()
        self.placing = [threading.Lock() for _ in range(world)]  # per owner (before cond, when both are taken)

    @property
    def links(self) -> Links:
        return self.mesh.links

    @property
    def error(self) -> BaseException | None:
        return self.mesh.error

    def wait_for(self, ready: Callable[[], bool], what: str) -> bool:
        return self.mesh.wait_for(ready, what)

    their_signature = Pipeline.their_signature

    def _pace(self, phase: int, k: int, j: int) -> bool:
        return self.mesh._pace(phase, k, self.first + j)

    def _sent(self, phase: int, k: int) -> None:
        self.mesh._sent(phase, k)

    def _after_step1(self) -> bool:
        return self.mesh._after_step1()

    def release(self) -> None:
        """Our aggregates, those we kept to relay, and the rows we kept to supply, back to the pool."""
        for w in self.agg:
            if w is not None:
                self.ws.release(w)
        self.drop_rows()
        for (q, j), w in self.kept.items():
            if j not in self.relayed[q]:  # (a relayed piece is no pooled buffer)
                self.ws.release(w)
        self.kept = {}

    # -- what we hold of the result (relay.py; under cond) -----------------------------------
    def _settled(self, q: int, j: int) -> bool:
        """Whether owner ``q``'s aggregate of piece ``j`` is in our result for good: from its link
        and (with audits) checked against its commitment, or relayed (checked too)."""
        if q == self.rank:
            return self.agg[j] is not None
        return j in self.relayed[q] or j < self.via_link[q] and j not in self.wrong[q] and \
            (self.ledger is None or q in self.ledger.theirs)

    def unsettled(self, q: int) -> int | None:
        """The first piece of owner ``q``'s segment not yet settled (None: all are)."""
        if self.via_link[q] == self.plan.pieces and not self.wrong[q] and self._settled(q, 0):
            return None
        return next((j for j in range(self.plan.pieces) if not self._settled(q, j)), None)

    def whole(self) -> bool:
        """Whether every owner's every piece is settled and (with audits) our own audit passed."""
        if any(self.unsettled(q) is not None for q in range(self.world)):
            return False
        return self.ledger is None or (self.judged is not None and self.judged.right and self.verdict is None)

    def held(self, q: int, j: int) -> tuple[np.ndarray, bytes | None] | None:
        """Owner ``q``'s aggregate of piece ``j`` as we hold it, settled, with (for its last
        piece) ``q``'s signature that its audit passed (None: we do not hold it)."""
        wire = self.agg[j] if q == self.rank else self.kept.get((q, j))
        if not self._settled(q, j) or wire is None:
            return None
        if j < self.plan.pieces - 1:
            return wire, None
        sig = self.passes.get(q)
        return None if sig is None else (wire, sig)

    def contradicted(self, q: int, js: list[int], unsettled: bool = False) -> None:
        """Owner ``q``'s aggregates of pieces ``js`` from its link are not the ones it committed
        to: unsettled (whatever was placed for them the relay overwrites; ``unsettled``: the
        caller did it, under ``cond``: :meth:`unsettle`), and asked for by relay at once; its
        link is read on (its later frames are in step: the content of these was wrong, proving
        nothing to anyone else, and nobody is named). If no peer says DONE in time, the call
        fails with it (``relay.Relay._doomed``); without the relay, at once."""
        if not self.mesh.relaying:  # (some bucket unaudited: nothing is relayed)
            raise FrameError(f"rank {q}: its aggregates are not the ones it committed to")
        if not unsettled:
            with self.cond:
                self.unsettle(q, js)
        self.mesh.lost(1, (q - self.rank - 1) % self.world,
                       FrameError(f"rank {q}: its aggregates of pieces {js} are not the ones it committed to"),
                       skipped=True)

    def unsettle(self, q: int, js: list[int]) -> None:
        """(Under ``cond``.) Owner ``q``'s pieces ``js`` from its link are not in our result."""
        self.wrong[q].update(js)
        self.via_link[q] = max(self.via_link[q], max(js) + 1)
        self.cond.notify_all()

    def relayed_in(self, q: int, j: int, wire: np.ndarray, sig: bytes | None) -> bool:
        """Owner ``q``'s aggregate of piece ``j`` relayed to us: placed if it is the one ``q``
        committed to (and its last piece, only with ``q``'s signature that its audit passed:
        ``sig``) and we do not hold it yet (False: it is not, or we cannot tell)."""
        led = self.ledger
        with self.cond:
            ds = None if led is None else led.theirs.get(q)
        if ds is None or digest(wire) != ds[j]:
            return False
        last = j == self.plan.pieces - 1
        if last and (sig is None or not self.passed_by(q, sig)):
            return False
        a, b = self.plan.piece(q, j)
        with self.placing[q]:
            with self.cond:
                if self._settled(q, j):
                    return True
            self._place(a, b, wire)
            with self.cond:
                self.relayed[q].add(j)
                self.kept[(q, j)] = wire
                if last:
                    self.passes[q] = sig  # type: ignore[assignment]
                self.cond.notify_all()
        self.mesh.poke.set()
        return True

    def _keep_row(self, j: int, sender: int, wire: np.ndarray) -> None:
        """``sender``'s own piece ``j`` of our segment, done with: kept to supply if we are
        audited (:attr:`kept_rows`), else back to the pool."""
        if self.ledger is None:
            self.ws.release(wire)
            return
        with self.cond:
            self.kept_rows[j][sender] = wire

    def drop_rows(self, but: int | None = None) -> None:
        """The rows kept to supply back to the pool, but piece ``but``'s."""
        with self.cond:
            dropped = [w for j, ws in enumerate(self.kept_rows) if j != but for w in ws if w is not None]
            self.kept_rows = [ws if j == but else [None] * self.world for j, ws in enumerate(self.kept_rows)]
        for w in dropped:
            self.ws.release(w)

    def row_nbytes(self, j: int) -> int:
        """Bytes of a row of piece ``j`` of our segment on the wire."""
        a, b = self.plan.piece(self.rank, j)
        return quant.encoded_nbytes(b - a, self.mode, self.block)

    def _wire(self, n: int) -> np.ndarray:
        """A pooled buffer for ``n`` values on the wire (give it back with ``ws.release``)."""
        return self.ws.get(quant.encoded_nbytes(n, self.mode, self.block))

    def _row(self, n: int) -> np.ndarray:
        """A pooled float32 row of ``n`` values (its buffer goes back with ``ws.release(row.base)``)."""
        return self.ws.get(4 * n).view(np.float32)

    def _place(self, a: int, b: int, wire: np.ndarray) -> None:
        """The aggregate of values ``[a, b)`` on the wire, decoded into the result."""
        if isinstance(self.out, np.ndarray):
            quant.decode(wire, b - a, self.mode, self.block, out=self.out[a:b])
            return
        row = self._row(b - a)
        self.out.put(a, quant.decode(wire, b - a, self.mode, self.block, out=row))
        self.ws.release(row.base)

    def _encode(self, seg: int, j: int) -> np.ndarray:
        """Our own piece ``j`` of segment ``seg`` on the wire, in a pooled buffer."""
        a, b = self.plan.piece(seg, j)
        buf = self._wire(b - a)
        if self.mode == "fp32":
            np.copyto(buf.view(np.float32), self.x[a:b])
            return buf
        return quant.encode(self.x[a:b], self.mode, self.block, buf)

    def _weigh(self, j: int) -> None:
        """Count the senders whose row of piece ``j`` is outsized against the others we may show
        (:func:`~.evidence.outsized`: not ours, none of a sitter's), keeping each one's first such
        piece as signed evidence (:class:`Outsize`); then the pieces go back to the pool. A piece
        whose row of a contributor we left out is not weighed: the coordinator takes such
        evidence only with every contributor's row (a review found that it counted it as a false
        accusation against us)."""
        with self.cond:
            wires, self.wires[j] = self.wires[j], [None] * self.world
            short = any(self.left[i] <= j for i in range(self.world) if i != self.rank and i not in self.absent)
        try:
            a, b = self.plan.piece(self.rank, j)
            if b <= a or short:
                return
            self.weighed += 1
            shown = [i for i, w in enumerate(wires) if w is not None]
            norms = {i: self.norms[j][i] for i in shown}
            for i in shown:
                ratio = outsized(norms, i, self.world)
                if ratio is None or not ratio > OUTSIZE:
                    continue
                seen = self.outsize.setdefault(i, [0, None])
                seen[0] += 1
                if seen[1] is None:  # (every row kept was checked as it arrived: _scatter_from)
                    seen[1] = Outsize(j, b - a, ratio, tuple(None if w is None else w[0].tobytes() for w in wires),
                                      tuple(None if w is None else w[1] for w in wires))
        finally:
            for i, w in enumerate(wires):
                if w is not None:
                    self._keep_row(j, i, w[0])

    def weigh_into(self, w: Weighing, bucket: int) -> None:
        """Add this bucket's weighing to the call's."""
        w.pieces += self.weighed
        for i, (n, ev) in self.outsize.items():
            w.outsized[i] = w.outsized.get(i, 0) + n
            if ev is not None and i not in w.first:
                w.first[i] = (bucket, ev)

    def _release_rows(self, rows: list[np.ndarray | None]) -> None:
        for r in rows:
            if r is not None:
                self.ws.release(r.base)

    # -- threads -----------------------------------------------------------------------
    def encoder(self) -> None:
        """The owner: aggregate each piece of our segment once every member's row is in, or
        left out (:meth:`_rows_in`; then, when auditing, commit to them all)."""
        me, P, led = self.rank, self.plan.pieces, self.ledger
        with self.cond:  # (our receivers decode what comes from now on themselves: mesh.current is ours)
            early, self.early = self.early, []
            for i, first in self.mesh.left_out.items():  # (left out once, out for the rest of the call: one
                if first < self.index:  # grace, not one a bucket)
                    self.left[i] = 0
        for j, o, wire, sig in early:
            self._take(o, j, wire, sig, -1)
        for j in range(P):
            a, b = self.plan.piece(me, j)
            own = self._encode(me, j)  # our own row as every other member's: through the codec
            row = self._row(b - a)
            quant.decode(own, b - a, self.mode, self.block, out=row)
            if led is not None:
                led.own(j, own)
            self.ws.release(own)
            with self.cond:
                self.rows[j][me] = row
            if not self._rows_in(j):
                return
            rows = self.rows[j]
            out = frozenset(i for i in range(self.world) if self.left[i] <= j)
            wire = aggregate_piece(rows, b - a, self.mode, self.block, self.how, self._wire(b - a), self.absent | out,
                                   self.ws.scratch)
            self._place(a, b, wire)
            self._weigh(j)
            if led is not None:
                led.aggregated(j, wire)
            with self.cond:
                self.agg[j] = wire
                self.rows[j] = [None] * self.world
                self.cond.notify_all()
            self._release_rows(rows)
        if led is not None:
            led.seal()
            with self.cond:
                self.cond.notify_all()
        self.mesh.poke.set()


    def _rows_in(self, j: int) -> bool:
        """Wait for every row of piece ``j`` of our segment (False: the call failed meanwhile).
        With the relay (every bucket audited) a row does not come for ever: once all but at most
        :func:`~.audit.left_cap` contributors' are in, the missing ones get the row deadline
        (:meth:`~.mesh_call.MeshCall.row_grace`), then their senders are left out from this piece
        on, for the rest of the call (declared in our commitment, which the audit checks), each
        once its link has brought us no frame for the whole grace (``ROW_IDLE`` at least: the
        transport counts a frame's bytes once it is whole): a sender whose pieces still come,
        however slowly, is waited for (a peer that reads a sender's pieces slowly holds its other
        links to its pace: a review found that such a minority could make every owner leave out
        the honest senders it chose). So a member that withholds its pieces from us, or sends
        them late or under a signature that does not verify, loses its own say only; one that
        trickles them is still waited for."""
        if not self.mesh.relaying:
            return self.wait_for(lambda: all(r is not None for r in self.rows[j]), f"the rows of piece {j}")
        since = None
        with self.cond:
            while True:
                if self.error is not None:
                    return False
                now = time.monotonic()
                if now >= self.deadline:
                    raise PeerTimeout(f"butterfly: the rows of piece {j} not in before the deadline")
                missing = self._missing(j)
                if not missing:
                    return True
                for i in missing:  # (each look at its link's bytes: it has been idle since the first that saw none)
                    self.mesh.heard_from(i, now)
                until, capped = self.deadline, self._within_cap(missing)
                if capped:
                    since = now if since is None else since
                    until = since + self.mesh.row_grace(since, missing)
                    if now >= until:  # (no frame from it for the whole grace: a slow link's big piece is no silence)
                        idle = [i for i in missing if self.mesh.idle(i, now, until - since)]
                        for i in idle:
                            self._leave_out(i, j)
                        if len(idle) == len(missing):
                            return True
                        until = now + ROW_LOOK
                else:
                    since = None
                self.cond.wait(max(0.001, min(until - now, self.deadline - now, ROW_LOOK)), until=lambda: (
                    self.error is not None or self._missing(j) != missing or self._within_cap(missing) != capped))

    def _missing(self, j: int) -> list[int]:
        """(Under ``cond``.) The senders whose row of piece ``j`` we lack and still wait for."""
        return [i for i, r in enumerate(self.rows[j]) if r is None and self.left[i] > j]

    def _within_cap(self, more: Sequence[int]) -> bool:
        """(Under ``cond``.) Whether the senders ``more`` may be left out too: with those left
        out already, in any bucket of the call, at most :func:`~.audit.left_cap` contributors
        (sitters are free). Counted over the call, not the bucket: a sender left out of one
        bucket is out of every later one (:meth:`encoder`), and a later bucket may leave one out
        first (a signature that does not verify comes as it comes), so the union is what
        every bucket's declaration must stay within (a review found a bucket's own count let a
        later bucket's go over, convicting its honest owner)."""
        mesh, n = self.mesh, len(self.mesh.buckets)
        out = [i for i in range(self.world) if i not in self.absent and
               (i in more or mesh.left_out.get(i, n) < n or any(b.left[i] < b.plan.pieces for b in mesh.buckets))]
        return len(out) <= left_cap(self.world, self.absent)

    def _leave_out(self, i: int, j: int) -> None:
        """(Under ``cond``.) Sender ``i``'s rows of our segment left out from piece ``j`` on."""
        self.left[i] = min(self.left[i], j)
        self.mesh.left_out[i] = min(self.mesh.left_out.get(i, self.index), self.index)
        if i not in self.mesh.pieces_at:  # (no piece of it had come: see MeshCall.unheard)
            self.mesh.unheard.add(i)
        self.cond.notify_all()

    def _scatter_to(self, k: int) -> None:
        """Step 1 on link ``k``: our own pieces of its owner's segment, each with its signature;
        on to the end even after the call failed elsewhere (see :meth:`fail`)."""
        conn, o = self.links.out[k], peer_of(self.rank, self.world, k)
        for j in range(self.plan.pieces):
            self._pace(0, k, j)  # (paced while the call stands; after a failure, as fast as the link takes)
            wire = self._encode(o, j)
            conn.send(MsgType.DATA, wire, deadline=self.deadline)
            if self.mseal is not None:
                a, b = self.plan.piece(o, j)
                conn.send(MsgType.DATA, self.mseal.sign(o, o, j, b - a, wire), deadline=self.deadline)
            self.ws.release(wire)
            self._sent(0, k)

    def _gather_to(self, k: int) -> None:
        """Step 3 on link ``k``: our aggregates; when auditing, each audit frame goes out between
        them as soon as it is ready, and those not out by then before the last piece's tail."""
        conn, o, P = self.links.out[k], peer_of(self.rank, self.world, k), self.plan.pieces
        if not self._after_step1():
            return
        if self.ledger is not None:  # (an audit frame, whatever comes next: a member whose previous bucket
            # we gave up on this link knows this one has begun: relay.Skipped)
            conn.send(MsgType.AUDIT, BUCKET_MARK.pack(MARK, self.index), deadline=self.deadline)
        for j in range(P):
            if not self.wait_for(lambda: self.agg[j] is not None, f"the aggregate of piece {j}"):
                return
            if not self._pace(1, k, j):
                return
            if self.ledger is not None and not self._audit_out(conn, o, wait=False):  # (those ready by now)
                return
            wire: np.ndarray = self.agg[j]  # type: ignore[assignment]
            if j == P - 1 and self.ledger is not None:  # all but its tail; the tail once our audit passed
                conn.send(MsgType.DATA, wire[:-TAIL], deadline=self.deadline)
                if not self._audit_end(conn, o):
                    return
                wire = wire[-TAIL:]
            conn.send(MsgType.DATA, wire, deadline=self.deadline)
            if j == P - 1 and self.ledger is not None:  # and our signature that it passed (relay.py)
                conn.send(MsgType.DATA, self.passes[self.rank], deadline=self.deadline)
            self._sent(1, k)


    def _scatter_from(self, k: int) -> None:
        """Step 1 on link ``k``: its sender's own pieces of our segment, each checked and counted
        (:attr:`got`); on to the end even after the call failed elsewhere (see :meth:`fail`)."""
        conn, o, me, led = self.links.inn[k], peer_of(self.rank, self.world, k), self.rank, self.ledger
        for j in range(self.plan.pieces):
            a, b = self.plan.piece(me, j)
            wire = self._recv(conn, b - a)
            sig = self.their_signature(conn)
            if led is not None and not led.received(j, o, wire, sig) or led is None and self.signed and \
                    not self.mseal.verify(o, me, j, b - a, wire, sig):  # type: ignore[union-attr,arg-type]
                self.ws.release(wire)  # (with the relay: left out from here on, if no more than a minority is)
                with self.cond:
                    out = self.mesh.relaying and self._within_cap([o])
                    if out:
                        self._leave_out(o, j)
                if not out:
                    raise FrameError(f"rank {o}: the signature of its own piece {j} of segment {me} does not verify")
                continue
            with self.cond:
                self.got[o] += 1
                self.mesh.piece_came(o)
                late = self.error is not None  # nobody aggregates it: counted, not kept
                early = not late and self.index > self.mesh.current + 1
                if early:  # kept as it came (encoded), not as a float32 row, until the owner is nearer
                    self.early.append((j, o, wire, sig))
            if late:
                self.ws.release(wire)
            elif not early:
                self._take(o, j, wire, sig, k)

    def _take(self, o: int, j: int, wire: np.ndarray, sig: bytes | None, k: int) -> None:
        """Sender ``o``'s own piece ``j`` of our segment, its signature checked: decoded into its
        row, shown to ``inspect``, weighed, kept for the aggregation (on link ``k``'s thread while
        it is in cache; ``k`` -1: the owner's, for a piece that came early)."""
        me = self.rank
        a, b = self.plan.piece(me, j)
        with self.cond:
            late = self.left[o] <= j
        if late:  # left out already: no part of anything
            self.ws.release(wire)
            return
        keep = self.signed and o not in self.absent  # (weighed against the other rows once all are in)
        row = self._row(b - a)
        try:
            quant.decode(wire, b - a, self.mode, self.block, out=row)
        except ValueError as e:  # (a wrong length cannot arrive: recv_header checked it)
            row[...], why = np.nan, f"an undecodable payload ({e})"
        else:
            why = (SAT_OUT if row.any() else None) if o in self.absent else \
                self.inspect(row) if self.inspect is not None else None
        if why:
            self._found(o, why, me, j, b - a, wire, sig)
        if keep:
            self.norms[j][o] = row_norm(row, self.mesh.wide(k, b - a))
        with self.cond:
            late = self.left[o] <= j  # (left out while we decoded it)
            if not late:
                self.rows[j][o] = row
                if keep:
                    self.wires[j][o] = (wire, sig)
                self.cond.notify_all()
        if late:
            self.ws.release(row.base)
            self.ws.release(wire)
        elif not keep:
            self._keep_row(j, o, wire)

    def _gather_from(self, k: int) -> None:
        """Step 3 on link ``k``: the aggregates of its sender's segment, and when auditing its
        audit frames (:mod:`.audit_frames`) between them, every one before the last piece's tail."""
        conn, o, P, led = self.links.inn[k], peer_of(self.rank, self.world, k), self.plan.pieces, self.ledger
        if led is not None and o not in self.marked:  # its mark of this bucket's gather (see _gather_to)
            hdr = self._next(conn, o, MsgType.AUDIT)
            mark = bytearray(BUCKET_MARK.size)
            if hdr.length != len(mark):
                raise FrameError(f"rank {o}: a frame of {hdr.length} bytes where bucket {self.index}'s gather starts")
            conn.recv_payload_into(hdr, mark, deadline=self.deadline)
            magic, i = BUCKET_MARK.unpack(mark)
            if magic != MARK or i != self.index:
                raise FrameError(f"rank {o}: no mark of bucket {self.index}'s gather where it is due")
        frames = None if led is None else self._audit_in(o)
        want = None if frames is None else next(frames)  # the length of its next audit frame (None: all in)
        for j in range(P):
            a, b = self.plan.piece(o, j)
            wire = self._wire(b - a)
            try:
                want = self._aggregate_in(conn, o, j, wire, frames, want)
                wrong = led is not None and not led.got(o, j, wire)
            except BaseException:
                self.ws.release(wire)
                raise
            if want is _STOPPED:
                self.ws.release(wire)
                return
            if wrong:  # not the one it committed to: asked for by relay, and its link read on
                self.ws.release(wire)
                self.contradicted(o, [j])
                continue
            with self.placing[o]:
                with self.cond:
                    known = j in self.relayed[o]
                if not known:
                    self._place(a, b, wire)
                with self.cond:
                    self.via_link[o] = j + 1
                    if self.mesh.relaying and not known:
                        self.kept[(o, j)] = wire
                    self.cond.notify_all()
            if j == P - 1:
                self.mesh.poke.set()
            if not self.mesh.relaying or known:
                self.ws.release(wire)

    def _aggregate_in(self, conn, o: int, j: int, wire: np.ndarray, frames, want):  # noqa: ANN001, ANN202
        """Rank ``o``'s aggregate of piece ``j`` into ``wire``, with its audit frames before it
        (and, for the last piece, every one left before its tail): the length of its next audit
        frame, or :data:`_STOPPED` if the call failed meanwhile."""
        last = j == self.plan.pieces - 1 and self.ledger is not None
        body = wire[:-TAIL] if last else wire
        while True:  # its audit frames until its next aggregate
            if self.error is not None:
                return _STOPPED
            hdr = self._next(conn, o, MsgType.DATA if want is None else (MsgType.DATA, MsgType.AUDIT))
            if hdr.mtype == MsgType.DATA:
                break
            want = self._audit_read(conn, o, hdr, frames, want)  # type: ignore[arg-type]
        if hdr.length != body.nbytes:
            raise FrameError(f"rank {o}: an aggregate frame of {hdr.length} bytes, expected {body.nbytes}")
        conn.recv_payload_into(hdr, body, deadline=self.deadline)
        if last:  # every audit frame before the last bytes
            while want is not None:
                want = self._audit_read(conn, o, self._next(conn, o, MsgType.AUDIT), frames,
                                        want)  # type: ignore[arg-type]
            tail, end = self._next(conn, o, MsgType.DATA), wire[-TAIL:]  # (an empty piece's tail is empty)
            if tail.length != end.nbytes:
                raise FrameError(f"rank {o}: a tail of {tail.length} bytes, expected {end.nbytes}")
            conn.recv_payload_into(tail, end, deadline=self.deadline)
            sig = bytearray(SIG_BYTES)  # its signature that its audit passed (relay.py)
            self._signature_in(conn, o, sig)
            if not self.passed_by(o, bytes(sig)):
                raise FrameError(f"rank {o}: its signature that its audit passed does not verify")
            with self.cond:
                self.passes[o] = bytes(sig)
        return want

    def resync(self, k: int) -> int | None:
        """Link ``k`` went out of step in our gather (a frame out of place or of the wrong
        size): read past what is left of it to the mark of a later bucket's gather (every one
        starts with one), so that its owner's later buckets are read on; that bucket's index
        (None: none came in sight within what the buckets left can hold, or a frame that is no
        frame of ours, or the link stood still: the link then ends). From the start this bucket
        does without its owner's audit frames still due (:attr:`gone`), and so do the buckets
        skipped; their aggregates come by relay. A POST frame on the way is :class:`~.relay.Posted`."""
        conn, n, o = self.links.inn[k], len(self.mesh.buckets), peer_of(self.rank, self.world, k)
        with self.cond:
            self.gone.add(o)
            self.cond.notify_all()
        left = sum(b.most_from() for b in self.mesh.buckets[self.index:])  # (bytes it may still send us)
        try:
            if self.error is not None:
                return None
            conn.skip_unread(deadline=self.deadline)
            while True:
                hdr = conn.recv_header((MsgType.DATA, MsgType.AUDIT, MsgType.POST), deadline=self.deadline)
                if hdr.mtype == MsgType.POST:
                    raise Posted(hdr)
                left -= HEADER_LEN + hdr.length  # (empty frames too count: their headers)
                if left < 0:
                    return None
                if hdr.mtype == MsgType.AUDIT and hdr.length == BUCKET_MARK.size:
                    mark = bytearray(BUCKET_MARK.size)
                    conn.recv_payload_into(hdr, mark, deadline=self.deadline)
                    magic, j = BUCKET_MARK.unpack(mark)
                    if magic == MARK and self.index < j < n:
                        break
                conn.skip_unread(deadline=self.deadline)
        except (FrameError, PeerTimeout):
            return None
        with self.cond:
            for b in self.mesh.buckets[self.index + 1:j]:
                b.gone.add(o)
            self.mesh.buckets[j].marked.add(o)
            self.cond.notify_all()
        return j

    def most_from(self) -> int:
        """Bytes an owner may send us in this bucket's gather, at most (generously: its
        aggregates, and every audit frame with room to spare)."""
        P, W, (a, b) = self.plan.pieces, self.world, self.plan.piece(0, 0)
        head = P * DIGEST + 4 * W + DIGEST + SIG_BYTES  # (a commitment)
        agg = quant.encoded_nbytes(b - a, self.mode, self.block)  # (piece 0 is the largest)
        return 2 * (P * agg + W * 2 * head + P * W * ENTRY + 2 * W * (agg + SIG_BYTES) + 4 * W) + (1 << 16)

    def _signature_in(self, conn, o: int, buf: bytearray) -> None:  # noqa: ANN001
        hdr = self._next(conn, o, MsgType.DATA)
        if hdr.length != len(buf):
            raise FrameError(f"rank {o}: a signature frame of {hdr.length} bytes, expected {len(buf)}")
        conn.recv_payload_into(hdr, buf, deadline=self.deadline)

    def passed_by(self, o: int, sig: bytes) -> bool:
        """Whether ``sig`` is rank ``o``'s signature that its audit of this bucket passed."""
        c = self.ledger.ctx  # type: ignore[union-attr]
        return c.verify(o, passed(c.run_id, c.step, c.epoch, c.call, c.ids[o]), sig)

    def _next(self, conn, o: int, want: MsgType | tuple[MsgType, ...]):  # noqa: ANN001, ANN202
        """The next frame's header in the gather, of a type in ``want``: a POST frame instead
        means the sender gave up what it still owed us here (:class:`~.relay.Posted`: with
        audits a member that holds it relays it, without them the call fails); with audits an
        AUDIT frame where only aggregates are due (every audit frame of this bucket in) means it
        gave up the rest of this bucket's aggregates, and is its next bucket's first frame
        (:class:`~.relay.Skipped`: relayed likewise)."""
        want = want if isinstance(want, tuple) else (want,)
        hdr = self.pushed.pop(o, None)  # (read by its previous bucket's reader: see Skipped)
        if hdr is None:
            more = self.mesh.relaying and MsgType.AUDIT not in want and self.index + 1 < len(self.mesh.buckets)
            hdr = conn.recv_header((*want, MsgType.POST, *((MsgType.AUDIT,) if more else ())), deadline=self.deadline)
        if hdr.mtype == MsgType.POST:
            if not self.mesh.relaying:
                raise FrameError(f"rank {o} ended its gather before its aggregates were all out")
            raise Posted(hdr)
        if hdr.mtype not in want:  # its next bucket's audit frames: it gave up the rest of this one's aggregates
            raise Skipped(hdr)
        return hdr

    def _recv(self, conn, n: int) -> np.ndarray:  # noqa: ANN001
        """The next data frame of ``n`` values' payload, in a pooled buffer."""
        return self._into(conn, self._wire(n))

    def _into(self, conn, buf: np.ndarray) -> np.ndarray:  # noqa: ANN001
        """The next data frame, of exactly ``buf``'s size, into ``buf``."""
        hdr = conn.recv_header(MsgType.DATA, deadline=self.deadline, length=buf.nbytes)
        conn.recv_payload_into(hdr, buf, deadline=self.deadline)
        return buf

    @property
    def signed(self) -> bool:
        return self.mseal is not None

    def _found(self, sender: int, why: str, seg: int, j: int, n: int, wire: np.ndarray, sig: bytes | None) -> None:
        """Keep sender's bad piece (its first) as evidence, its signature checked (as it arrived,
        but for an answer to our audit: here)."""
        with self.cond:
            if any(s == sender for s, _ in self.findings):
                return
        payload = wire.tobytes()
        if self.mseal is not None and not self.mseal.verify(sender, seg, j, n, payload, sig):  # type: ignore[arg-type]
            raise FrameError(f"rank {sender}: its own piece {j} of segment {seg} has {why}, and its signature "
                             "does not verify")
        with self.cond:  # (the owner's thread and a link's may find one sender's pieces at once: the first stays)
            if not any(s == sender for s, _ in self.findings):
                self.findings.append((sender, Finding(why, seg, j, n, payload, sig)))



def butterfly_all_reduce(links: Links, xs: Sequence[Vector], rank: int, world: int, *, mode: str, block: int,
                         piece_numel: int, deadline: float, how: str = "mean",
                         outs: Sequence[Vector | None] | None = None, inspect: Inspect | None = None,
                         findings: list[tuple[int, int, Finding]] | None = None,
                         seals: Sequence[MeshSeal | None] | None = None, workspace: Workspace | None = None,
                         absent: frozenset[int] = frozenset(), auditings: Sequence[Auditing | None] | None = None,
                         verdicts: list[tuple[int, str, Case]] | None = None,
                         gaps: list[int] | None = None, weighing: Weighing | None = None,
                         shut: list[int] | None = None, probation: frozenset[int] = frozenset(),
                         left: list[int] | None = None, quiet: list[int] | None = None) -> list[Vector]:
    """Robust mean (``how``: a :mod:`.robust` aggregator) of each bucket ``xs[i]`` (flat
    float32, not empty; an array or a :class:`~.tree.Flat` of several) over the mesh ``links``, bit-identical on every rank, in one call: every
    bucket's step 1 before any bucket's step 3. Results go to ``outs[i]`` where given.
    ``inspect(theirs)`` is shown every other member's own piece of our segment; the first bad one
    of each sender in each bucket goes to ``findings`` as (bucket, sender rank, :class:`Finding`).
    ``seals[i]``: sign our pieces of bucket ``i``, check a bad one's signature. ``absent``: the
    ranks sitting the round out, whose rows must be zeros and are left out. ``auditings[i]``
    (needs a seal): owners commit to their aggregates of bucket ``i`` and every rank audits one
    (:mod:`.audit`); a member our audit shows at fault goes to ``verdicts`` as (rank, why,
    case). When the call fails, ``gaps`` gets the ranks whose own pieces of our segment did not
    all reach us, in any bucket (links in ``links`` may be :class:`~.mesh.DeadLink`: their
    threads fail at once). When it succeeds with seals, what weighing the rows of our segment
    against each other found (:func:`~.evidence.outsized`) is added to ``weighing``. With audits
    an owner's aggregates that do not reach us on its link are relayed by a member that holds them
    (:mod:`.relay`); ``shut`` gets the ranks whose links a call that succeeded had to shut (the
    links are then no use for another call), and ``left`` the ranks whose rows of our segment it
    left out. When it fails, ``quiet`` gets those of ``gaps`` whose links brought no whole piece
    long enough, unpaced (:meth:`~.mesh_call.MeshCall.quiet`). ``probation``: senders that were so in an
    earlier failed call (``SocketCommunicator._on_probation``): with audits their missing rows
    get the shortest grace, and their audit frames are done without once they are left out and
    quiet."""
    if mode not in RING_MODES:
        raise ValueError(f"the butterfly exchange takes {', '.join(RING_MODES)}, not {mode}")
    robust.check_mode(how)
    n = len(xs)
    outs = [None] * n if outs is None else list(outs)
    seals = [None] * n if seals is None else list(seals)
    auditings = [None] * n if auditings is None else list(auditings)
    if not len(outs) == len(seals) == len(auditings) == n:
        raise ValueError(f"{n} buckets need as many outs, seals and auditings")
    for i, (x, o) in enumerate(zip(xs, outs)):
        outs[i] = o = np.empty(x.shape[0], np.float32) if o is None else o
        if x.ndim != 1 or not x.shape[0] or o.shape != x.shape or o.dtype != np.float32:
            raise ValueError(f"bucket {i}: out must be float32 of shape {x.shape}, and the input flat and not empty")
    if overlaps(outs, xs):  # (an aggregate is written while later buckets' pieces still go out)
        raise ValueError("the outs must lie apart from every bucket's input")
    if world == 1:
        for x, o in zip(xs, outs):
            if isinstance(o, Flat):
                o.put(0, np.zeros(x.shape[0], np.float32) if absent else x[0:x.shape[0]])
            else:
                o[...] = 0 if absent else x[0:x.shape[0]]
        return outs  # type: ignore[return-value]
    if len(links.out) != world - 1 or len(links.inn) != world - 1:
        raise ValueError(f"a butterfly of {world} needs {world - 1} links each way, not {len(links.out)}")
    mesh = MeshCall(links, rank, world, deadline, relaying=all(a is not None for a in auditings),
                    probation=probation)
    ws = workspace or Workspace()
    for x, o, seal, auditing in zip(xs, outs, seals, auditings):
        mesh.buckets.append(_ButterflyRun(mesh, x, o, mode, block, piece_numel, how, inspect,  # type: ignore[arg-type]
                                          seal, ws, frozenset(absent), auditing))
    try:
        mesh.run()
        if shut is not None:
            shut.extend(peer_of(rank, world, k) for k in mesh.shut)
        if left is not None:
            left.extend(sorted(i for i, first in mesh.left_out.items() if first < len(mesh.buckets)))
        return outs  # type: ignore[return-value]
    finally:
        for i, b in enumerate(mesh.buckets):
            if findings is not None:
                findings.extend((i, r, f) for r, f in b.findings)
            if verdicts is not None and b.verdict is not None:
                verdicts.append(b.verdict)
            if weighing is not None and mesh.error is None:
                b.weigh_into(weighing, i)
        if gaps is not None and mesh.error is not None:
            gaps.extend(mesh.gaps())
        if quiet is not None and mesh.error is not None:
            quiet.extend(mesh.quiet())
