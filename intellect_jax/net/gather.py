"""All-gather exchange of whole compressed contributions, and their fixed-order mean.

The gathered codecs (:mod:`.codecs`: ``int2``, ``topk<K>``, ``top1of<G>``) are never re-encoded on the way:
each rank encodes its own contribution once, every other rank receives exactly those bytes,
and every rank decodes all of them and sums them in rank order (0, 1, ..., N-1), then divides
by N. So the mean is bit-identical on every rank, and each rank knows exactly what its own
contribution lost (``x - decode(encode(x))``): what error feedback carries to the next round.
A sum of sparse vectors is not sparse, which is why the contributions travel whole instead of
as re-encoded partial sums.

Schedule over the ring's links (the same connections as the ring all-reduce): a bucket of
``numel`` values is cut into ``P`` pieces (:func:`~.plan.make_plan` with one segment); at step
``s`` (``0 <= s < N - 1``) rank ``r`` sends the pieces of rank ``(r - s) mod N``'s contribution:
its own at step 0 (each followed by its signature, as in the ring), then what its predecessor
sent it the step before, verbatim. Each rank sends and receives ``(N - 1)`` contributions.
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
from typing import Any

import numpy as np

from intellect_jax.net import codecs, quant
from intellect_jax.net.errors import FrameError
from intellect_jax.net.evidence import SAT_OUT
from intellect_jax.net.frames import MsgType
from intellect_jax.net.plan import RingPlan, make_plan
from intellect_jax.net.ring import Finding, Inspect, Links, Pipeline, Seal


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
    ``skipped``. The successor of its sender holds the sender's signature on it (:class:`Finding`)."""
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
                codecs.decode_add(payloads[r][j], b - a, mode, block, acc, scratch)
            except ValueError:
                if skipped is not None:
                    skipped.append((r, j))
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


class _GatherRun(Pipeline):
    """State of one all-gather of one flat vector."""

    name = "gather"

    def __init__(self, links: Links, x: np.ndarray, out: np.ndarray, rank: int, world: int, mode: str,
                 block: int, piece_numel: int, deadline: float, dropped: np.ndarray | None,
                 inspect: Inspect | None, seal: Seal | None, own: Sequence[np.ndarray] | None = None,
                 absent: frozenset[int] = frozenset()) -> None:
        super().__init__(links, deadline)
        self.x, self.out, self.rank, self.world = x, out, rank, world
        self.mode, self.block, self.dropped = mode, block, dropped
        self.inspect, self.seal = inspect, seal
        self.plan = gather_plan(x.shape[0], block, piece_numel)
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
            self.put(j, wire, None)

    def sender(self, k: int) -> None:
        conn = self.links.out[k]
        for m in range(k, self.messages, self.streams):
            item = self.take(m)
            if item is None:
                return
            conn.send(MsgType.DATA, item[0], deadline=self.deadline, ptag=item[1])
            if m < self.plan.pieces and self.seal is not None:  # our own piece: its signature follows
                a, b = self.plan.piece(0, m)
                conn.send(MsgType.DATA, self.seal.sign(0, m, b - a, item[0]), deadline=self.deadline)

    def receiver(self, k: int) -> None:
        conn, P = self.links.inn[k], self.plan.pieces
        for m in range(k, self.messages, self.streams):
            if self.error is not None:
                return
            s, j = divmod(m, P)
            origin = (self.rank - 1 - s) % self.world
            a, b = self.plan.piece(0, j)
            nbytes = quant.encoded_nbytes(b - a, self.mode, self.block)
            hdr = conn.recv_header(MsgType.DATA, deadline=self.deadline, length=nbytes)
            wire = np.empty(nbytes, np.uint8)
            conn.recv_payload_into(hdr, wire, deadline=self.deadline)
            if s == 0:
                self._inspect(conn, wire, j)
            self.pays[origin][j] = wire
            if s < self.world - 2:
                self.put(m + P, wire, hdr.ptag)

    def _inspect(self, conn, wire: np.ndarray, j: int) -> None:  # noqa: ANN001
        """The predecessor's own piece ``j``: read its signature, decode it and show it to
        ``inspect``; keep it if found bad or undecodable (every rank skips an undecodable one)."""
        sig = self.their_signature(conn)
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
        payload = wire.tobytes()
        if self.seal is not None and not self.seal.verify(0, j, b - a, payload, sig):  # type: ignore[arg-type]
            raise FrameError(f"{conn.peer}: its own piece {j} has {why}, and its signature does not verify")
        with self.cond:
            self.findings.append(Finding(why, 0, j, b - a, payload, sig))

    def run(self) -> np.ndarray:
        self.spawn(self.encoder, self.sender, self.receiver)
        return combine(self.pays, self.plan, self.mode, self.block, self.out, self.skipped,  # type: ignore[arg-type]
                       self.absent)


def ring_all_gather_mean(links: Links, x: np.ndarray, rank: int, world: int, *, mode: str, block: int,
                         piece_numel: int, deadline: float, out: np.ndarray | None = None,
                         dropped: np.ndarray | None = None, inspect: Inspect | None = None,
                         findings: list[Finding] | None = None, seal: Seal | None = None,
                         own: Sequence[np.ndarray] | None = None, absent: frozenset[int] = frozenset()) -> np.ndarray:
    """Mean of ``x`` (flat float32) over the ring by an all-gather of encoded contributions,
    bit-identical on every rank (``out``: flat float32, not overlapping ``x``). ``dropped``:
    receives ``x - decode(encode(x))``. ``own``: this rank's payload pieces, encoded already
    (then ``x`` only gives the length, and no ``dropped``). ``inspect``, ``findings``, ``seal``:
    as the ring's. ``absent``: the ranks sitting the round out (their contributions add nothing;
    the mean is still over N, as the ring's)."""
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
