"""Who audits whom in a butterfly call (:mod:`.audit`): a rotation drawn from every member's
nonce once every owner has committed, so that no owner knows its auditor while it commits and
no member can choose the draw; one can only refuse it by withholding its nonce, a stall that
names nobody, after which the retry draws anew (docs/net.md, "Audits of the owners").

Each rank's call header carries the head of a hash chain (:func:`nonce_chain`, one nonce per
bucket); a rank reveals its bucket's nonce once it holds every owner's commitment, and the
digest of all of them (:func:`draw`) gives the offset (:func:`rotation`).
"""

from __future__ import annotations

from collections.abc import Sequence

from intellect_jax.net.evidence import digest, hasher


def rotation(draw: bytes, world: int) -> int:
    """The pairing's offset, ``1 .. world - 1``, from a draw (a digest): rank ``r`` audits
    segment ``r - offset`` (never its own; every rank audits exactly one)."""
    return 1 + int.from_bytes(draw[:8], "big") % (world - 1)


def auditor_of(segment: int, world: int, offset: int) -> int:
    """The rank that audits segment ``segment`` under the pairing ``offset``."""
    return (segment + offset) % world


def audited_by(rank: int, world: int, offset: int) -> int:
    """The segment that ``rank`` audits under the pairing ``offset``."""
    return (rank - offset) % world


def nonce_chain(secret: bytes, n: int) -> tuple[bytes, list[bytes]]:
    """(head, nonces) of a hash chain for ``n`` calls: nonce ``b`` is ``digest^(n-1-b)(secret)``
    and hashes to nonce ``b - 1`` (to the head for ``b`` = 0), so revealing one tells nothing of
    the next. The head goes in the call's header; nonce ``b`` is revealed in bucket ``b``."""
    chain = [secret]
    for _ in range(max(0, n - 1)):
        chain.append(digest(chain[-1]))
    chain.reverse()
    return digest(chain[0]), chain


def draw(run_id: str, step: int, epoch: int, call: int, nonces: Sequence[bytes]) -> bytes:
    """The pairing's draw from every member's nonce (rank order): nobody knows it before the
    last nonce is revealed, and no member can choose it (each nonce was fixed in its header)."""
    h = hasher()
    h.update(f"intellect_jax audit pairing\nrun {run_id}\nouter step {step}\nepoch {epoch}\ncall {call}\n".encode())
    for x in nonces:
        h.update(x)
    return h.digest()


FORWARDERS = 2  # members that forward each owner's commitment and nonce to each other member


def forwarders(owner: int, receiver: int, world: int) -> list[int]:
    """The members that forward ``owner``'s commitment and nonce to ``receiver`` (besides the
    owner itself): the next :data:`FORWARDERS` ranks after the owner but the receiver. An owner
    that garbles either to one member then stalls nobody unless both of them collude with it,
    and each member forwards about ``FORWARDERS`` of each, not ``world - 2``."""
    after = [(owner + i) % world for i in range(1, world)]
    return [r for r in after if r != receiver][:FORWARDERS]
