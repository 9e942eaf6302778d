"""Audits of the butterfly's segment owners: a wrong aggregate is evidence against its owner.

In the butterfly exchange (:mod:`.butterfly`) the owner of a segment aggregates every member's
own piece of it and sends the result back to all. Nothing so far stopped a malicious owner from
sending back anything it liked. Here every call audits every owner, at a cost of about one
piece per link:

1. **Commitment.** As soon as an owner has aggregated all ``P`` pieces of its segment (while
   its aggregates still go out: the audit's frames go between them) it signs one
   :func:`commitment` (the run, outer step, epoch and call, the plan, the codec, the aggregator,
   the members sitting out, and two roots): the digest (BLAKE3) of each aggregate's wire bytes, and for
   each piece the *row list*: every member's piece as the owner received it (its digest and its
   sender's signature; for the owner's own row, which it never sent, its digest and zeros).
   Every member gets the aggregates' digests and the signature, from the owner and forwarded
   by two others (:func:`~.pairing.forwarders`): the first that verifies is the one it holds.
2. **Pairing.** Who audits whom is drawn only once every owner is bound to its aggregates:
   each rank's call header carries the head of a hash chain of nonces (:func:`~.pairing.nonce_chain`, one
   per bucket), and each rank reveals its nonce of the bucket once it holds every owner's
   commitment (forwarded too, checked against the header's chain); the digest of all of them (:func:`~.pairing.draw`) picks the rotation (:func:`~.pairing.rotation`:
   rank ``r`` audits segment ``r - offset``). So an owner cannot know while it commits whether
   its auditor is an accomplice, and no member can choose the draw (its nonce was fixed before
   any data moved). But it can refuse it: a member that holds back its own nonce sees the draw
   first, and by withholding it stalls the call, which names nobody, and the retry draws anew.
   The owner then sends its auditor the row lists.
3. **Challenge.** Only then does the auditor draw one piece ``j`` at random and ask every member
   for its own piece ``j`` of the segment in the codec, signed to the auditor (the owner too: its
   own row went through the codec like every other). An owner cannot know which piece will be
   checked while it aggregates. The challenge carries the pairing's draw: a member shown other
   nonces than the rest (a rank that equivocates) fails the call rather than leave a segment
   unaudited. A member's answer that does not come the owner supplies instead (it keeps every
   row it was sent until the challenge: :meth:`Ledger.decide`, ``audit_frames``), checked
   against its row list, which carries the sender's signature.
4. **Check** (:func:`judge`, the same code on the auditor and the coordinator). The rows must be
   the committed ones and the aggregate of the committed rows must be the committed aggregate.
   A failure names one member with what it signed itself: an owner whose aggregate is not the
   aggregate of its rows; a member that signed two different pieces for one place (one to the
   owner, another to the auditor). A row or answer whose signature does not verify names nobody
   (an owner's forgery and a sender's trick cannot be told apart): the case shows nothing.
5. **Echo.** Every member checks the aggregates it gets against the commitment it holds, and
   passes that one on to the owner's auditor, with the one the owner sent it itself if that is
   another: an owner that sends some members other aggregates must sign another commitment for
   them, and the auditor then holds both under its signature, however the member came by its own.

The auditor judges before the last piece of its own aggregate leaves and fails the call when the
case shows a fault: no rank completes without that piece, so nobody applies a forgery, and the
case goes to the coordinator with the retry. An owner that withholds its own row stalls the
whole call the same way, never just its auditor (nobody else holds that row). What an audit cannot see: an owner that forges ``f``
of its ``P`` pieces is caught with probability ``f / P`` per call (the others are applied), and
an owner the draw pairs with an accomplice (with ``k`` colluders, ``(k - 1) / (N - 1)`` of its
calls), and colluders that stall every other call: with its accomplice's nonce held back a
forging owner escapes an honest draw (the call fails, naming nobody) and gets a new one on the
retry, so over ``t`` tries a step's forgery is applied with probability ``1 - (1 - (k - 1) /
(N - 1))^t`` (0.91 at N = 4, k = 2 and the 6 tries of a step), at the price of failed calls
(the open liveness problem: a stall after step 1 evicts nobody).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from intellect_jax.net import pairing, quant, robust
from intellect_jax.net.evidence import MAX_EVIDENCE_BYTES, SIG_BYTES, digest, hasher, piece_statement
from intellect_jax.net.pairing import auditor_of, audited_by, draw
from intellect_jax.net.plan import butterfly_plan

DIGEST = 32
ENTRY = DIGEST + SIG_BYTES  # a row list entry: the row's digest, its sender's signature to the owner
NO_SIG = bytes(SIG_BYTES)  # the owner's own row: never sent, so never signed
MAX_PIECES = 1 << 16  # pieces per segment a case may list
MAX_CASE_RANKS = 64  # members a reported case may hold
MAX_CASE_BYTES = 12 << 20  # a case larger than this as JSON is logged, not reported (coordinator MAX_MSG)


def root(parts: Sequence[bytes]) -> bytes:
    """The digest (:func:`~.evidence.digest`) of the parts' concatenation."""
    h = hasher()
    for p in parts:
        h.update(p)
    return h.digest()


def head_nbytes(pieces: int, world: int) -> int:
    """Bytes of a commitment's head: the aggregates' digests, the left-out vector, the rows' root."""
    return pieces * DIGEST + 4 * world + DIGEST


def pack_left(left: Sequence[int]) -> bytes:
    """The left-out vector as a head carries it (a little-endian u32 per member)."""
    return np.asarray(left, "<u4").tobytes()


def split(head: bytes, world: int) -> tuple[list[bytes], tuple[int, ...], bytes]:
    """A commitment's head as (the aggregates' digests, the left-out vector: for each member
    the first piece from which the owner left its rows out, ``P`` for none, the rows' root)."""
    cut = len(head) - DIGEST - 4 * world
    left = tuple(int(v) for v in np.frombuffer(head[cut:len(head) - DIGEST], "<u4"))
    return [head[i:i + DIGEST] for i in range(0, cut, DIGEST)], left, head[-DIGEST:]


def commitment(run_id: str, step: int, epoch: int, call: int, owner: str, segment: int, world: int, numel: int,
               piece_numel: int, mode: str, block: int, how: str, absent: Sequence[int], left: Sequence[int],
               aggregates: bytes, rows: bytes) -> bytes:
    """What an owner signs for its segment in one call (``aggregates``, ``rows``: the roots;
    ``left``: per member the first piece whose row the owner left out, the pieces' count for none)."""
    return (f"intellect_jax commitment\nrun {run_id}\nouter step {step}\nepoch {epoch}\ncall {call}\nowner {owner}\n"
            f"segment {segment}\nworld {world}\nnumel {numel}\npiece numel {piece_numel}\nmode {mode}\n"
            f"block {block}\nhow {how}\nabsent {','.join(map(str, sorted(absent)))}\n"
            f"left out from {','.join(map(str, left))}\n"
            f"aggregates blake3 {aggregates.hex()}\nrows blake3 {rows.hex()}").encode()


def passed(run_id: str, step: int, epoch: int, call: int, auditor: str) -> bytes:
    """What an auditor signs once its audit passed, with its last piece's tail: without it no
    member places that piece from anyone but the auditor itself (a relayer that found the tail's
    4 bytes from the piece's committed digest cannot complete a member before the audit)."""
    return f"intellect_jax audit passed\nrun {run_id}\nouter step {step}\nepoch {epoch}\ncall {call}\nauditor {auditor}".encode()


@dataclass(frozen=True)
class Case:
    """One audited piece, everything a third party needs to judge it (ranks index ``ids``).

    ``aggregates``: the owner's digest of each piece's aggregate (``P``); ``row_roots``: the
    root of each piece's row list; ``rows``: piece ``piece``'s row list (``world`` entries);
    ``payloads``: each member's piece as the auditor got it (the auditor's own as it sent it to
    the owner; empty for a member whose row the owner left out of it); ``audit_sigs``: each
    sender's signature of its payload to the auditor (None for the auditor's own and those left
    out)."""

    run_id: str
    step: int
    epoch: int
    call: int
    ids: tuple[str, ...]
    owner: int
    auditor: int
    piece: int
    numel: int  # the whole vector's
    piece_numel: int
    mode: str
    block: int
    how: str
    absent: tuple[int, ...]
    left: tuple[int, ...]  # per member, the first piece the owner left its row out of (P: none)
    aggregates: tuple[bytes, ...]
    row_roots: tuple[bytes, ...]
    commit_sig: bytes
    rows: bytes
    payloads: tuple[bytes, ...]
    audit_sigs: tuple[bytes | None, ...]
    other: tuple[bytes, bytes] | None = None  # another commitment (head, signature) a member got
    def bounds(self) -> tuple[int, int]:
        """The audited piece's element range (ValueError: it does not exist)."""
        world = len(self.ids)
        if not 0 <= self.owner < world or not 0 <= self.auditor < world or self.owner == self.auditor:
            raise ValueError(f"owner {self.owner} and auditor {self.auditor} are not two ranks of {world}")
        plan = butterfly_plan(self.numel, world, self.block, self.piece_numel)
        if len(self.aggregates) != plan.pieces or len(self.row_roots) != plan.pieces or not \
                0 <= self.piece < plan.pieces:
            raise ValueError(f"piece {self.piece} of {len(self.aggregates)} digests: the plan has {plan.pieces} pieces")
        return plan.piece(self.owner, self.piece)

    def said(self, sender: int, receiver: int, payload_digest: bytes) -> bytes:
        """The statement ``sender`` signs for its piece to ``receiver``."""
        a, b = self.bounds()
        return piece_statement(self.run_id, self.step, self.epoch, self.call, self.ids[sender], self.ids[receiver],
                               self.owner, self.piece, b - a, self.mode, self.block, payload_digest.hex())

    def committed(self) -> bytes:
        """The owner's commitment statement."""
        return commitment(self.run_id, self.step, self.epoch, self.call, self.ids[self.owner], self.owner,
                          len(self.ids), self.numel, self.piece_numel, self.mode, self.block, self.how, self.absent,
                          self.left, root(self.aggregates), root(self.row_roots))

    def left_out(self) -> frozenset[int]:
        """The members whose rows of the audited piece the owner left out (declared, signed)."""
        return frozenset(i for i, j in enumerate(self.left) if j <= self.piece)


Verify = Callable[[int, bytes, bytes], bool]  # (signer rank, statement, 64-byte signature) -> valid


def left_cap(world: int, absent: Collection[int]) -> int:
    """How many contributors' rows an owner may leave out of its aggregates (at a row deadline,
    ``_ButterflyRun._rows_in``): fewer than half of the contributors, so that the rows it keeps
    are a majority of the contributors' (sitters count for nothing)."""
    return (world - len(absent) - 1) // 2


class Judgement(NamedTuple):
    """What a case shows: the ``guilty`` rank and why, or nobody: then ``right`` says whether the
    owner's aggregate checked out (False: the case does not hold together, or a signature it
    needs does not verify, so it shows nothing either way)."""

    guilty: int | None
    why: str
    right: bool = False


def judge(case: Case, verify: Verify) -> Judgement:
    """Judge the audited piece. ``verify`` checks a signature by a rank of ``case.ids``; every
    verdict rests on the culprit's own signatures, never on the word of whoever presents the
    case (a row whose sender's signature does not verify could be the owner's forgery or a
    sender's trick, e.g. another certificate of its identity: it shows nothing)."""
    try:
        a, b = case.bounds()
        n, world, o = b - a, len(case.ids), case.owner
        quant.check_mode(case.mode, case.block)
        robust.check_mode(case.how)
    except ValueError as e:
        return Judgement(None, f"the case is not one ({e})")
    if len(case.rows) != world * ENTRY or len(case.payloads) != world or len(case.audit_sigs) != world \
            or any(len(d) != DIGEST for d in (*case.aggregates, *case.row_roots)) or len(case.left) != world \
            or any(not 0 <= j < 1 << 32 for j in case.left):
        return Judgement(None, "the case's lists do not fit its members")
    if not verify(o, case.committed(), case.commit_sig):
        return Judgement(None, "the commitment does not carry its owner's signature")
    if case.other is not None:  # two versions of one commitment: both the owner's, or nothing
        head, sig = case.other
        ours = b"".join(case.aggregates) + pack_left(case.left) + root(case.row_roots)
        if len(head) != len(ours) or head == ours:
            return Judgement(None, "the other commitment is not another one signed by the owner")
        ds, left, rows_root = split(head, world)
        if not verify(o, commitment(case.run_id, case.step, case.epoch, case.call, case.ids[o], o, world, case.numel,
                                    case.piece_numel, case.mode, case.block, case.how, case.absent, left, root(ds),
                                    rows_root), sig):
            return Judgement(None, "the other commitment is not another one signed by the owner")
        return Judgement(o, f"signed two different commitments to its aggregates of segment {o} in call {case.call}")
    out, P = case.left_out(), len(case.aggregates)
    if any(j > P for j in case.left):  # (signed: a u32 each in its head, which members take as it comes)
        return Judgement(o, f"declared rows left out from a piece past its {P} pieces of segment {o}")
    if case.left[o] != P:
        return Judgement(o, f"declared its own rows of segment {o} left out")
    over = sorted(i for i, j in enumerate(case.left) if j < P and i not in case.absent)
    if len(over) > left_cap(world, case.absent):
        return Judgement(o, f"left out {len(over)} of the {world - len(case.absent)} contributors' rows of segment "
                            f"{o}, more than {left_cap(world, case.absent)}")
    if digest(case.rows) != case.row_roots[case.piece]:
        return Judgement(None, f"the row list is not the one committed for piece {case.piece}")
    entries = [case.rows[i * ENTRY:(i + 1) * ENTRY] for i in range(world)]
    for i, e in enumerate(entries):  # the owner lists what each sender signed to it (it checked each)
        if i in out and e != bytes(ENTRY):
            return Judgement(o, f"lists a row of {case.ids[i]} for piece {case.piece} that it declared left out")
        if i not in out and e == bytes(ENTRY):  # (nobody but the owner writes an empty entry: no signature is zeros)
            return Judgement(o, f"lists no row of {case.ids[i]} for piece {case.piece}, yet did not declare it left "
                                "out")
        if i != o and i not in out and not verify(i, case.said(i, o, e[:DIGEST]), e[DIGEST:]):
            return Judgement(None, f"the row list for piece {case.piece} holds a piece of {case.ids[i]} whose "
                                   "signature does not verify")
    rows: list[np.ndarray] = []
    want = quant.encoded_nbytes(n, case.mode, case.block)
    for i, (e, payload, sig) in enumerate(zip(entries, case.payloads, case.audit_sigs)):
        if i in out:  # (left out of the aggregate: its answer is not asked for, nor looked at)
            rows.append(np.zeros(0, np.float32))
            continue
        d = digest(payload)
        if d != e[:DIGEST]:  # not the committed row: its sender signed two pieces for one place
            if i == case.auditor or sig is None or not verify(i, case.said(i, case.auditor, d), sig):
                return Judgement(None, f"{case.ids[i]}'s piece is not the committed one, and not signed to the "
                                       "auditor")
            return Judgement(i, f"signed two different pieces {case.piece} of segment {o} (to {case.ids[o]} and to "
                                f"{case.ids[case.auditor]})")
        if len(payload) != want:
            return Judgement(None, f"{case.ids[i]}'s committed piece is {len(payload)} bytes, not {want}")
        try:
            rows.append(quant.decode(np.frombuffer(payload, np.uint8).copy(), n, case.mode, case.block))
        except ValueError:  # signed by its sender, yet no payload of its codec: the aggregate drops it
            rows.append(np.full(n, np.nan, np.float32))
    wire = robust.aggregate_piece(rows, n, case.mode, case.block, case.how, absent=frozenset(case.absent) | out)
    if digest(wire) != case.aggregates[case.piece]:
        return Judgement(o, f"its aggregate of piece {case.piece} of segment {o} is not the {case.how} of the rows it "
                            "was sent")
    return Judgement(None, f"the aggregate of piece {case.piece} is right", right=True)


@dataclass(frozen=True)
class Auditing:
    """What one call needs to audit and be audited: the context of its statements, ``sign(data)
    -> 64-byte signature`` with our key, ``verify(rank, data, signature)`` with the certificate
    each peer presented, and ``choose(pieces) -> piece`` (random: an owner must not guess it)."""

    run_id: str
    step: int
    epoch: int
    call: int
    ids: tuple[str, ...]
    sign: Callable[[bytes], bytes]
    verify: Verify
    choose: Callable[[int], int]
    nonce: bytes  # ours for this call, revealed once we hold every owner's commitment
    accepts: Callable[[int, bytes], bool]  # (rank, nonce): whether it is the one its header bound it to
    revealed: Callable[[dict[int, bytes]], None]  # told every rank's nonce once all are in


def signed_piece(ctx: Auditing, sender: int, receiver: int, segment: int, piece: int, numel: int, mode: str,
                 block: int, digest: bytes) -> bytes:
    """The statement ``sender`` signs for a piece of its own (its ``digest``) it sends
    ``receiver`` in this call."""
    return piece_statement(ctx.run_id, ctx.step, ctx.epoch, ctx.call, ctx.ids[sender], ctx.ids[receiver], segment,
                           piece, numel, mode, block, digest.hex())


class Ledger:
    """One call's audit state on one rank (thread-safe only under the caller's lock): as owner
    what it received and sent, to commit to; as auditor the owner's commitment, the drawn piece
    and the rows it asked for; for every owner the committed digests its aggregates must match."""

    def __init__(self, ctx: Auditing, rank: int, numel: int, piece_numel: int, mode: str, block: int, how: str,
                 absent: frozenset[int]) -> None:
        self.ctx, self.rank, self.world = ctx, rank, len(ctx.ids)
        self.numel, self.piece_numel, self.mode, self.block, self.how = numel, piece_numel, mode, block, how
        self.absent = tuple(sorted(absent))
        self.plan = butterfly_plan(numel, self.world, block, piece_numel)
        P, W = self.plan.pieces, self.world
        self.entries = [[b""] * W for _ in range(P)]  # ours as owner: per piece, per sender
        self.left = [P] * W  # ours as owner: per sender, the first piece whose row we left out (P: none)
        self.head_nbytes = head_nbytes(P, W)
        self.lefts: dict[int, tuple[int, ...]] = {}  # owner -> the left-out vector of the commitment we hold
        self.agg_digests: list[bytes | None] = [None] * P
        self.commit: tuple[bytes, bytes, list[bytes]] | None = None  # (digests, signature, row lists)
        self.reveals: dict[int, bytes] = {rank: ctx.nonce}  # every rank's nonce, once revealed
        self.drawn: bytes | None = None  # the pairing's draw, once every nonce is in
        self.offset = 0  # the pairing (see rotation), once drawn
        self.target = -1  # the segment we audit, once drawn
        self.auditor = -1  # who audits ours, once drawn
        self.theirs: dict[int, list[bytes]] = {}  # owner -> its committed aggregate digests
        self.received_aggs: dict[int, list[bytes]] = {}  # owner -> digests of its aggregates so far
        self.audited: tuple[list[bytes], bytes, list[bytes]] | None = None  # the target's commitment
        self.challenge: int | None = None  # the piece we ask for
        self.asked: dict[int, int] = {}  # auditor -> the piece of its target it asked us for
        # sender -> (its piece, its signature to us; None: supplied by our target, see supply)
        self.answers: dict[int, tuple[bytes, bytes | None]] = {}
        self.declined: set[int] = set()  # members that sent DECLINED as their answer: our challenge never reached them
        # owner -> the commitment we hold (head, signature): the first that verified, its own or forwarded
        self.heads: dict[int, tuple[bytes, bytes]] = {}
        self.direct: dict[int, tuple[bytes, bytes]] = {}  # owner -> the commitment it sent us itself, verified
        self.undirect: set[int] = set()  # owners whose own commitment to us did not verify
        self.versions: dict[int, list[tuple[bytes, bytes]]] = {}  # owner -> the other ones it signed that we got
        # member -> the commitment of our target it holds (head, signature), then another it got (or that one again)
        self.echoes: dict[int, tuple[tuple[bytes, bytes], tuple[bytes, bytes]]] = {}
        # the second source of answers (audit_frames): what we asked our target for (a byte per rank, 1: wanted)
        self.wants: bytes | None = None
        self.wanted: bytes | None = None  # as owner: what our auditor asked us for

    # -- as owner (each call touches its own slot: no lock needed; hashing releases the GIL) ----
    def received(self, j: int, sender: int, wire: np.ndarray | bytes, signature: bytes) -> bool:
        """``sender``'s own piece ``j`` of our segment arrived: False if ``signature`` is not its
        signature of it (we commit to what each sender signed), else it goes into our row list."""
        d = digest(wire)  # (one pass: the signed statement and the row list)
        a, b = self.plan.piece(self.rank, j)
        said = signed_piece(self.ctx, sender, self.rank, self.rank, j, b - a, self.mode, self.block, d)
        if not self.ctx.verify(sender, said, signature):
            return False
        self.entries[j][sender] = d + signature
        return True

    def own(self, j: int, wire: np.ndarray) -> None:
        """Our own row of piece ``j``, as we encoded it, goes into our row list."""
        self.entries[j][self.rank] = digest(wire) + NO_SIG

    def aggregated(self, j: int, wire: np.ndarray) -> None:
        self.agg_digests[j] = digest(wire)

    def seal(self) -> tuple[bytes, bytes, list[bytes]]:
        """Our commitment once every piece is aggregated: (head: digests, left-out vector and
        the rows' root; signature; row lists). A row left out (:attr:`left`) is listed empty,
        whatever came of it later: the list is the aggregate's, never the late row's."""
        rows = [b"".join(bytes(ENTRY) if self.left[i] <= j else e for i, e in enumerate(es))
                for j, es in enumerate(self.entries)]
        digests: list[bytes] = self.agg_digests  # type: ignore[assignment]
        rows_root = root([digest(r) for r in rows])
        said = self._said(self.rank, digests, self.left, rows_root)
        self.commit = (b"".join(digests) + pack_left(self.left) + rows_root, self.ctx.sign(said), rows)
        return self.commit

    def _said(self, owner: int, digests: Sequence[bytes], left: Sequence[int], rows_root: bytes) -> bytes:
        c = self.ctx
        return commitment(c.run_id, c.step, c.epoch, c.call, c.ids[owner], owner, self.world, self.numel,
                          self.piece_numel, self.mode, self.block, self.how, self.absent, left, root(digests),
                          rows_root)

    # -- as member ---------------------------------------------------------------------
    def committed(self, owner: int, head: bytes, signature: bytes, via: int | None = None) -> str | None:
        """An owner's commitment arrived (``head``: its digests and rows' root), from the owner
        itself or forwarded by member ``via``; why it is no commitment of the owner's, or none we
        may hold (None: it is). The first that verifies is the one we hold (:attr:`heads`); any
        other the owner signed is kept (:attr:`versions`), as evidence that it signed two; our
        echo carries the held one and one other (the owner's own first, if the held one was
        forwarded)."""
        held, (ds, left, _) = self.heads.get(owner), split(head, self.world)
        if held != (head, signature) and not self._verifies(owner, head, signature):
            if via is None:
                self.undirect.add(owner)
            return "a commitment its signature does not cover"
        if via is None:
            self.direct[owner] = (head, signature)
        if held is None:  # (aggregates it sent us before that contradict it: see contradicted())
            self.theirs[owner], self.heads[owner], self.lefts[owner] = ds, (head, signature), left
            return None
        if held != (head, signature) and (head, signature) not in self.versions.setdefault(owner, []):
            self.versions[owner].append((head, signature))
        return None

    def _verifies(self, owner: int, head: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is ``owner``'s on the commitment ``head``."""
        ds, left, rows_root = split(head, self.world)
        return self.ctx.verify(owner, self._said(owner, ds, left, rows_root), signature)

    def may_reveal(self) -> bool:
        """Whether our nonce may go out: we hold every owner's commitment (ours included), so no
        owner learns the pairing before it is bound to its aggregates."""
        return self.commit is not None and len(self.heads) == self.world - 1

    def revealed(self, rank: int, nonce: bytes) -> str | None:
        """``rank``'s nonce arrived, from it or forwarded; why it is not the one its header bound
        it to (None: it is, or we hold it already). With every nonce in, the pairing is drawn."""
        if rank in self.reveals:
            return None
        if len(nonce) != DIGEST or not self.ctx.accepts(rank, nonce):
            return "a nonce that is not the one its header committed to"
        self.reveals[rank] = nonce
        if len(self.reveals) == self.world:
            c = self.ctx
            self.drawn = draw(c.run_id, c.step, c.epoch, c.call, [self.reveals[r] for r in range(self.world)])
            self.offset = pairing.rotation(self.drawn, self.world)
            self.target = audited_by(self.rank, self.world, self.offset)
            self.auditor = auditor_of(self.rank, self.world, self.offset)
            c.revealed(dict(self.reveals))
        return None

    def rows_of_target(self, rows: list[bytes]) -> str | None:
        """Our target's row lists arrived (after the draw); why they are not the committed ones
        (None: they are, and we draw the piece we check)."""
        ds, sig = self.theirs[self.target], self.heads[self.target][1]
        if root([digest(r) for r in rows]) != self.heads[self.target][0][-DIGEST:]:
            return "row lists that are not the ones it committed"
        self.audited = (ds, sig, rows)
        self.challenge = self.ctx.choose(self.plan.pieces)
        return None

    def decide(self, gone: Collection[int]) -> bool:
        """Whether what we ask our target for is settled (under the caller's lock): once the
        answer (unless our target left its row out, or the member declined: :attr:`declined`)
        and echo of every member but the ``gone`` (whose links to us carry no more audit frames)
        are in, and the target's own answer (unless it is gone), the rows of the members
        whose answers have not come (nothing once all came; never the target's own row: nobody
        else holds it)."""
        if self.wants is not None:
            return True
        if self.challenge is None:
            return False
        others = [r for r in range(self.world) if r not in (self.rank, self.target)]
        out = self.out_of_challenge()
        lacking = [r for r in others if r not in self.answers and r not in out]
        if any(r not in gone and r not in self.declined for r in lacking) or \
                any(r not in self.echoes and r not in gone for r in others) or \
                self.target not in self.answers and self.target not in gone:
            return False
        self.wants = bytes(int(r in lacking) for r in range(self.world))
        return True

    def out_of_challenge(self) -> frozenset[int]:
        """The members whose rows of the piece we check our target declared left out (their
        answers are not waited for, asked for, nor judged)."""
        left = self.lefts[self.target]
        return frozenset(i for i, j in enumerate(left) if j <= self.challenge)  # type: ignore[operator]

    def answered(self) -> bool:
        """Whether every member's piece for our audit is in (answered, or supplied by our
        target), but those our target left out."""
        out = self.out_of_challenge()
        return all(r in self.answers or r in out for r in range(self.world) if r != self.rank)

    def want(self, rows: bytes) -> str | None:
        """As owner: what our auditor asks us for arrived (a byte per rank); why it is not a
        request we can serve (None: it is)."""
        if any(v > 1 for v in rows) or rows[self.rank] or rows[self.auditor]:
            return "a request for rows that is none (a byte 0 or 1 per member, neither ours nor its own)"
        self.wanted = rows
        return None

    def supply(self, r: int, payload: bytes) -> bool:
        """Member ``r``'s row of the piece we check, as our target supplied it: kept as ``r``'s
        answer if it is the row the target committed to (its sender's signature is in the row
        list), unless ``r``'s own has come; False if it is not the committed one."""
        _, _, rows = self.audited  # type: ignore[misc]
        entry = rows[self.challenge][r * ENTRY:(r + 1) * ENTRY]  # type: ignore[index]
        if digest(payload) != entry[:DIGEST]:
            return False
        self.answers.setdefault(r, (payload, None))
        return True

    def got(self, owner: int, j: int, wire: np.ndarray) -> bool:
        """An owner's aggregate of piece ``j`` arrived on its link, in order (its commitment
        comes before its last); False: it is not the one the owner committed to."""
        d = digest(wire)
        self.received_aggs.setdefault(owner, []).append(d)
        return owner not in self.theirs or self.theirs[owner][j] == d

    def contradicted(self, owner: int) -> list[int]:
        """The pieces whose aggregates the owner sent us before the commitment we hold are not
        the committed ones."""
        ds = self.theirs.get(owner, ())
        return [j for j, d in enumerate(self.received_aggs.get(owner, ())) if j < len(ds) and d != ds[j]]

    def other_version(self) -> tuple[bytes, bytes] | None:
        """Another commitment of our target, signed by it, that a member got or we did (None: none)."""
        head, _ = self.heads[self.target]
        theirs = [*(v for e in self.echoes.values() for v in e), *self.versions.get(self.target, ())]
        direct = self.direct.get(self.target)
        for other, sig in theirs + ([] if direct is None else [direct]):
            if other != head and len(other) == len(head) and self._verifies(self.target, other, sig):
                return other, sig
        return None

    def case(self, own_wire: bytes, other: tuple[bytes, bytes] | None = None) -> Case:
        """The audited piece as a :class:`Case` (``own_wire``: our own piece, as we sent it;
        ``other``: another commitment of the owner's, as a member got it)."""
        ds, sig, rows = self.audited  # type: ignore[misc]
        j, o, out = self.challenge, self.target, self.out_of_challenge()
        payloads = tuple(b"" if i in out else own_wire if i == self.rank else self.answers[i][0]
                         for i in range(self.world))
        sigs = tuple(None if i == self.rank or i in out else self.answers[i][1] for i in range(self.world))
        return Case(self.ctx.run_id, self.ctx.step, self.ctx.epoch, self.ctx.call, self.ctx.ids, o, self.rank,
                    j, self.numel, self.piece_numel, self.mode, self.block, self.how, self.absent,  # type: ignore[arg-type]
                    self.lefts[o], tuple(ds), tuple(digest(r) for r in rows), sig, rows[j], payloads, sigs, other)


# ---- the case as a barrier report carries it ------------------------------------------------------
def to_wire(case: Case) -> dict:
    """The case as JSON-ready fields for the coordinator (which knows the run, the members'
    order and their certificates itself)."""
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return {"step": case.step, "epoch": case.epoch, "call": case.call, "owner": case.owner, "auditor": case.auditor,
            "piece": case.piece, "numel": case.numel, "piece_numel": case.piece_numel, "mode": case.mode,
            "block": case.block, "how": case.how, "absent": list(case.absent), "left": list(case.left),
            "aggregates": [d.hex() for d in case.aggregates], "row_roots": [d.hex() for d in case.row_roots],
            "commit_sig": case.commit_sig.hex(), "rows": b64(case.rows), "payloads": [b64(p) for p in case.payloads],
            "audit_sigs": [None if s is None else s.hex() for s in case.audit_sigs],
            "other": None if case.other is None else [case.other[0].hex(), case.other[1].hex()]}


def from_wire(ev: Any, run_id: str, ids: Sequence[str]) -> Case:
    """A :class:`Case` from a parsed report field (``ev``: its attributes as :func:`to_wire`
    writes them; ValueError if they do not decode)."""
    try:
        unb64 = lambda s: base64.b64decode(s, validate=True)  # noqa: E731
        return Case(run_id, ev.step, ev.epoch, ev.call, tuple(ids), ev.owner, ev.auditor, ev.piece, ev.numel,
                    ev.piece_numel, ev.mode, ev.block, ev.how, tuple(ev.absent), tuple(ev.left),
                    tuple(bytes.fromhex(d) for d in ev.aggregates), tuple(bytes.fromhex(d) for d in ev.row_roots),
                    bytes.fromhex(ev.commit_sig), unb64(ev.rows), tuple(unb64(p) for p in ev.payloads),
                    tuple(None if s is None else bytes.fromhex(s) for s in ev.audit_sigs),
                    None if ev.other is None else (bytes.fromhex(ev.other[0]), bytes.fromhex(ev.other[1])))
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the audit does not decode ({e})") from None


def reportable(case: Case) -> bool:
    """Whether a coordinator takes the case: at most ``MAX_CASE_RANKS`` members, each piece at
    most ``MAX_EVIDENCE_BYTES`` and the whole at most ``MAX_CASE_BYTES`` as JSON."""
    size = 4 * (len(case.rows) + sum(len(p) for p in case.payloads)) // 3 + \
        140 * (len(case.aggregates) + len(case.row_roots)) + 200 * len(case.ids) + 1024
    return len(case.ids) <= MAX_CASE_RANKS and size <= MAX_CASE_BYTES and \
        all(len(p) <= MAX_EVIDENCE_BYTES for p in case.payloads)
