"""Signed pieces: a ring contribution that can be shown to a third party (numpy only, no jax).

In the ring all-reduce a rank's first messages to its successor are its own contribution,
unsummed. The sender signs each of them: an ECDSA signature (64 raw bytes, ``r || s``) of a
:func:`statement` that binds the run, the outer step, the epoch, the call, sender and
receiver, the piece's place and codec, and the digest (BLAKE3) of its bytes. The receiver looks at
each piece (:func:`verdict`); a piece it finds bad becomes :func:`evidence` that travels with
its next barrier report with the certificate the sender presented on the ring link; the
coordinator checks that the run's authority issued it to the accused, re-checks the signature
and re-runs the same verdict on the same bytes (``coordinator.policing``): an
accusation stands on what the accused itself signed, never on the accuser's word.

The verdict needs a scale that neither side chooses: the RMS of the outer params themselves
(their norm over the square root of their number of values), which every node holds bit for
bit. No sane contribution moves the weights by many times their own size in one round, whatever
the data (a scale from recent averages would not do: with heterogeneous data the average is far
smaller than any one contribution). The state hash commits to both numbers (:func:`seal`), so
the coordinator checks them against the hash the run recorded for that outer step.

A butterfly owner, which holds every member's own piece of its segment, has a second scale: the
other rows of the same piece. A row far above their median (:func:`outsized`: a sign flip
x(N - 1), a push several times the honest norm) is no heuristic against the weights but a member
pulling the average its way; shown with every row of the piece, each signed by its sender
(:func:`outsize_evidence`), it lets the coordinator evict a member that most others show so.
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Sequence
from typing import Any, Callable

import blake3
import numpy as np
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature


SIG_BYTES = 64  # a P-256 signature as r || s, 32 bytes each
SUSPECT_FACTOR = 10.0  # a piece whose RMS is this many times the outer params' RMS is bad
SAT_OUT = "values though it sits the round out"  # the butterfly's verdict on a sitter's non-zero piece
MAX_EVIDENCE_BYTES = 1 << 20  # a piece larger than this on the wire cannot be shown (piece_numel caps it)
OUTSIZE = 2.5  # a row whose norm is this many times its piece's median row norm is outsized (outsized)
EVERYONE = "*"  # the receiver a gathered codec's piece names: it travels to every rank (no identity is "*")


def digest(data: Any) -> bytes:
    """The 32-byte BLAKE3 digest that signed statements, commitments and row lists name bytes
    by (``data``: bytes, a memoryview or a contiguous array). BLAKE3, not SHA-256: every rank
    hashes everything it sends and receives in the butterfly exchange, and BLAKE3 runs ~4x
    faster here (docs/results.md)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return blake3.blake3(data).digest()


def hasher() -> Any:
    """An incremental :func:`digest` (``update``, ``digest``)."""
    return blake3.blake3()


def statement(run_id: str, step: int, epoch: int, call: int, sender: str, receiver: str, segment: int, piece: int,
              numel: int, mode: str, block: int, payload: bytes | memoryview) -> bytes:
    """What a ring sender signs for one of its own pieces."""
    return piece_statement(run_id, step, epoch, call, sender, receiver, segment, piece, numel, mode, block,
                           digest(payload).hex())


def holding_statement(run_id: str, step: int, epoch: int, call: int, holder: str, digest: str) -> bytes:
    """What a rank of an all-gather signs once it holds every contribution: the digest (hex) of
    the digest of each contribution's piece digests, in rank order (``net.gather``)."""
    return (f"intellect_jax holding\nrun {run_id}\nouter step {step}\nepoch {epoch}\ncall {call}\nrank {holder}\n"
            f"blake3 {digest}").encode()


def piece_statement(run_id: str, step: int, epoch: int, call: int, sender: str, receiver: str, segment: int,
                    piece: int, numel: int, mode: str, block: int, digest: str) -> bytes:
    """:func:`statement` of a piece known by its :func:`digest` (hex)."""
    return (f"intellect_jax piece\nrun {run_id}\nouter step {step}\nepoch {epoch}\ncall {call}\nfrom {sender}\n"
            f"to {receiver}\nsegment {segment}\npiece {piece}\nnumel {numel}\nmode {mode}\nblock {block}\n"
            f"blake3 {digest}").encode()


def raw_signature(der: bytes) -> bytes:
    """A DER ECDSA signature as the fixed 64 bytes sent on the wire."""
    r, s = decode_dss_signature(der)
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def der_signature(raw: bytes) -> bytes:
    """The DER form of 64 raw signature bytes (``identity.verify`` takes DER)."""
    if len(raw) != SIG_BYTES:
        raise ValueError(f"a signature is {SIG_BYTES} bytes, not {len(raw)}")
    return encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))


# ---- the verdict and its scale ---------------------------------------------------------------------
def seal(core: str, numel: int, scale: float) -> str:
    """The state hash from its opening: the digest of everything else (``core``, hex), the
    number of values of the outer params and their norm (``scale``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(bytes.fromhex(core))
    h.update(np.int64(numel).tobytes())
    h.update(np.float64(scale).tobytes())
    return h.hexdigest()


def reference_rms(scale: float, numel: int) -> float | None:
    """The outer params' RMS from their norm and number of values (None: no usable scale)."""
    if not math.isfinite(scale) or scale <= 0 or numel <= 0:
        return None
    return scale / math.sqrt(numel)


def verdict(theirs: np.ndarray, ref: float | None, factor: float = SUSPECT_FACTOR, sat_out: bool = False) -> str | None:
    """Why a member's own piece is bad (None: it is not): non-finite values, values from a
    member that declared it sits the round out (``sat_out``), or an RMS above ``factor`` x
    ``ref`` (no magnitude verdict without a reference)."""
    if not np.isfinite(theirs).all():
        return "non-finite values"
    if sat_out and theirs.any():
        return SAT_OUT
    if ref is None or ref <= 0 or theirs.size == 0:
        return None
    rms = float(np.sqrt(np.mean(np.square(theirs, dtype=np.float64))))
    if rms > factor * ref:
        return f"an RMS {rms / ref:.0f}x the outer params'"
    return None


def row_norm(x: np.ndarray, scratch: np.ndarray | None = None) -> float:
    """A decoded row's L2 norm as :func:`outsized` takes it: its squares summed in float64 (exact
    squares of float32 values, summed pairwise, so that any machine agrees far within
    ``policing.LENIENCY``; inf for an infinite value, nan for a NaN). Not a BLAS dot: OpenBLAS's
    threads spin on after each call, and on a node's shared cores that cost every outer step
    about a second (docs/results.md). ``scratch``: float64, at least the row's size (else one
    is allocated)."""
    wide = np.empty(x.shape[0], np.float64) if scratch is None else scratch[:x.shape[0]]
    np.copyto(wide, x)
    with np.errstate(over="ignore", invalid="ignore"):
        np.square(wide, out=wide)
        return math.sqrt(float(np.add.reduce(wide)))


def outsized(norms: dict[int, float], accused: int, world: int) -> float | None:
    """How many times its piece's median row norm ``accused``'s row norm is (``norms``: rank ->
    :func:`row_norm` of every row an owner may show, in a ring of ``world``: not its own, none
    of a member sitting the round out), or None when there is no median to go by. The median is
    the high one (the upper middle of an even count), and there is one only when a minority of
    the ring (at most ``ceil(world / 2) - 1`` members) cannot fill the rows up to it: then
    members sending tiny rows cannot pull it below every honest row, and an honest row is at
    most the honest rows' spread above it. So no verdict with fewer than three rows, with too
    many members sitting out (at N = 8 three or more, at N = 16 two or more), or with a median
    of zero. A steering row (the issue's sign flip x(N - 1), a push 5-9x the honest norm, x1000)
    is N - 1 to 1000x."""
    vals = sorted(v for v in norms.values() if not math.isnan(v))
    if accused not in norms or math.isnan(norms[accused]) or len(vals) < 3 or \
            len(vals) // 2 < -(-world // 2) - 1:
        return None
    med = vals[len(vals) // 2]
    if not math.isfinite(med) or med <= 0:
        return None
    return norms[accused] / med


def clear_cut(why: str) -> bool:
    """Whether a verdict holds whatever the scale: values no honest node sends (not finite, not
    decodable, or any value from a member that sits the round out), unlike the magnitude
    verdict, a heuristic against the outer params' RMS."""
    return why == "non-finite values" or why == SAT_OUT or why.startswith("an undecodable payload")


# ---- evidence ----------------------------------------------------------------------------------
def evidence(*, step: int, epoch: int, call: int, segment: int, piece: int, numel: int, mode: str, block: int,
             payload: bytes, signature: bytes | None, cert: bytes | None = None) -> dict[str, Any]:
    """A bad piece as a report carries it, with the signature and the certificate (DER) the
    sender presented on the ring link (the accuser adds the state ``opening``)."""
    return {"step": step, "epoch": epoch, "call": call, "segment": segment, "piece": piece, "numel": numel,
            "mode": mode, "block": block, "payload": base64.b64encode(payload).decode(),
            "signature": None if signature is None else signature.hex(), "cert": None if cert is None else cert.hex()}


def holding_evidence(*, step: int, epoch: int, call: int, origin: str, mode: str, block: int, cert: bytes,
                     numels: tuple[int, ...], digests: tuple[bytes, ...], signatures: tuple[bytes, ...]) -> dict[str, Any]:
    """An all-gather origin's contribution as one rank held it (``net.gather.Holding``), as a
    report carries it (``coordinator.schema.Holding``)."""
    return {"step": step, "epoch": epoch, "call": call, "origin": origin, "mode": mode, "block": block,
            "cert": cert.hex(), "numels": list(numels), "digests": [d.hex() for d in digests],
            "signatures": [g.hex() for g in signatures]}


def holding_size(pieces: int, cert_bytes: int) -> int:
    """What a holding of ``pieces`` pieces with a certificate of ``cert_bytes`` counts against a
    report's budget (``MAX_CASE_BYTES``): a bound on its JSON, the same at both ends."""
    return 200 * pieces + 2 * cert_bytes


def vouch_evidence(*, step: int, epoch: int, call: int, holder: str, entries: Sequence[bytes], signature: bytes,
                   cert: bytes) -> dict[str, Any]:
    """A rank's signed digests of every all-gather contribution as it held them, with the
    certificate its signature was checked with (``net.gather.Vouch``), as a report carries it
    (``coordinator.schema.Vouch``)."""
    return {"step": step, "epoch": epoch, "call": call, "holder": holder, "entries": [e.hex() for e in entries],
            "signature": signature.hex(), "cert": cert.hex()}


def vouch_size(ranks: int, cert_bytes: int) -> int:
    """What a vouch over ``ranks`` contributions counts against a report's budget (its JSON, bounded)."""
    return 70 * ranks + 2 * cert_bytes + 400


def outsize_evidence(*, step: int, epoch: int, call: int, segment: int, piece: int, numel: int, mode: str,
                     block: int, ratio: float, payloads: Any, signatures: Any) -> dict[str, Any]:
    """An outsized row (:func:`outsized`) as a report carries it: every row of the piece its
    owner (the reporter, rank ``segment``) may show, by rank (None: its own, a sitter's), each
    with its sender's signature to the owner."""
    return {"step": step, "epoch": epoch, "call": call, "segment": segment, "piece": piece, "numel": numel,
            "mode": mode, "block": block, "ratio": ratio,
            "payloads": [None if p is None else base64.b64encode(p).decode() for p in payloads],
            "signatures": [None if s is None else s.hex() for s in signatures]}


def unsigned_evidence(theirs: np.ndarray, inspect: Callable[[np.ndarray], str | None], *, step: int, epoch: int,
                      piece_numel: int) -> tuple[str, dict[str, Any]] | None:
    """(verdict, evidence) for the first ``piece_numel`` window of a predecessor's flat input
    that ``inspect`` finds bad, or None: what an in-process ring, which sends no pieces,
    shows (fp32, unsigned: an in-process run has no identities)."""
    piece_numel = min(piece_numel, MAX_EVIDENCE_BYTES // 4)  # fp32 evidence must fit, whatever the ring's codec
    for j, a in enumerate(range(0, theirs.shape[0], piece_numel)):
        part = np.ascontiguousarray(theirs[a: a + piece_numel], np.float32)
        why = inspect(part)
        if why:
            return why, evidence(step=step, epoch=epoch, call=0, segment=0, piece=j, numel=part.size, mode="fp32",
                                 block=1, payload=part.tobytes(), signature=None)
    return None
