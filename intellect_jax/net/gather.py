"""All-gather exchange of whole compressed contributions, and their fixed-order mean.

The gathered codecs (:mod:`.codecs`: ``int2``, ``int1``, ``topk<K>``, ``top1of<G>``) are never re-encoded on the way:
each rank encodes its own contribution once, every other rank receives exactly those bytes,
and every rank decodes all of them and sums them in rank order (0, 1, ..., N-1), then divides
by N. So the mean is bit-identical on every rank, and each rank knows exactly what its own
contribution lost (``x - decode(encode(x))``): what error feedback carries to the next round.
A sum of sparse vectors is not sparse, which is why the contributions travel whole instead of
as re-encoded partial sums.

Schedule over the ring's links (the same connections as the ring all-reduce): a bucket of
``numel`` values is cut into ``P`` pieces (:func:`~.plan.make_plan` with one segment); at step
``s`` (``0 <= s < N - 1``) rank ``r`` sends the pieces of rank ``(r - s) mod N``'s contribution:
its own at step 0, then what its predecessor sent it the step before, verbatim. Each rank sends
and receives ``(N - 1)`` contributions.

Signed (:class:`OriginSeal`), every piece is followed by its origin's signature, which travels
with it at every hop, over a statement that names no receiver (:data:`~.evidence.EVERYONE`),
and the first piece of each contribution by its origin's certificate (the predecessor's own: the
one its connection presented; a forwarded one: issued by the run authority to that rank's
identity and not revoked). Every rank checks every piece's signature before it forwards or sums
it, and fails the call naming its predecessor at the first that does not verify: a rank that
passes on another's contribution cannot change it, so no two ranks that complete a call ever
sum different bytes (unsigned, a middle rank could alter what it forwards, and the ranks after
it would part from the others with nobody to blame). An origin could still sign two versions of
a piece and have an accomplice further on swap in the second; so before it sums, each rank
signs the digest of every contribution as it holds it, the digests go once round the ring
under their signatures, and a rank sums only if every one equals its own (:meth:`_GatherRun.agree`).
When they differ the call fails, and each rank shows the coordinator its holding of every origin
(each piece's digest under the origin's signature), its own signed list and every one it got:
an origin that signed two versions is shown by two holdings, and a rank whose list goes against
the ring's majority, with no holding signed by the origin to bear it out, by its own signature
(``coordinator.holdings``).
Its predecessor's own pieces are shown to ``inspect`` whole, as they arrive; one that does not
decode is evidence against its sender too, and adds nothing to the mean on any rank. The
contributions of ranks sitting the round out (``absent``, the same on every rank) add nothing
either, and a sitter's piece that is not all zeros is evidence against it (:data:`~.evidence.SAT_OUT`).

A rank may bring its contribution encoded already (:class:`Encoded`: a GPU node encodes on its
devices, :mod:`intellect_jax.kernels.codecs_xla`); its payload pieces are then sent as they are,
and what its encoding dropped was computed where it was encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from intellect_jax.net import codecs, quant
from intellect_jax.net.errors import FrameError
from intellect_jax.net.evidence import SAT_OUT, SIG_BYTES, digest, hasher
from intellect_jax.net.frames import MsgType
from intellect_jax.net.plan import RingPlan, make_plan
from intellect_jax.net.ring import Finding, Inspect, Links, Pipeline

MAX_CERT = 8192  # bytes of a certificate (DER) a rank reads from its predecessor


@dataclass(frozen=True)
class OriginSeal:
    """How a signed all-gather binds every piece to the rank that encoded it, wherever it comes
    from: ``sign(piece, numel, digest)`` for our own pieces (a statement naming no receiver:
    every rank gets them), ``verify(origin, cert, piece, numel, digest, signature)`` for any
    rank's, with its certificate ``cert`` (DER), each by the piece's :func:`~.evidence.digest`;
    ``admit(origin, cert)``: why ``cert`` is not one the run authority issued to ``origin``'s
    identity and has not revoked (None: it is); ``cert``: ours;
    ``vouch(digest)``, ``vouched(rank, cert, digest, signature)``: the signature of the digest
    of every contribution as a rank holds it (:meth:`_GatherRun.agree`)."""

    sign: Callable[[int, int, bytes], bytes]
    verify: Callable[[int, bytes, int, int, bytes, bytes], bool]
    admit: Callable[[int, bytes], str | None]
    cert: bytes
    vouch: Callable[[bytes], bytes]
    vouched: Callable[[int, bytes, bytes, bytes], bool]


@dataclass(frozen=True)
class Encoded:
    """A contribution encoded already: ``payloads[b][j]`` is piece ``j`` (:func:`gather_plan`) of
    bucket ``b`` (``net.tree.make_buckets`` of ``like``'s leaves), in the codec's wire layout.
    ``like``: the contribution's tree, as float32 placeholders of its shapes (see :func:`shapes`).
    Pass it to ``Communicator.all_reduce_mean`` in place of the tree (no ``dropped``)."""

    like: Any
    payloads: tuple[tuple[np.ndarray, ...], ...]
    mode: str
    block: int
    bucket_numel: int
    piece_numel: int

    def check(self, mode: str, block: int, bucket_numel: int, piece_numel: int) -> None:
        """ValueError unless it was encoded for this ring's settings."""
        ours = (self.mode, self.block, self.bucket_numel, self.piece_numel)
        if ours != (mode, block, bucket_numel, piece_numel):
            raise ValueError(f"a contribution encoded as (mode, block, bucket, piece) {ours} for a ring of "
                             f"{(mode, block, bucket_numel, piece_numel)}")

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for b in self.payloads for w in b)


def shapes(tree: Any) -> Any:
    """Float32 placeholders of ``tree``'s shapes (no memory: one broadcast zero each)."""
    import jax

    return jax.tree.map(lambda a: np.broadcast_to(np.float32(0), np.shape(a)), tree)


def check_own(own: Sequence[np.ndarray], p: RingPlan, mode: str, block: int) -> None:
    """ValueError unless ``own`` holds one payload of the right length per piece of ``p``."""
    if len(own) != p.pieces:
        raise ValueError(f"an encoded contribution of {len(own)} pieces for a plan of {p.pieces}")
    for j, w in enumerate(own):
        a, b = p.piece(0, j)
        if w.dtype != np.uint8 or w.nbytes != quant.encoded_nbytes(b - a, mode, block):
            raise ValueError(f"encoded piece {j}: {w.nbytes} bytes of {w.dtype} for {b - a} values in {mode}")


def gather_plan(numel: int, block: int, piece_numel: int) -> RingPlan:
    """Pieces of one contribution (one segment, block/chunk aligned)."""
    return make_plan(numel, 1, block, piece_numel)


def encode_own(x: np.ndarray, p: RingPlan, mode: str, block: int, dropped: np.ndarray | None = None,
               j: int | None = None) -> list[np.ndarray]:
    """This rank's payload pieces (all, or only piece ``j``); ``dropped[a:b] = x - decoded``."""
    out = []
    for i in range(p.pieces) if j is None else (j,):
        a, b = p.piece(0, i)
        wire = quant.encode(x[a:b], mode, block)
        if dropped is not None:
            quant.decode(wire, b - a, mode, block, out=dropped[a:b])
            np.subtract(x[a:b], dropped[a:b], out=dropped[a:b])
        out.append(wire)
    return out


def combine(payloads: Sequence[Sequence[np.ndarray]], p: RingPlan, mode: str, block: int,
            out: np.ndarray, skipped: list[tuple[int, int]] | None = None,
            absent: frozenset[int] = frozenset()) -> np.ndarray:
    """The mean of every rank's decoded contribution, summed in rank order, into ``out`` (the
    ranks in ``absent`` add nothing: zeros, whatever they sent; the division is still by N).

    A piece its codec rejects adds nothing (every rank holds the same bytes, so every rank
    skips the same pieces and the mean stays bit-identical); its (rank, piece) goes to
    ``skipped``. Every rank holds its sender's signature on it; its successor keeps it as
    evidence (:class:`Finding`)."""
    world = len(payloads)
    scratch = np.empty(p.max_piece(), np.float32)
    for j in range(p.pieces):
        a, b = p.piece(0, j)
        acc = out[a:b]
        acc[...] = 0
        for r in range(world):
            if r in absent:
                continue
            try:
                with np.errstate(invalid="ignore", over="ignore"):  # (a peer's inf, NaN: the checks see them)
                    codecs.decode_add(payloads[r][j], b - a, mode, block, acc, scratch)
            except ValueError:
                if skipped is not None:
                    skipped.append((r, j))
        with np.errstate(invalid="ignore", over="ignore"):
            np.divide(acc, np.float32(world), out=acc)
    return out


def simulate(inputs: Sequence[np.ndarray], mode: str, block: int, piece_numel: int,
             dropped: Sequence[np.ndarray | None] | None = None,
             own: Sequence[Sequence[np.ndarray] | None] | None = None,
             absent: frozenset[int] = frozenset()) -> np.ndarray:
    """What :func:`ring_all_gather_mean` returns on every rank, in one process (and each rank's
    ``dropped``; ``own[r]``: rank r's payloads, encoded already)."""
    p = gather_plan(inputs[0].shape[0], block, piece_numel)
    pays = []
    for r, x in enumerate(inputs):
        if own is not None and own[r] is not None:
            check_own(own[r], p, mode, block)  # type: ignore[arg-type]
            pays.append(list(own[r]))  # type: ignore[arg-type]
        else:
            pays.append(encode_own(x, p, mode, block, None if dropped is None else dropped[r]))
    return combine(pays, p, mode, block, np.empty(inputs[0].shape[0], np.float32), absent=absent)


@dataclass(frozen=True)
class Vouch:
    """A rank's signed digest of every contribution as it held them (``entries``: per origin, in
    rank order, the digest of that origin's piece digests), as it went round the ring in
    :meth:`_GatherRun.agree`: shown to the coordinator after the call failed, where the ranks'
    lists convict one that signed an entry more than half of the ring contradict, unless a
    holding signed by the origin bears it out (``coordinator.holdings.weigh_vouches``)."""

    holder: int
    entries: tuple[bytes, ...]
    signature: bytes
    cert: bytes  # the holder's certificate, that the signature was checked with


@dataclass(frozen=True)
class Holding:
    """``origin``'s contribution to one call as a rank held it: the certificate it came with, and
    per piece its values' count, its digest and ``origin``'s signature of it. Two ranks' holdings
    that differ in a piece, each under a valid signature, are the origin's own word on two
    versions of it (``coordinator.holdings.weigh_holdings``)."""

    origin: int
    cert: bytes
    numels: tuple[int, ...]
    digests: tuple[bytes, ...]
    signatures: tuple[bytes, ...]


class _GatherRun(Pipeline):
    """State of one all-gather of one flat vector."""

    name = "gather"

    def __init__(self, links: Links, x: np.ndarray, out: np.ndarray, rank: int, world: int, mode: str,
                 block: int, piece_numel: int, deadline: float, dropped: np.ndarray | None,
                 inspect: Inspect | None, seal: OriginSeal | None, own: Sequence[np.ndarray] | None = None,
                 absent: frozenset[int] = frozenset()) -> None:
        super().__init__(links, deadline)
        self.x, self.out, self.rank, self.world = x, out, rank, world
        self.mode, self.block, self.dropped = mode, block, dropped
        self.inspect, self.oseal = inspect, seal
        self.plan = gather_plan(x.shape[0], block, piece_numel)
        self.certs: dict[int, bytes] = {} if seal is None else {rank: seal.cert}  # origin -> its certificate
        self.digests: list[list[bytes]] = [[b""] * self.plan.pieces for _ in range(world)]  # signed: each piece's
        self.sigs: list[list[bytes]] = [[b""] * self.plan.pieces for _ in range(world)]  # signed: its origin's signature
        self.disputed: list[int] = []  # origins whose contributions ranks hold otherwise than we do (agree)
        self.vouches: list[Vouch] = []  # our signed digests, then every rank's we got (agree)
        self.agreeing = self.agreed = False  # our signed digests went out; every rank's came and equals ours
        self.own, self.absent = own, absent
        self.pays: list[list[np.ndarray | None]] = [[None] * self.plan.pieces for _ in range(world)]
        self.findings: list[Finding] = []
        self.skipped: list[tuple[int, int]] = []  # (rank, piece) that did not decode (combine)

    @property
    def messages(self) -> int:
        return (self.world - 1) * self.plan.pieces

    def encoder(self) -> None:
        for j in range(self.plan.pieces):
            if self.error is not None:
                return
            wire = self.own[j] if self.own is not None else \
                encode_own(self.x, self.plan, self.mode, self.block, self.dropped, j)[0]
            self.pays[self.rank][j] = wire
            if self.oseal is not None:  # (hashed once: signed by the sender, summed up by agree)
                self.digests[self.rank][j] = digest(wire)
            self.put(j, wire, None, None, None)

    @property
    def signed(self) -> bool:
        return self.oseal is not None

    def sender(self, k: int) -> None:
        """Message ``m`` = piece ``j`` of step ``s``: (its origin's certificate first if ``j`` is 0;)
        the piece; its origin's signature (ours made here, a forwarded one as it came)."""
        conn, P, seal = self.links.out[k], self.plan.pieces, self.oseal
        for m in range(k, self.messages, self.streams):
            item = self.take(m)
            if item is None:
                return
            wire, ptag, sig, cert = item
            s, j = divmod(m, P)
            if seal is not None and j == 0:
                conn.send(MsgType.DATA, cert if s else seal.cert, deadline=self.deadline)
            conn.send(MsgType.DATA, wire, deadline=self.deadline, ptag=ptag)
            if seal is not None:
                if not s:
                    a, b = self.plan.piece(0, j)
                    sig = self.sigs[self.rank][j] = seal.sign(j, b - a, self.digests[self.rank][j])
                conn.send(MsgType.DATA, sig, deadline=self.deadline)

    def receiver(self, k: int) -> None:
        conn, P = self.links.inn[k], self.plan.pieces
        for m in range(k, self.messages, self.streams):
            if self.error is not None:
                return
            s, j = divmod(m, P)
            origin = (self.rank - 1 - s) % self.world
            a, b = self.plan.piece(0, j)
            nbytes = quant.encoded_nbytes(b - a, self.mode, self.block)
            cert = self._cert(conn, s, origin) if self.signed and j == 0 else None
            hdr = conn.recv_header(MsgType.DATA, deadline=self.deadline, length=nbytes)
            wire = np.empty(nbytes, np.uint8)
            conn.recv_payload_into(hdr, wire, deadline=self.deadline)
            sig = self.their_signature(conn)
            if self.oseal is not None:
                if not self.wait_for(lambda: origin in self.certs, f"rank {origin}'s certificate"):
                    return
                d = self.digests[origin][j] = digest(wire)
                if not self.oseal.verify(origin, self.certs[origin], j, b - a, d, sig):  # type: ignore[arg-type]
                    raise FrameError(f"{conn.peer}: piece {j} of rank {origin}'s contribution does not carry rank "
                                     f"{origin}'s signature" + (" (it forwarded it)" if s else ""))
                self.sigs[origin][j] = sig  # type: ignore[assignment]
            if s == 0:
                self._inspect(conn, wire, j, sig)
            self.pays[origin][j] = wire
            if s < self.world - 2:
                self.put(m + P, wire, hdr.ptag, sig, cert)

    def _cert(self, conn, s: int, origin: int) -> bytes:  # noqa: ANN001
        """The certificate that comes before the first piece of ``origin``'s contribution: our
        predecessor's own must be the one its connection presented; a forwarded one, issued by the
        run authority to ``origin``'s identity and not revoked. A revoked one is that rank's own
        doing, not its forwarder's: the error names it."""
        hdr = conn.recv_header(MsgType.DATA, deadline=self.deadline, max_len=MAX_CERT)
        buf = bytearray(hdr.length)
        conn.recv_payload_into(hdr, buf, deadline=self.deadline)
        cert = bytes(buf)
        if s == 0 and cert != conn.cert:
            raise FrameError(f"{conn.peer}: sent a certificate that is not the one it presented")
        why = self.oseal.admit(origin, cert)  # type: ignore[union-attr]
        if why == "revoked":
            raise FrameError(f"rank {origin}'s certificate is revoked" + (f" (forwarded by {conn.peer})" if s else ""))
        if why:
            raise FrameError(f"{conn.peer}: forwarded a certificate for rank {origin} that is {why}")
        with self.cond:
            self.certs[origin] = cert
            self.cond.notify_all()
        return cert

    def _inspect(self, conn, wire: np.ndarray, j: int, sig: bytes | None) -> None:  # noqa: ANN001
        """The predecessor's own piece ``j`` (its signature checked if signed): decode it and
        show it to ``inspect``; keep it if found bad or undecodable (every rank skips an
        undecodable one)."""
        a, b = self.plan.piece(0, j)
        try:
            theirs = quant.decode(wire, b - a, self.mode, self.block)
            if (self.rank - 1) % self.world in self.absent:  # it sits the round out: it owes zeros
                why = SAT_OUT if theirs.any() else None
            else:
                why = self.inspect(theirs) if self.inspect is not None else None
        except ValueError as e:  # every rank will skip it (combine); its signature blames its sender
            why = f"an undecodable payload ({e})"
        if not why:
            return
        with self.cond:
            self.findings.append(Finding(why, 0, j, b - a, wire.tobytes(), sig))

    def agree(self) -> None:
        """Signed: our digest of each origin's contribution as we hold it goes round the ring under
        our signature, and every rank's comes to us the same way; each must equal ours (FrameError
        otherwise: an origin signed two versions of a piece and ranks on either side of an
        accomplice hold different ones). So no rank sums bytes another rank that completes does
        not. The origins concerned go to :attr:`disputed`. After a failure each rank shows the
        coordinator its :meth:`holdings` (those first) and the lists (:attr:`vouches`): wherever
        two holdings of an origin differ in a piece, each under the origin's signature, the origin
        signed two versions (a holding passed on round the ring could be altered by the
        colluders, who stand between the two sides); a list against the ring's majority that no
        holding signed by the origin bears out convicts its signer."""
        held = b"".join(self._held(o) for o in range(self.world))
        seal, out, inn, differ = self.oseal, self.links.out[0], self.links.inn[0], set()
        item = held + seal.vouch(digest(held))  # type: ignore[union-attr]
        self.vouches = [Vouch(self.rank, self._entries(held), item[-SIG_BYTES:], seal.cert)]  # type: ignore[union-attr]
        self.agreeing = True  # (from here on a failed call shows the coordinator our holdings: holdings)
        for s in range(self.world - 1):
            buf = self._pass(out, inn, item, len(item))
            theirs, sig, holder = bytes(buf[:-SIG_BYTES]), bytes(buf[-SIG_BYTES:]), (self.rank - 1 - s) % self.world
            if not seal.vouched(holder, self.certs[holder], digest(theirs), sig):  # type: ignore[union-attr]
                raise FrameError(f"{inn.peer}: rank {holder}'s digest of the contributions does not carry its "
                                 "signature")
            entries = self._entries(theirs)
            self.vouches.append(Vouch(holder, entries, sig, self.certs[holder]))
            differ.update(o for o, e in enumerate(entries) if e != self.vouches[0].entries[o])
            self.disputed = sorted(differ)  # (so far, should a holder stop passing them on)
            item = bytes(buf)
        if differ:  # (an origin signed two versions of a piece, or a rank lies about what it holds)
            raise FrameError(f"ranks hold other contributions than we do of rank(s) {self.disputed}")
        self.agreed = True

    def _entries(self, held: bytes) -> tuple[bytes, ...]:
        """A digest list cut into its per-origin entries."""
        return tuple(held[32 * o:32 * o + 32] for o in range(self.world))

    def _held(self, origin: int) -> bytes:
        """The digest of ``origin``'s piece digests, as we hold them."""
        h = hasher()
        for d in self.digests[origin]:
            h.update(d)
        return h.digest()

    def _pass(self, out, inn, item: bytes, n: int) -> bytearray:  # noqa: ANN001
        """Send ``item`` on, and take the next one of ``n`` bytes from our predecessor."""
        out.send(MsgType.DATA, item, deadline=self.deadline)
        hdr = inn.recv_header(MsgType.DATA, deadline=self.deadline, length=n)
        buf = bytearray(hdr.length)
        inn.recv_payload_into(hdr, buf, deadline=self.deadline)
        return buf

    def holding(self, origin: int) -> Holding:
        """``origin``'s contribution as we hold it, signed by it (to show a third party)."""
        numels = tuple(b - a for a, b in (self.plan.piece(0, j) for j in range(self.plan.pieces)))
        return Holding(origin, self.certs[origin], numels, tuple(self.digests[origin]), tuple(self.sigs[origin]))

    def holdings(self) -> list[Holding]:
        """After our signed digests went out and the call failed: our holding of every other
        origin, those ranks dispute first. Not only theirs: a rank that got none of the others'
        digests (a colluder before it passed none on) cannot know that its own are disputed, yet
        must bear out every one it signed (``coordinator.holdings.weigh_vouches``)."""
        if not self.agreeing or self.agreed:
            return []
        rest = [o for o in range(self.world) if o not in self.disputed]
        return [self.holding(o) for o in self.disputed + rest if o != self.rank]

    def run(self) -> np.ndarray:
        self.spawn(self.encoder, self.sender, self.receiver)
        if self.oseal is not None:
            self.agree()
        return combine(self.pays, self.plan, self.mode, self.block, self.out, self.skipped,  # type: ignore[arg-type]
                       self.absent)


def ring_all_gather_mean(links: Links, x: np.ndarray, rank: int, world: int, *, mode: str, block: int,
                         piece_numel: int, deadline: float, out: np.ndarray | None = None,
                         dropped: np.ndarray | None = None, inspect: Inspect | None = None,
                         findings: list[Finding] | None = None, seal: OriginSeal | None = None,
                         own: Sequence[np.ndarray] | None = None, absent: frozenset[int] = frozenset(),
                         disputed: list[Holding] | None = None, vouches: list[Vouch] | None = None) -> np.ndarray:
    """Mean of ``x`` (flat float32) over the ring by an all-gather of encoded contributions,
    bit-identical on every rank (``out``: flat float32, not overlapping ``x``). ``dropped``:
    receives ``x - decode(encode(x))``. ``own``: this rank's payload pieces, encoded already
    (then ``x`` only gives the length, and no ``dropped``). ``inspect``, ``findings``: as the
    ring's; ``seal``: every piece signed by its origin and checked by every rank. ``absent``: the
    ranks sitting the round out (their contributions add nothing; the mean is still over N, as
    the ring's). ``disputed``: when the call fails once our signed digests went out, our holding
    of every origin but us (:meth:`_GatherRun.holdings`), signed by it, for the coordinator to
    compare; ``vouches``: then our signed digests and every rank's we got."""
    if not codecs.gathered(mode):
        raise ValueError(f"{mode} is not a gathered codec")
    out = np.empty(x.shape[0], np.float32) if out is None else out
    if out.shape != x.shape or np.may_share_memory(out, x):
        raise ValueError(f"out must be float32 of shape {x.shape}, apart from the input")
    if own is not None:
        if dropped is not None:
            raise ValueError("dropped is computed where an encoded contribution was encoded")
        check_own(own, gather_plan(x.shape[0], block, piece_numel), mode, block)
        if world == 1:
            return combine([own], gather_plan(x.shape[0], block, piece_numel), mode, block, out)
    if world == 1:  # nothing is sent, so nothing is lost
        np.copyto(out, x)
        if dropped is not None:
            dropped[...] = 0
        return out
    run = _GatherRun(links, x, out, rank, world, mode, block, piece_numel, deadline, dropped, inspect, seal, own,
                     frozenset(absent))
    try:
        return run.run()
    finally:
        if findings is not None:
            findings.extend(run.findings)
        if disputed is not None:
            disputed.extend(run.holdings())
        if vouches is not None and not run.agreed:
            vouches.extend(run.vouches)
