"""The end of a butterfly call (:mod:`.butterfly`): a rank that lacks an owner's aggregates gets
them from a rank that holds them, and every link closes cleanly.

An owner that withholds its aggregates (or its last piece's tail) from some members, or sends
them frames out of place, left those members unable to complete: the others completed, and
they were removed as behind. But every member that completed holds every owner's aggregates,
as the owner sent them, and every member holds each owner's commitment to them (:mod:`.audit`:
the digest of each piece's aggregate, under the owner's signature). So a member's missing
pieces can come from any member that completed, and the asker places a relayed piece only if
it is the one the owner committed to, and an owner's last piece only with the owner's
signature that its own audit passed (:func:`~.audit.passed`, which follows its tail): a
relayer can neither alter nor invent a piece, nor complete anyone before every audit passed.

After its gather each link carries :attr:`~.frames.MsgType.POST` frames, in this order:

* ``ASK`` (bucket, owner, first piece), to a rank that said ``DONE``: relay that owner's
  aggregates of that bucket from that piece on. A rank asks once an owner's aggregates have not
  all come a while (:data:`WAIT` of the time the call took until a first peer said ``DONE``, at
  least :data:`WAIT_MIN`) after a first peer said ``DONE``, or at once when the owner's own
  link gave them up (a ``POST`` frame in their place; its next bucket's first audit frame:
  :class:`Skipped`; or aggregates other than it committed to: ``_ButterflyRun.contradicted``;
  the last two read on); one ``DONE`` peer per owner at a time,
  another :data:`WAIT_MIN` later while pieces are missing.
* ``DONE``: the sender holds the whole result (every bucket's every piece, each checked against
  its owner's commitment) and its own audit passed: it asks for nothing more.
* ``RELAY`` (bucket, owner, piece), then that piece's aggregate in a ``DATA`` frame, as the
  relayer holds it (the last piece: then the owner's signature that its audit passed); only to
  a rank that asked, each owner of each bucket once.
* ``END``: nothing more from the sender in this call (after the peer's ``DONE``, and what it
  asked for): the link is clean for a next call.

A frame out of place on an owner's link in the gather ends that link only (:meth:`Relay.local`;
in a bucket but the last it is read on from a later bucket's mark: ``_ButterflyRun.resync``);
a connection closed or reset still fails the call at once, since that is how a failing rank
tells its neighbours. A rank returns once it holds the whole result and every link has ended
both ways, or once it has waited :data:`LINGER` of the call's time (at least
:data:`LINGER_MIN`), plus :data:`WAIT_MIN` for each other member an asker may try first, past
its completion for peers whose links have not moved for that long (a peer that reads nothing,
or never says ``DONE``). Those links are shut: the call succeeded, but
its ring needs new links for another call. Without audits nothing can be checked, so nothing
is relayed and no POST frames are sent. A rank keeps every aggregate it received until its call
returns (``1/N`` of the encoded vector for each owner), so that it can relay it.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

import numpy as np

from intellect_jax.net import quant
from intellect_jax.net.errors import AuditFrameError, FrameError, NetError, RingClosed
from intellect_jax.net.evidence import SIG_BYTES
from intellect_jax.net.frames import MsgType

DONE, ASK, RELAY, END = b"D", b"A", b"R", b"E"
_PLACE = struct.Struct("<III")  # bucket, owner, piece (ASK: the first one asked for)
POST_MAX = 1 + _PLACE.size  # bytes of a POST frame's payload at most
WAIT = 0.25  # share of the call's time until a first DONE that a missing aggregate gets before we ask
WAIT_MIN = 0.5  # seconds (an early DONE, true or not, does not make us ask every peer at once)
LINGER = 0.5  # share of the call's time until our completion that we wait for a peer whose links stand still
LINGER_MIN = 1.0  # seconds
POLL = 0.01  # seconds between the main thread's looks when nothing pokes it (see Relay.steer)


class Posted(Exception):
    """A POST frame where an owner's aggregate or audit frame was due: it gave them up on this link."""

    def __init__(self, hdr: Any) -> None:
        super().__init__("a POST frame in the gather")
        self.hdr = hdr


class Skipped(Exception):
    """An AUDIT frame where an owner's aggregates (or its tail, or its signature that its audit
    passed) of a bucket were due, with every audit frame of that bucket in: the owner gave up the
    rest of that bucket's aggregates on this link, and the frame is its next bucket's first (the
    mark every bucket's gather starts with: ``butterfly.BUCKET_MARK``)."""

    def __init__(self, hdr: Any) -> None:
        super().__init__("an audit frame of the next bucket in the gather")
        self.hdr = hdr


class Relay:
    """The post-gather phase of a :class:`~.mesh_call.MeshCall` (a mixin): its frames on each
    link, the asks, and when the call may return (see the module docstring)."""

    rank: int
    world: int
    deadline: float
    buckets: list[Any]
    links: Any
    cond: Any
    error: BaseException | None

    def _init_relay(self, relaying: bool) -> None:
        n = self.world - 1
        self.relaying = relaying
        self.t0 = time.monotonic()
        self.whole_at: float | None = None  # when we held the whole result
        self.first_done: float | None = None  # when a first peer said DONE
        self.done_from = [False] * n  # peer k said DONE
        self.said_done = [False] * n  # we said DONE to peer k
        self.ended = [[False] * n, [False] * n]  # our link to / from peer k is over (END, or broken)
        self.asks: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # ASKs to send to peer k
        self.jobs: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # what peer k asked us to relay
        self.served: list[set[tuple[int, int]]] = [set() for _ in range(n)]  # (bucket, owner) peer k asked for
        self.asked: dict[tuple[int, int], float] = {}  # (bucket, owner) -> when we last asked for it
        self.asked_of: list[set[tuple[int, int]]] = [set() for _ in range(n)]  # (bucket, owner) we asked peer k for
        self.got_relays: set[tuple[int, int, int, int]] = set()  # (bucket, owner, piece, peer k) relayed to us
        # owner -> (when, why) its own link gave its aggregates up: a POST in their place or a skipped
        # bucket (why: None), a failure of that link in the gather (with audits only that link ends:
        # see local()), or aggregates other than committed on a link still read (see lost())
        self.gave_up: dict[int, tuple[float, BaseException | None]] = {}
        self.gathered: dict[int, float] = {}  # peer k -> when its link's gather ended (its last bucket read)
        self.mute: set[int] = set()  # owners whose links to us carry no more audit frames (POST, or a failure)
        self.moving = [(0, time.monotonic())] * n  # per peer: (bytes both ways, when they last changed)
        self.shut: list[int] = []  # peers whose links we shut at the end (not clean)
        self.dirty: set[int] = set()  # peers whose link failed in this phase (it may hold half a frame)
        self.leaving = False  # we are done with the call: every link's thread ends
        # what a member's own audit frame did not bring us (key -> when, the error it fails the call
        # with, whether another member has forwarded it since): see owe()
        self.owed: dict[Any, tuple[float, BaseException, Any]] = {}
        self.poke = threading.Event()  # something the main thread may act on happened (see steer)

    # -- the call's main thread ------------------------------------------------------------
    def steer(self) -> None:
        """Until the call may return (or fails, or its deadline): note when we hold the whole
        result, and ask for what is missing. It looks when poked (:attr:`poke`: a piece placed,
        a POST frame, a link's end) and every :data:`POLL` seconds, not at every notification of
        the call's condition (a wake-up per frame cost this thread's CPU on every call)."""
        while True:
            failure: BaseException | None = None
            with self.cond:
                if self.error is not None:
                    return
                now = time.monotonic()
                if now >= self.deadline:
                    return
                if self.links.aborted and self.whole_at is None:  # (from outside: a member is gone)
                    failure = RingClosed(f"{self.name}: aborted from outside")  # type: ignore[attr-defined]
                else:
                    failure = self._doomed(now)
                if failure is None:
                    if self.whole_at is None and all(b.whole() for b in self.buckets):
                        self.whole_at = now
                        self.cond.notify_all()
                    if self.whole_at is not None:
                        if self._may_leave(now):
                            return
                    elif self.relaying and self.first_done is not None:
                        self._ask(now)
            if failure is not None:
                self.fail(failure)  # type: ignore[attr-defined]
                return
            self.poke.wait(POLL if self.whole_at is None else 4 * POLL)
            self.poke.clear()

    def owe(self, key: Any, error: BaseException, got: Any) -> None:
        """A member's own audit frame (its commitment or nonce) did not hold: the call fails with
        ``error`` unless another member forwards one that does (``got()``, under ``cond``) within
        as long again as the call had taken (at least a second; see :meth:`_doomed`)."""
        with self.cond:
            self.owed.setdefault(key, (time.monotonic(), error, got))
        self.poke.set()

    def _doomed(self, now: float) -> BaseException | None:
        """The failure of an owner's link, once no peer has said DONE to us for as long again as
        the call had taken when it failed (at least a second): no member that could relay what
        we lack is in sight. For aggregates other than committed on a link still read, from when
        that link's gather ended (before, the peers that could relay them are still in their
        own gathers). Or a member's own audit frame that did not hold, once no other member has
        forwarded it for that long (:meth:`owe`)."""
        for key, (when, why, got) in list(self.owed.items()):
            if got():
                del self.owed[key]
            elif now - when >= max(1.0, when - self.t0):
                return why
        if self.whole_at is not None or self.first_done is not None:
            return None
        for p, (when, why) in self.gave_up.items():
            if why is None:
                continue
            k = (p - self.rank - 1) % self.world
            if not self.ended[1][k]:  # (still read on: see lost())
                if k not in self.gathered:
                    continue
                when = max(when, self.gathered[k])
            if now - when >= max(1.0, when - self.t0):
                return why
        return None

    def gathered_from(self, k: int) -> None:
        """Peer ``k``'s link has brought every bucket's gather (or gave the rest up)."""
        with self.cond:
            self.gathered.setdefault(k, time.monotonic())
        self.poke.set()

    def local(self, e: BaseException) -> bool:
        """Whether a failure in the gather ends that link only (with audits: what its owner still
        owed us a member that holds it relays, checked against its commitment), not the call: a
        frame out of place or of the wrong size. (Aggregates other than the committed ones do not
        even end the link: ``butterfly._ButterflyRun.contradicted``.)
        Not a connection closed or reset: a rank that fails shuts its links, and its neighbours
        must fail at once too (so an owner that shuts its link to one member still fails the
        call, as before); not an audit frame whose content does not hold (it names its sender
        at once), our own audit's verdict, or the deadline."""
        return self.relaying and isinstance(e, FrameError) and not isinstance(e, AuditFrameError) and \
            time.monotonic() < self.deadline

    def lost(self, side: int, k: int, e: BaseException | None, skipped: bool = False, doom: bool = True) -> None:
        """Link ``k`` from the peer ended its gather: ``e`` its failure (we read it no more), None
        a POST frame in place of what it still owed us (its POST frames are read on); or, with
        ``skipped``, it gave up some of one bucket's aggregates (or more buckets': read past to a
        later bucket's mark, ``_ButterflyRun.resync``) and is read on: the rest of them
        (``e`` None), or it sent others than it committed to (``e``: what dooms the call if no
        peer says DONE in time, as a failed link's error does; not with ``doom`` False: a sender
        left out of our segment, ``MeshCall.left_behind``; a call that lacks what it owed then
        fails at the deadline)."""
        with self.cond:
            p = self._peer(k)
            had = self.gave_up.get(p)
            if had is None or had[1] is None and e is not None and doom:  # (a failure after a skip: from then on)
                self.gave_up[p] = (time.monotonic(), e if doom else None)
            if not skipped:
                self.mute.add(p)
            if e is not None and not skipped:  # (what it sent after is not read: the link is shut at the end)
                self.ended[side][k] = True
                self.dirty.add(k)
            self.cond.notify_all()
        self.poke.set()

    def _peer(self, k: int) -> int:
        """The rank that mesh link ``k`` joins (``butterfly.peer_of``)."""
        return (self.rank + 1 + k) % self.world

    def _ask(self, now: float) -> None:
        wait = max(WAIT_MIN, WAIT * (self.first_done - self.t0))  # type: ignore[operator]  # (then WAIT_MIN a peer)
        done = [k for k in range(self.world - 1) if self.done_from[k] and not (self.ended[0][k] or self.ended[1][k])]
        for i, b in enumerate(self.buckets):
            for q in range(self.world):
                first = None if q == self.rank else b.unsettled(q)
                if first is None:
                    continue
                last = self.asked.get((i, q))  # (then another DONE peer, once it had its time)
                if last is not None and now - last < WAIT_MIN or \
                        last is None and q not in self.gave_up and now - self.first_done < wait:  # type: ignore[operator]
                    continue
                ks = [k for k in done if self._peer(k) != q and (i, q) not in self.asked_of[k]]
                if ks:
                    k = ks[0]
                    self.asks[k].append((i, q, first))
                    self.asked[(i, q)] = now
                    self.asked_of[k].add((i, q))
                    self.cond.notify_all()

    def _may_leave(self, now: float) -> bool:
        """Whether every link has ended both ways, or we may give up on those that have not."""
        # (long enough for an asker to have asked every other member in turn: peers that lie
        # about holding the result, asked first, cannot make the honest ones leave before their turn)
        linger = max(LINGER_MIN, LINGER * (self.whole_at - self.t0)) + (self.world - 2) * WAIT_MIN  # type: ignore[operator]
        left = []
        for k in range(self.world - 1):
            if self.ended[0][k] and self.ended[1][k]:
                continue
            moved = self.links.out[k].bytes_sent + self.links.inn[k].bytes_received
            if moved != self.moving[k][0]:
                self.moving[k] = (moved, now)
            left.append(k)
        if left and now - self.whole_at >= linger and all(now - self.moving[k][1] >= linger for k in left):  # type: ignore[operator]
            self.shut = left
            return True
        return not left

    # -- each link's thread, after its gather -------------------------------------------------
    def post_out(self, k: int) -> None:
        """Our POST frames to peer ``k`` (see the module docstring); a failure ends this link only."""
        conn = self.links.out[k]
        try:
            while True:
                with self.cond:
                    while True:
                        if self.error is not None or self.leaving or time.monotonic() >= self.deadline:
                            return
                        if self.asks[k] and self.whole_at is None:
                            what: tuple = ("ask", self.asks[k].pop(0))
                            break
                        if self.whole_at is not None and not self.said_done[k]:
                            what = ("done",)
                            break
                        if self.said_done[k] and self.jobs[k]:
                            what = ("job", self.jobs[k].pop(0))
                            break
                        if self.said_done[k] and (self.done_from[k] or self.ended[1][k]):  # (or it can ask no more)
                            what = ("end",)
                            break
                        self.cond.wait(max(0.001, min(1.0, self.deadline - time.monotonic())))
                if what[0] == "ask":
                    conn.send(MsgType.POST, ASK + _PLACE.pack(*what[1]), deadline=self.deadline)
                elif what[0] == "done":
                    conn.send(MsgType.POST, DONE, deadline=self.deadline)
                    with self.cond:
                        self.said_done[k] = True
                elif what[0] == "job":
                    self._serve(conn, *what[1])
                else:
                    conn.send(MsgType.POST, END, deadline=self.deadline)
                    return
        except (NetError, OSError):
            self._dirty(0, k)
        finally:
            with self.cond:
                self.ended[0][k] = True
                self.cond.notify_all()
            self.poke.set()

    def _serve(self, conn: Any, i: int, q: int, first: int) -> None:
        """Relay owner ``q``'s aggregates of bucket ``i`` from piece ``first`` on (those we hold)."""
        b = self.buckets[i]
        for j in range(first, b.plan.pieces):
            with self.cond:
                held = b.held(q, j)
            if held is not None:
                conn.send(MsgType.POST, RELAY + _PLACE.pack(i, q, j), deadline=self.deadline)
                conn.send(MsgType.DATA, held[0], deadline=self.deadline)
                if held[1] is not None:  # (the last piece: with the owner's signature that its audit passed)
                    conn.send(MsgType.DATA, held[1], deadline=self.deadline)

    def post_in(self, k: int, hdr: Any = None) -> None:
        """Peer ``k``'s POST frames (``hdr``: the first one's header, if the gather read it);
        a failure, or a malformed frame, ends this link only."""
        conn, p = self.links.inn[k], self._peer(k)
        try:
            while True:
                if hdr is None:
                    hdr = conn.recv_header(MsgType.POST, deadline=self.deadline, max_len=POST_MAX)
                if not 1 <= hdr.length <= POST_MAX:
                    raise FrameError(f"rank {p}: a POST frame of {hdr.length} bytes")
                buf = bytearray(hdr.length)
                conn.recv_payload_into(hdr, buf, deadline=self.deadline)
                hdr = None
                self.poke.set()
                kind, body = bytes(buf[:1]), bytes(buf[1:])
                if kind in (DONE, END) and not body:
                    with self.cond:
                        if kind == END and self.done_from[k]:
                            return
                        if self.done_from[k] or kind == END:
                            raise FrameError(f"rank {p}: {'a second DONE' if kind == DONE else 'END before DONE'}")
                        self.done_from[k] = True
                        if self.first_done is None:
                            self.first_done = time.monotonic()
                        self.cond.notify_all()
                elif kind in (ASK, RELAY) and len(body) == _PLACE.size:
                    i, q, j = _PLACE.unpack(body)
                    if not (i < len(self.buckets) and q < self.world and j < self.buckets[i].plan.pieces):
                        raise FrameError(f"rank {p}: a POST frame for piece {j} of owner {q} in bucket {i}")
                    if kind == ASK:
                        if self.done_from[k]:
                            raise FrameError(f"rank {p} asks after it said DONE")
                        self._asked_by(k, i, q, j)
                    else:
                        self._relayed(conn, k, p, i, q, j)
                else:
                    raise FrameError(f"rank {p}: a malformed POST frame")
        except (NetError, OSError):
            self._dirty(1, k)
        finally:
            with self.cond:
                self.ended[1][k] = True
                self.cond.notify_all()
            self.poke.set()

    def _dirty(self, side: int, k: int) -> None:
        """Link ``k`` failed in this phase: it may hold half a frame, so it is shut, and the ring
        with it once the call is over (a later call on it would misread what is left)."""
        with self.cond:
            self.dirty.add(k)
        (self.links.out, self.links.inn)[side][k].abort()

    def _asked_by(self, k: int, i: int, q: int, j: int) -> None:
        with self.cond:
            if (i, q) in self.served[k]:  # (each owner of each bucket once)
                raise FrameError(f"rank {self._peer(k)} asks again for owner {q}'s aggregates of bucket {i}")
            if self.relaying:
                self.served[k].add((i, q))
                self.jobs[k].append((i, q, j))
                self.cond.notify_all()

    def _relayed(self, conn: Any, k: int, p: int, i: int, q: int, j: int) -> None:
        b = self.buckets[i]
        if (i, q) not in self.asked_of[k] or q == self.rank or (i, q, j, k) in self.got_relays:
            raise FrameError(f"rank {p} relays what we did not ask it for")
        self.got_relays.add((i, q, j, k))
        lo, hi = b.plan.piece(q, j)
        n = quant.encoded_nbytes(hi - lo, b.mode, b.block)
        data = conn.recv_header(MsgType.DATA, deadline=self.deadline, length=n)
        wire = np.empty(n, np.uint8)
        conn.recv_payload_into(data, wire, deadline=self.deadline)
        sig = None
        if j == b.plan.pieces - 1:  # (the last piece comes with its owner's signature that its audit passed)
            hdr = conn.recv_header(MsgType.DATA, deadline=self.deadline, length=SIG_BYTES)
            buf = bytearray(SIG_BYTES)
            conn.recv_payload_into(hdr, buf, deadline=self.deadline)
            sig = bytes(buf)
        b.relayed_in(q, j, wire, sig)  # (placed only if it is the piece its owner committed to)
