"""What the ranks of a failed all-gather hold, weighed: an origin that signed two versions.

In the all-gather (``net.gather``) every piece travels under its origin's signature, and before
it sums, each rank signs the digest of every contribution as it holds it and these go round the
ring. When they differ the call fails, and each rank's retry sync shows the coordinator its
holding of every origin concerned (each piece's digest under the origin's signature,
:class:`~.schema.Holding`). Two holdings of one origin that differ in a piece, each digest under
the origin's signature, are its own word on two versions of that piece (:func:`weigh_holdings`):
an eviction and a ban. Evidence signed with a revoked certificate shows nothing (its key may be
another's by now); in-process runs sign nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

from cryptography import x509

from intellect_jax.coordinator.schema import Holding
from intellect_jax.net.evidence import EVERYONE, der_signature, piece_statement
from intellect_jax.net.identity import issued, vouched

EQUIVOCATED = "signed two versions of its piece"  # (an all-gather's origin: weigh_holdings)


class _Signatures:
    """Checks of origins' piece signatures in holdings, each (certificate, piece, digest,
    signature) once: honest holdings of one origin are the same, so are checked once."""

    def __init__(self, run_id: str, ca: bytes, revoked: Callable[[int], bool] | None) -> None:
        self.run_id, self.ca, self.revoked = run_id, ca, revoked
        self.seen: dict[tuple[str, int, str, str], bool] = {}

    def live(self, h: Holding) -> bool | None:
        """Whether ``h``'s certificate was issued to its origin and is not revoked (None: revoked,
        which shows nothing either way)."""
        try:
            serial = issued(self.ca, bytes.fromhex(h.cert), h.origin)
        except ValueError:
            return False
        if serial is None:
            return False
        return None if self.revoked is not None and self.revoked(serial) else True

    def piece(self, h: Holding, j: int) -> bool:
        key = (h.cert, j, h.digests[j], h.signatures[j])
        if key not in self.seen:
            said = piece_statement(self.run_id, h.step, h.epoch, h.call, h.origin, EVERYONE, 0, j, h.numels[j], h.mode,
                                   h.block, h.digests[j])
            ok = vouched(self.ca, h.cert, h.origin, said, der_signature(bytes.fromhex(h.signatures[j])).hex())
            if ok and self.revoked is not None:
                ok = not self.revoked(x509.load_der_x509_certificate(bytes.fromhex(h.cert)).serial_number)
            self.seen[key] = ok
        return self.seen[key]

    def whole(self, h: Holding) -> bool | None:
        """Every piece of ``h`` under its origin's signature (None: its certificate is revoked)."""
        live = self.live(h)
        return live if not live else all(self.piece(h, j) for j in range(len(h.digests)))


def _valid(h: Holding, epoch_id: int, ring: tuple[str, ...], reporter: str) -> bool:
    return h.epoch == epoch_id and reporter in ring and h.origin in ring and h.origin != reporter \
        and len(h.numels) == len(h.digests) == len(h.signatures)


def weigh_holdings(held: list[tuple[str, Holding]], *, run_id: str, epoch_id: int, ring: tuple[str, ...],
                   ca: bytes | None, revoked: Callable[[int], bool] | None = None,
                   checks: int = 4) -> dict[str, tuple[str, tuple[str, str]]]:
    """The all-gather origins that signed two versions of one piece, from the holdings members
    reported after a failed call of epoch ``epoch_id`` (``ring``): (reporter, holding) pairs.
    Two reporters' holdings of one origin in one call that differ in a piece, each digest under
    the origin's signature by a certificate the run authority ``ca`` issued to it (and did not
    revoke), are its own word on two versions: origin -> (why, the two reporters). Nobody else
    can sign them, whatever a reporter claims: a holding whose signatures do not verify shows
    nothing. At most ``checks`` differing pieces are checked per pair of versions (an honest
    pair differs in the pieces signed twice alone). In-process runs (``ca`` None) sign nothing."""
    if ca is None:
        return {}
    by: dict[tuple, dict[str, Holding]] = {}  # -> each reporter's (its first) holding
    for reporter, h in held:
        if _valid(h, epoch_id, ring, reporter):
            by.setdefault((h.step, h.call, h.origin, h.mode, h.block, tuple(h.numels)), {}).setdefault(reporter, h)
    groups: dict[tuple, dict[tuple, tuple[str, Holding]]] = {}  # -> each version as shown, by one reporter
    for key, hs in by.items():
        for reporter in sorted(hs):
            h = hs[reporter]
            groups.setdefault(key, {}).setdefault((h.cert, *h.digests, *h.signatures), (reporter, h))
    sigs = _Signatures(run_id, ca, revoked)
    guilty: dict[str, tuple[str, tuple[str, str]]] = {}
    for (_, call, origin, *_), versions in groups.items():
        shown = sorted(versions.values(), key=lambda v: v[0])
        for x, (a, ha) in enumerate(shown):
            for b, hb in shown[x + 1:]:
                if origin in guilty:
                    break
                differ = list(islice((j for j, (da, db) in enumerate(zip(ha.digests, hb.digests)) if da != db),
                                     checks))
                j = next((j for j in differ if sigs.piece(ha, j) and sigs.piece(hb, j)), None)
                if j is not None:
                    guilty[origin] = (f"{EQUIVOCATED} {j} (call {call}) in an all-gather", (a, b))
    return guilty
