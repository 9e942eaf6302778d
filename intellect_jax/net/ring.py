"""Pipelined ring all-reduce (mean) over authenticated connections.

Each rank holds ``streams`` connections to its successor and as many from its
predecessor. The ``(2*world - 2) * pieces`` messages of one all-reduce are dealt round
robin over the streams; per stream one sender thread and one receiver thread run, plus
one encoder thread for step 0. Receivers decode, accumulate in fp32 and re-encode (the
reduce-scatter), or decode into the output and hand the very same bytes on (the
all-gather); senders ship whatever is ready. numpy and hashlib release the GIL, so
encoding, hashing, sending and receiving overlap.

On any error (peer gone, stalled, garbage) the first exception is kept, every socket of
the ring is shut down so all threads stop (and neighbours notice at once), and the
exception is raised. The caller's input is only ever read.

With a :class:`Seal`, each of a rank's own pieces (step 0) is followed by a frame holding its
signature (:mod:`.evidence`); the successor shows every such piece to ``inspect`` and keeps a
bad one, with its signature checked, as a :class:`Finding`: evidence against its sender.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from intellect_jax.net import quant
from intellect_jax.net.errors import FrameError, NetError, PeerTimeout
from intellect_jax.net.evidence import SIG_BYTES
from intellect_jax.net.frames import MsgType
from intellect_jax.net.plan import RingPlan, finish, make_plan, piece_rng, rs_hop
from intellect_jax.net.transport import Connection
from intellect_jax.net.wakeup import Cond


@dataclass(frozen=True)
class Seal:
    """How one call signs this rank's own pieces and checks its predecessor's:
    ``sign(segment, piece, numel, payload) -> signature`` and ``verify(segment, piece, numel,
    payload, signature) -> bool``."""

    sign: Callable[[int, int, int, bytes], bytes]
    verify: Callable[[int, int, int, bytes, bytes], bool]


@dataclass(frozen=True)
class Finding:
    """A predecessor's own piece that ``inspect`` found bad, as it arrived (signature checked)."""

    why: str
    segment: int
    piece: int
    numel: int
    payload: bytes
    signature: bytes | None


@dataclass
class Links:
    """A rank's connections in one ring: ``out`` to the successor, ``inn`` from the predecessor."""

    out: list[Connection]
    inn: list[Connection]
    aborted: bool = False  # (abort() was called: from outside, the call in progress fails)

    def all(self) -> list[Connection]:
        """Every connection."""
        return [*self.out, *self.inn]

    def abort(self) -> None:
        """Shut every socket down (wakes blocked threads, tells the neighbours)."""
        self.aborted = True
        for c in self.all():
            c.abort()

    def close(self) -> None:
        """Close every socket."""
        for c in self.all():
            c.close()

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received so far over all connections."""
        return sum(c.bytes_sent for c in self.all()), sum(c.bytes_received for c in self.all())


class Workspace:
    """Buffers reused across pieces and calls: fresh pages cost page faults, which are slow."""

    def __init__(self, keep: int = 256) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._scratch: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._keep = keep

    def get(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of exactly ``nbytes`` (recycled when possible)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return np.empty(nbytes, np.uint8)

    def release(self, buf: np.ndarray) -> None:
        """Return a buffer from :meth:`get`."""
        with self._lock:
            free = self._free.setdefault(buf.nbytes, [])
            if len(free) < self._keep:
                free.append(buf)

    def scratch(self, name: str, n: int, dtype: type = np.float32) -> np.ndarray:
        """A per-name array of at least ``n`` elements (one user at a time)."""
        with self._lock:
            a = self._scratch.get(name)
            if a is None or a.shape[0] < n or a.dtype != dtype:
                a = self._scratch[name] = np.empty(n, dtype)
            return a


class Pipeline:
    """The threads of one collective over a ring's links (the ring all-reduce, the all-gather of
    :mod:`.gather`): numbered messages handed from producers to the stream senders (``put``,
    ``take``), the first error kept and every socket shut so all threads stop (``fail``), and
    one encoder, plus a sender and a receiver per stream, joined by the deadline (``spawn``)."""

    name = "ring"  # thread names and error messages
    seal: Seal | None = None  # signs our own pieces, checks the predecessor's

    def __init__(self, links: Links, deadline: float) -> None:
        self.links, self.deadline = links, deadline
        self.slots: dict[int, tuple] = {}
        self.cond = Cond()  # (waiters name what they wait for: net/wakeup.py)
        self.error: BaseException | None = None
        self.streams = len(links.out)

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            first = self.error is None
            if first:
                self.error = exc
            self.cond.notify_all()
        if first:
            self.links.abort()

    def put(self, m: int, *item: object) -> None:
        with self.cond:
            self.slots[m] = item
            self.cond.notify_all()

    def wait_for(self, ready: Callable[[], bool], what: str) -> bool:
        """Block until ``ready()`` (checked under ``cond``; False: the call failed meanwhile;
        :class:`PeerTimeout` at the deadline)."""
        with self.cond:
            while not ready():
                if self.error is not None:
                    return False
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(f"{self.name}: {what} not ready before the deadline")
                self.cond.wait(min(left, 1.0), until=lambda: self.error is not None or ready())
            return True

    def take(self, m: int) -> tuple | None:
        """Message ``m`` once produced (None: the call failed meanwhile)."""
        if not self.wait_for(lambda: m in self.slots, f"message {m}"):
            return None
        with self.cond:  # (one taker per message: it is still there)
            return self.slots.pop(m)

    @property
    def signed(self) -> bool:
        """Whether each sender's own pieces are followed by a signature frame."""
        return self.seal is not None

    def their_signature(self, conn: Connection) -> bytes | None:
        """The signature frame that follows a sender's own piece (None: nothing is signed)."""
        if not self.signed:
            return None
        hdr = conn.recv_header(MsgType.DATA, deadline=self.deadline, length=SIG_BYTES)
        buf = bytearray(SIG_BYTES)
        conn.recv_payload_into(hdr, buf, deadline=self.deadline)
        return bytes(buf)

    def guarded(self, fn: Callable[..., None], *args: object) -> Callable[[], None]:
        def body() -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - propagated to the caller by spawn()
                self.fail(e)
        return body

    def spawn(self, encoder: Callable[[], None], sender: Callable[[int], None],
              receiver: Callable[[int], None], meanwhile: Callable[[], None] | None = None) -> None:
        """Run the threads to their end or the deadline; raise the first error. ``meanwhile``
        runs on the calling thread once they have started (the butterfly's: until its call
        may return, shutting the links it gives up on)."""
        p = self.name
        threads = [threading.Thread(target=self.guarded(encoder), name=f"{p}-enc", daemon=True)]
        for k in range(self.streams):
            threads.append(threading.Thread(target=self.guarded(sender, k), name=f"{p}-tx{k}", daemon=True))
            threads.append(threading.Thread(target=self.guarded(receiver, k), name=f"{p}-rx{k}", daemon=True))
        for t in threads:
            t.start()
        if meanwhile is not None:
            meanwhile()
        for t in threads:
            t.join(max(0.0, self.deadline - time.monotonic()))
            if t.is_alive():
                self.fail(PeerTimeout(f"{p}: did not finish before its deadline"))
                t.join(5.0)
        if self.error is not None:
            raise self.error
        if any(t.is_alive() for t in threads):  # pragma: no cover - sockets are shut down
            raise NetError(f"{p} threads did not stop after a failure")


class _RingRun(Pipeline):
    """State of one all-reduce of one flat vector."""

    def __init__(self, links: Links, x: np.ndarray, out: np.ndarray, rank: int, world: int, mode: str,
                 block: int, piece_numel: int, seed: int | None, call: int, deadline: float,
                 ws: Workspace, inspect: Inspect | None = None, seal: Seal | None = None) -> None:
        super().__init__(links, deadline)
        self.x, self.out, self.rank, self.world = x, out, rank, world
        self.inspect, self.seal = inspect, seal
        self.findings: list[Finding] = []  # the predecessor's own pieces inspect() found bad
        self.mode, self.block, self.seed, self.call = mode, block, seed, call
        self.plan: RingPlan = make_plan(x.shape[0], world, block, piece_numel)
        self.ws = ws
        self.maxp = self.plan.max_piece()
        self.cap = quant.encoded_nbytes(self.maxp, mode, block)  # pooled buffer size
        self.step0_done = threading.Event()

    # -- threads -----------------------------------------------------------------------
    def encoder(self) -> None:
        seg = self.plan.send_segment(self.rank, 0)
        scratch = self.ws.scratch("enc", self.maxp)
        for j in range(self.plan.pieces):
            if self.error is not None:
                return
            a, b = self.plan.piece(seg, j)
            if self.mode == "fp32":  # zero copy: send straight from the caller's array
                self.put(j, self.x[a:b].view(np.uint8), None, None)
                continue
            buf = self.ws.get(self.cap)
            rng = piece_rng(self.seed, self.call, seg, j, 0)
            wire = quant.encode(self.x[a:b], self.mode, self.block,
                                buf[: quant.encoded_nbytes(b - a, self.mode, self.block)], rng=rng, scratch=scratch)
            self.put(j, wire, None, buf)
        self.step0_done.set()

    def wait_step0(self) -> None:
        """Step 0 (our own segment) goes out first, so its encoding has priority: receivers
        start computing only once it is done (meanwhile the kernel buffers their input)."""
        while not self.step0_done.wait(0.5):
            if self.error is not None or time.monotonic() > self.deadline:
                return

    def sender(self, k: int) -> None:
        conn = self.links.out[k]
        seg = self.plan.send_segment(self.rank, 0)
        for m in range(k, self.plan.messages, self.streams):
            item = self.take(m)
            if item is None:
                return
            conn.send(MsgType.DATA, item[0], deadline=self.deadline, ptag=item[1])
            if m < self.plan.pieces and self.seal is not None:  # our own piece: its signature follows
                a, b = self.plan.piece(seg, m)
                conn.send(MsgType.DATA, self.seal.sign(seg, m, b - a, item[0]), deadline=self.deadline)
            if item[2] is not None:
                self.ws.release(item[2])

    def receiver(self, k: int) -> None:
        plan, mode, block, world, ws = self.plan, self.mode, self.block, self.world, self.ws
        conn = self.links.inn[k]
        acc_buf = ws.scratch(f"acc{k}", self.maxp)
        enc_buf = ws.scratch(f"enc{k}", self.maxp)
        rbuf = ws.scratch(f"rx{k}", self.cap, np.uint8)
        for m in range(k, plan.messages, self.streams):
            if self.error is not None:
                return
            s, j = divmod(m, plan.pieces)
            seg = plan.send_segment(self.rank, s + 1)  # what the predecessor sent at step s
            a, b = plan.piece(seg, j)
            n = b - a
            nbytes = quant.encoded_nbytes(n, mode, block)
            hdr = conn.recv_header(MsgType.DATA, deadline=self.deadline, length=nbytes)
            nxt = m + plan.pieces if s < 2 * world - 3 else None
            if m < self.streams:
                self.wait_step0()
            if s < world - 1:  # reduce-scatter: accumulate in fp32, re-encode
                pooled = ws.get(self.cap)
                if mode == "fp32":  # receive straight into the accumulator that is sent on
                    acc = pooled[:nbytes].view(np.float32)
                    conn.recv_payload_into(hdr, acc, deadline=self.deadline)
                    if s == 0:
                        self._inspect(conn, acc, acc.view(np.uint8), seg, j)
                    np.add(acc, self.x[a:b], out=acc)
                else:
                    conn.recv_payload_into(hdr, rbuf[:nbytes], deadline=self.deadline)
                    if s == 0:  # the predecessor's own values, unsummed
                        self._inspect(conn, None, rbuf[:nbytes], seg, j)
                    acc = rs_hop(rbuf[:nbytes], self.x[a:b], mode, block, acc_buf)
                if s < world - 2:
                    rng = piece_rng(self.seed, self.call, seg, j, s + 1)
                    wire = acc.view(np.uint8) if mode == "fp32" else quant.encode(
                        acc, mode, block, pooled[:nbytes], rng=rng, scratch=enc_buf)
                else:
                    rng = piece_rng(self.seed, self.call, seg, j, world - 1)
                    wire = finish(acc, world, mode, block, self.out[a:b], rng=rng,
                                  wire_out=pooled[:nbytes], scratch=enc_buf)
                    if mode == "fp32":  # the mean went to self.out; forward from there
                        ws.release(pooled)
                        pooled = None
                self.put(m + plan.pieces, wire, None, pooled)
            else:  # all-gather: adopt and forward the owner's bytes verbatim
                pooled = None
                if mode == "fp32":
                    wire = self.out[a:b].view(np.uint8)
                    conn.recv_payload_into(hdr, wire, deadline=self.deadline)
                else:
                    pooled = ws.get(self.cap)
                    wire = pooled[:nbytes]
                    conn.recv_payload_into(hdr, wire, deadline=self.deadline)
                    quant.decode(wire, n, mode, block, out=self.out[a:b])
                if nxt is not None:
                    self.put(nxt, wire, hdr.ptag, pooled)
                elif pooled is not None:
                    ws.release(pooled)

    def _inspect(self, conn: Connection, theirs: np.ndarray | None, wire: np.ndarray, seg: int, j: int) -> None:
        """The predecessor's own piece ``j`` of segment ``seg`` arrived as ``wire`` (``theirs``:
        already decoded): read its signature, show it to ``inspect``, keep it if found bad."""
        sig = self.their_signature(conn)
        if self.inspect is None:
            return
        a, b = self.plan.piece(seg, j)
        if theirs is None:
            theirs = quant.decode(wire, b - a, self.mode, self.block)
        why = self.inspect(theirs)
        if not why:
            return
        payload = wire.tobytes()
        if self.seal is not None and not self.seal.verify(seg, j, b - a, payload, sig):  # type: ignore[arg-type]
            raise FrameError(f"{conn.peer}: its own piece {j} of segment {seg} has {why}, and its signature "
                             "does not verify")
        with self.cond:
            self.findings.append(Finding(why, seg, j, b - a, payload, sig))

    def run(self) -> np.ndarray:
        self.spawn(self.encoder, self.sender, self.receiver)
        return self.out


Inspect = Callable[[np.ndarray], "str | None"]


def ring_all_reduce(links: Links, x: np.ndarray, rank: int, world: int, *, mode: str, block: int,
                    piece_numel: int, seed: int | None, call: int, deadline: float,
                    out: np.ndarray | None = None, workspace: Workspace | None = None,
                    inspect: Inspect | None = None, findings: list[Finding] | None = None,
                    seal: Seal | None = None) -> np.ndarray:
    """Mean of ``x`` (flat float32) over the ring, bit-identical on every rank.

    Written to ``out`` (flat float32, must not overlap ``x``) or a new array. ``inspect(theirs)``
    is shown each piece of the predecessor's own contribution (its first messages, before any
    sum); a piece it finds bad (it returns a reason) goes to ``findings``. ``seal``: sign our
    own pieces and check the predecessor's (both ends must agree on having one).
    """
    out = np.empty(x.shape[0], np.float32) if out is None else out
    if out.shape != x.shape or out.dtype != np.float32:
        raise ValueError(f"out must be float32 of shape {x.shape}, got {out.dtype} {out.shape}")
    if np.may_share_memory(out, x):
        raise ValueError("out must not overlap the input (the input must survive a failure)")
    if world == 1:
        np.copyto(out, x)
        return out
    ws = workspace or Workspace()
    run = _RingRun(links, x, out, rank, world, mode, block, piece_numel, seed, call, deadline, ws, inspect, seal)
    try:
        return run.run()
    finally:
        if findings is not None:
            findings.extend(run.findings)
