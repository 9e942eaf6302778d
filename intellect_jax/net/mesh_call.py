"""One butterfly call's threads over the mesh (:mod:`.butterfly`): the order of its steps on
every link, and its pacing.

A call reduces every bucket of the tree, and each link carries every bucket's step 1 (our own
pieces, signed, to the owner at its other end) before any bucket's step 3 (the aggregates, with
the audit frames between them): what an honest rank sends in step 1 depends on nobody, so what
an owner lacks when a call fails names its senders whatever failed elsewhere. The first error,
each link's progress (counted over all buckets) and its pacing are the call's; everything else
is a bucket's (``butterfly._ButterflyRun``, whose step methods the threads call by name).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from intellect_jax.net.errors import AuditFrameError, FrameError, NetError, PeerTimeout
from intellect_jax.net.mesh import DeadLink, Pending
from intellect_jax.net.relay import Posted, Relay, Skipped
from intellect_jax.net.ring import Links, Pipeline

ROW_WAIT = 1.0  # share of the call's time until all but a minority of a piece's rows were in, that the rest get
ROW_WAIT_MIN = 1.0  # seconds (a row deadline too near would leave out honest rows that a busy link delays)
ROW_IDLE = 1.0  # seconds, at least, without a frame from a sender before its missing rows may be left out (_rows_in)
ROW_LOOK = 0.25  # seconds between looks at the links' bytes while rows are waited for
WINDOW = 2  # pieces a link may run ahead of the slowest link (docs/results.md)
PACE_HOLD = 0.5  # seconds a link waits before the slowest counts as stuck (a peer that does not read)


class MeshCall(Relay, Pipeline):
    """One butterfly call over the mesh ``links``: what its buckets (:class:`~.butterfly._ButterflyRun`, one
    per flat vector) share. Its threads carry every bucket's step 1 on each link before any
    bucket's step 3, so what an honest rank sends in step 1 depends on nobody; the first error,
    each link's progress and its pacing are the call's, counted over all its buckets."""

    name = "butterfly"

    def __init__(self, links: Links, rank: int, world: int, deadline: float, relaying: bool = False,
                 probation: frozenset[int] = frozenset()) -> None:
        super().__init__(links, deadline)
        self.rank, self.world = rank, world
        self.probation = probation  # senders whose pieces did not all reach us in an earlier failed call
        # sender -> when its link to us closed (or was reset) in step 1 before the deadline
        self.closed: dict[int, float] = {}
        self.pieces_at: dict[int, tuple[float, float]] = {}  # sender -> when its first, last piece came, verified
        self.unheard: set[int] = set()  # senders we left out before any piece of theirs had come
        self._init_relay(relaying)
        self.buckets: list[Any] = []  # (each a butterfly._ButterflyRun)
        self.sent = [[0] * (world - 1), [0] * (world - 1)]  # pieces sent on each link in step 1 and 3
        self.stuck: list[set[int]] = [set(), set()]  # links left out of the pacing (per step): they did not move
        self.moved = [time.monotonic()] * (world - 1)  # when step 1 last moved on each link (see _after_step1)
        self.unpaced = (time.monotonic() + deadline) / 2  # from then on step 1 goes unpaced (see _pace)
        self.over = [[False] * (world - 1), [False] * (world - 1)]  # step 1 over on each out and inn link
        self.current = 0  # the bucket the owner aggregates (receivers decode its pieces and the next bucket's)
        self._wide = [np.empty(0, np.float64) for _ in range(world)]  # row_norm scratch: each link's, the owner's
        # sender -> the first bucket we left its rows out of (butterfly._rows_in; the buckets' count: none,
        # its link ended in step 1 with every row of it in: left_behind)
        self.left_out: dict[int, int] = {}
        self._heard: dict[int, tuple[int, float]] = {}  # link -> (bytes it had brought us, when we saw it move)

    def encoder(self) -> None:
        """Every bucket's owner in turn (:meth:`~.butterfly._ButterflyRun.encoder`)."""
        for i, b in enumerate(self.buckets):
            with self.cond:
                self.current = i
            b.encoder()
            if self.error is not None:
                return

    def heard_from(self, q: int, now: float) -> float:
        """(Under ``cond``.) When the link from rank ``q`` last brought us a frame, as far as
        we looked (a look that finds it moved counts as then; the first look too)."""
        k = (q - self.rank - 1) % self.world
        n = self.links.inn[k].bytes_received
        seen = self._heard.get(k)
        if seen is None or seen[0] != n:
            seen = self._heard[k] = (n, now)
        return seen[1]

    def idle(self, q: int, now: float, least: float = 0.0) -> bool:
        """(Under ``cond``.) Whether nothing has come from rank ``q`` for ``ROW_IDLE`` (and
        ``least`` seconds)."""
        return now - self.heard_from(q, now) >= max(ROW_IDLE, least)

    def row_grace(self, since: float, senders: Sequence[int] = ()) -> float:
        """Seconds the rows still missing of a piece, from ``senders``, get, counted from
        ``since`` (when all but a minority of them were in): ``ROW_WAIT`` of the call's time
        until then, at least ``ROW_WAIT_MIN``, at most half the time left; only
        ``ROW_WAIT_MIN`` when every one of them is on probation (:attr:`probation`)."""
        wait = ROW_WAIT_MIN if senders and set(senders) <= self.probation else ROW_WAIT * (since - self.t0)
        return min(max(ROW_WAIT_MIN, wait), (self.deadline - since) / 2)

    def wide(self, k: int, n: int) -> np.ndarray:
        """Float64 scratch of at least ``n`` values for link ``k``'s thread (-1: the owner's)."""
        if self._wide[k].shape[0] < n:
            self._wide[k] = np.empty(n, np.float64)
        return self._wide[k]

    def sender(self, k: int) -> None:
        """To the owner of segment ``o``: our own pieces of it in every bucket, signed; then each
        bucket's aggregates, and when auditing, between them, its audit frames
        (:mod:`.audit_frames`: commitment, nonce, row lists, challenge, answer, echo, request
        for rows, rows supplied; the last
        piece's tail waits for our own audit: without it nobody completes)."""
        self._link(0, k, "_scatter_to", "_gather_to")

    def receiver(self, k: int) -> None:
        """From rank ``o``: its own pieces of our segment in every bucket; then each bucket's
        aggregates of segment ``o``, and when auditing, between them, its audit frames."""
        self._link(1, k, "_scatter_from", "_gather_from")

    def _link(self, side: int, k: int, step1: str, step3: str) -> None:
        """Link ``k``'s step 1 in every bucket, to its end whatever fails elsewhere, then every
        bucket's step 3 unless the call failed meanwhile, or its sender was left behind in step 1
        (:meth:`left_behind`: the link then ends; ``side`` 0: our link to its owner, 1: its
        sender's to us)."""
        i = 0
        try:
            for i, b in enumerate(self.buckets):
                getattr(b, step1)(k)
        except (NetError, OSError) as e:
            if side == 1 and isinstance(e, ConnectionError) and time.monotonic() < self.deadline:
                with self.cond:  # (we shut a link still in step 1 only at the deadline: its sender closed it)
                    self.closed.setdefault(self._peer(k), time.monotonic())
            if side == 0 or not self.left_behind(k, i, e):
                raise
            left = e  # (its sender is left out for the rest of the call: what it still owes us comes by relay)
        else:
            left = None
        finally:
            going = self._over(side, k)
        if left is not None:  # (no doom: an honest rank needs nothing of it that cannot come otherwise)
            self.lost(side, k, left, doom=False)
            return
        posted = None
        try:
            i = 0
            while going and i < len(self.buckets):
                b = self.buckets[i]
                try:
                    getattr(b, step3)(k)
                except Skipped as s:  # its owner gave up the rest of this bucket's aggregates on this link
                    self.lost(side, k, None, skipped=True)
                    self.buckets[i + 1].pushed[self._peer(k)] = s.hdr  # (raised only before a next bucket)
                except FrameError as e:  # out of step: read on from a later bucket's mark, if one comes
                    j = None if side == 0 or i + 1 == len(self.buckets) or not self.local(e) else b.resync(k)
                    if j is None:
                        raise
                    self.lost(side, k, e, skipped=True)  # (what it owed us before that mark: by relay, in time)
                    i = j
                    continue
                if self.error is not None:
                    return
                i += 1
        except Posted as p:  # its owner gave its aggregates up on this link: ask a member that holds them
            posted = p.hdr
            self.lost(side, k, None)
        except (NetError, OSError) as e:
            if not self.local(e):
                raise
            self.lost(side, k, e)
            return
        if side == 1:
            self.gathered_from(k)
        if going and self.error is None and self.relaying:  # the call's end on this link (relay.py)
            self.post_out(k) if side == 0 else self.post_in(k, posted)
        elif going and self.error is None:  # (without audits nothing can be relayed: no POST frames)
            with self.cond:
                self.ended[side][k] = True
                self.cond.notify_all()
            self.poke.set()

    def left_behind(self, k: int, i: int, e: BaseException) -> bool:
        """Link ``k`` from its sender failed in step 1, in bucket ``i``: whether its sender is
        left out of our segment for the rest of the call instead of the call failing (with the
        relay, for a link that stood still or went out of step before the deadline, if no more
        than a minority of the contributors is left out: ``_ButterflyRun._rows_in``). It is
        left out from its first row not yet decoded for the aggregation (rows of a later bucket
        that wait encoded for its turn are dropped too). A connection closed or
        reset still fails the call at once (an honest rank that fails keeps its links open
        through step 1: a node that went down), and so does a link that never opened
        (:class:`~.mesh.DeadLink`: most often a node down before the call, which nothing could
        relay; leaving it out would only make the call fail later)."""
        link = self.links.inn[k]
        if not self.relaying or not isinstance(e, (PeerTimeout, FrameError)) or isinstance(e, AuditFrameError) or \
                isinstance(link.get() if isinstance(link, Pending) else link, DeadLink) or \
                time.monotonic() >= self.deadline:
            return False
        o = self._peer(k)
        with self.cond:
            for b in self.buckets[i:]:
                j = next((j for j in range(b.plan.pieces) if b.agg[j] is None and b.rows[j][o] is None), None)
                if j is None or b.left[o] <= j:
                    continue
                if not b._within_cap([o]):
                    return False
                b._leave_out(o, j)
                break
            self.left_out.setdefault(o, len(self.buckets))  # (none of its rows missing: nothing to leave out)
            self.cond.notify_all()
        return True

    def _after_step1(self) -> bool:
        """Hold step 3 until our step 1 is over on every link that still moves (one that has not
        moved for ``PACE_HOLD`` holds nobody; False: the call failed meanwhile). Our own pieces
        go first: every owner then has its rows, aggregates and commits sooner, so the audits'
        round trips run while our aggregates still go out instead of after them; the bytes on
        our uplink, and so its busy time, are the same either way (docs/results.md)."""
        with self.cond:
            while True:
                if self.error is not None:
                    return False
                now = time.monotonic()
                going = [t for i, t in enumerate(self.moved) if not self.over[0][i] and now - t < PACE_HOLD]
                if not going:
                    return True
                self.cond.wait(max(0.001, min(going) + PACE_HOLD - now), until=lambda: self.error is not None or all(
                    self.over[0][i] or time.monotonic() - t >= PACE_HOLD for i, t in enumerate(self.moved)))

    def _pace(self, phase: int, k: int, j: int) -> bool:
        """Hold link ``k`` before piece ``j`` of ``phase`` while it is ``WINDOW`` pieces ahead of
        the slowest link (False: the call failed meanwhile). TCP shares our uplink unevenly
        among the links; unpaced, an owner's last rows come from its slowest sender long after
        the others, and our uplink idles while we wait for them. A link that has not moved for
        ``PACE_HOLD`` holds nobody: a peer that does not read blocks no other link. (One that
        reads slowly does set the pace, as it would by sending slowly: leaving lagging links out
        of the pacing measured slower, 1.12-1.20x the ring's time, docs/results.md.) Step 1 goes
        unpaced after half the call's time: a peer that reads just fast enough not to count as
        stuck must not hold our own pieces back from the other owners until the deadline, where
        they would name us as a withholder."""
        sent, until = self.sent[phase], time.monotonic() + PACE_HOLD
        with self.cond:
            while j - self._base(phase, j) >= WINDOW:
                if self.error is not None:
                    return False
                now = time.monotonic()
                if phase == 0 and now >= self.unpaced:
                    break
                left = until - now
                if left <= 0:  # the slowest link has not moved: a peer that does not read holds nobody back
                    self.stuck[phase].add(min((i for i in range(len(sent)) if i not in self.stuck[phase]),
                                              key=sent.__getitem__))
                    until = time.monotonic() + PACE_HOLD
                    continue
                self.cond.wait(min(left, 1.0, self.unpaced - now if phase == 0 else 1.0),
                               until=lambda: self.error is not None or j - self._base(phase, j) < WINDOW)
            return self.error is None

    def _base(self, phase: int, j: int) -> int:
        """The progress a link is paced against: the slowest link's, stuck ones left out."""
        return min((n for i, n in enumerate(self.sent[phase]) if i not in self.stuck[phase]), default=j)

    def _sent(self, phase: int, k: int) -> None:
        with self.cond:
            self.sent[phase][k] += 1
            if phase == 0:
                self.moved[k] = time.monotonic()
            self.stuck[phase].discard(k)  # it moved: it paces the others again
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Keep the first error and shut every link whose step 1 is over (every link, once past
        the deadline). A link still in step 1 goes on to its end: a failure on one link stops
        nobody's own pieces on the others, so what each owner lacks at the end (:meth:`gaps`)
        is what its senders withheld, not the echo of a failure elsewhere. Once we hold the
        whole result nothing fails the call (a link that fails then only ends)."""
        self.poke.set()
        with self.cond:
            if self.whole_at is not None:
                return
            if self.error is None:
                self.error = exc
            self.cond.notify_all()
            late = time.monotonic() >= self.deadline
            done = [c for side, conns in enumerate((self.links.out, self.links.inn)) for k, c in enumerate(conns)
                    if late or self.over[side][k]]
        for c in done:
            c.abort()

    def _over(self, side: int, k: int) -> bool:
        """Step 1 is over on link ``k`` (``side`` 0: ours to its owner, 1: its sender's to us);
        False, with the link shut, if the call failed meanwhile."""
        with self.cond:
            self.over[side][k] = True
            failed = self.error is not None
            self.cond.notify_all()  # (step 3 may wait for it: _after_step1)
        if failed:
            (self.links.out, self.links.inn)[side][k].abort()
        return not failed

    def gaps(self) -> list[int]:
        """The ranks whose own pieces of our segment, in any bucket, did not all reach us."""
        return [o for o in range(self.world) if o != self.rank
                and any(b.got[o] < b.plan.pieces for b in self.buckets)]

    def piece_came(self, q: int) -> None:
        """(Under ``cond``.) A piece of sender ``q``'s (any bucket's) came whole, its signature checked."""
        now = time.monotonic()
        self.pieces_at[q] = (self.pieces_at.get(q, (now, now))[0], now)

    def quiet(self) -> list[int]:
        """(After the call.) Those of :meth:`gaps` that sent us a piece and then no other (a
        frame header alone, or a piece whose signature does not verify, is no progress: found
        by review) until the call's end or until their sender closed or reset the link in step
        1, for half the call's time (``ROW_IDLE`` at least), and for a quarter of it after the
        latest time their step 1 can have been paced (:meth:`_pace`: half the call from their
        own start, which came before their link to us opened with their header, and before
        their first piece). Before that, colluders that take turns reading a member's pieces
        can hold all its links still a while, then have it aborted from outside (it shuts its
        links at once), and a member that started late is paced late (both found by review);
        after it, an honest member's links move until its pieces are out. So a quiet member
        whose own deadline shuts its link a moment before ours is quiet, one aborted early is
        not, nor one whose link opened late (a quarter of the call or more): it cannot be told
        from a late starter (``unheard`` then spares us its audit frames if it brought no piece
        before we left it out). A link that never opened is no quiet one: its member came late."""
        now, span = time.monotonic(), self.deadline - self.t0
        with self.cond:
            return [q for q in self.gaps() if q in self.pieces_at and self._still(q, self.closed.get(q, now), span)]

    def _still(self, q: int, end: float, span: float) -> bool:
        last, paced = self.pieces_at[q][1], self.unpaced_by(q)
        return paced is not None and end - last >= max(ROW_IDLE, (end - self.t0) / 2) and \
            end - max(last, paced) >= span / 4

    def unpaced_by(self, q: int) -> float | None:
        """(Under ``cond``.) The latest time sender ``q``'s step 1 can have gone unpaced
        (:meth:`_pace`: half the call from its own start, which came before its link to us
        opened with its header and before its first piece); None before either."""
        opened = getattr(self.links.inn[(q - self.rank - 1) % self.world], "opened_at", None)
        seen = [t for t in (opened, self.pieces_at.get(q, (None,))[0]) if t is not None]
        return min(seen) + (self.deadline - self.t0) / 2 if seen else None

    def unheard_still(self, q: int, now: float) -> bool:
        """(Under ``cond``.) Whether sender ``q`` was left out before any piece of it had come
        (:attr:`unheard`), its step 1 on our link is not over, and it has gone unpaced
        (:meth:`unpaced_by`): then an honest member's pieces move until they are out, and its
        audit frames come after them. Before that a big first frame in flight, or a late start,
        can leave an honest member out unheard (found by review), and its echo, which shows an
        owner splitting it off, must not be done without."""
        paced = self.unpaced_by(q)
        return q in self.unheard and not self.over[1][(q - self.rank - 1) % self.world] and \
            paced is not None and now >= paced

    def run(self) -> None:
        """Every thread of the call, until we hold the whole result and every link has ended
        (:meth:`~.relay.Relay.steer`), or the first error, or the deadline; the links of peers
        we gave up on are then shut (:attr:`shut`)."""
        self.spawn(self.encoder, self.sender, self.receiver, self._until_done)
        for b in self.buckets:  # (after a failure nothing goes back to the pool: a thread may still hold it)
            b.release()

    def _until_done(self) -> None:
        self.steer()
        with self.cond:
            self.leaving = True  # (every link's POST loop ends)
            self.cond.notify_all()
        if self.whole_at is None:
            self.fail(self.error or PeerTimeout(f"{self.name}: did not finish before its deadline"))
            return
        # the links that did not end cleanly (given up on, failed, or at the deadline) are shut
        self.shut = sorted({k for k in range(self.world - 1) if not (self.ended[0][k] and self.ended[1][k])}
                           | self.dirty)
        for k in self.shut:
            self.links.out[k].abort()
            self.links.inn[k].abort()
