"""What the ranks of a failed all-gather hold, weighed: who signed what it cannot stand behind.

In the all-gather (``net.gather``) every piece travels under its origin's signature, and before
it sums, each rank signs the digest of every contribution as it holds it (its *vouch*: per
origin, the digest of that origin's piece digests) and the vouches go round the ring. When they
differ the call fails, and each rank's retry sync shows the coordinator its holding of every
origin (each piece's digest under the origin's signature, :class:`~.schema.Holding`) and every
vouch it got that differs from its own (:class:`~.schema.Vouch`). Two rules, each on a member's
own signatures, so that no member's word decides, and each an eviction and a ban:

* :func:`weigh_holdings`: two holdings of one origin that differ in a piece, each digest under
  the origin's signature, are its own word on two versions of that piece.
* :func:`weigh_vouches`: a rank's digest lists. One that signed two for one call is convicted.
  The honest ranks' entries for an origin agree (they hold what it signed, unless it signed
  two versions), so where more than half of the ring signed one entry and a rank signed
  another, that rank lies, unless the origin's own signatures on a holding that hashes to its
  entry show it was given a second version (such a rank fails the call, since it gets the
  others' lists or misses one and times out, so it shows its holdings; of every origin, not
  only those it saw disputed, since a colluder before it may pass it none). A rank that shows
  no such holding is convicted where its report had room for it. No absence convicts anyone
  else, and no minority can make a majority.

Without the second rule a rank could sign a false digest in every call: the others would fail
every try of the step, naming nobody, and leave. Evidence signed with a revoked certificate
shows nothing (its key may be another's by now); in-process runs sign nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from itertools import islice

from cryptography import x509

from intellect_jax.coordinator.schema import Holding, Vouch
from intellect_jax.net.audit import MAX_CASE_BYTES
from intellect_jax.net.gather import MAX_CERT
from intellect_jax.net.evidence import (EVERYONE, der_signature, digest, holding_size, holding_statement,
                                        piece_statement, vouch_size)
from intellect_jax.net.identity import issued, vouched

EQUIVOCATED = "signed two versions of its piece"  # (an all-gather's origin: weigh_holdings)
UNBACKED = "signed a digest of"  # (an all-gather's rank whose digest list gives it away: weigh_vouches)
TWO_LISTS = "signed two digest lists"  # (the same)


class _Signatures:
    """Checks of origins' piece signatures in holdings, each (certificate, piece, digest,
    signature) once: honest holdings of one origin are the same, so are checked once."""

    def __init__(self, run_id: str, ca: bytes, revoked: Callable[[int], bool] | None) -> None:
        self.run_id, self.ca, self.revoked = run_id, ca, revoked
        self.seen: dict[tuple[str, int, str, str], bool] = {}

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


def _entry(h: Holding) -> str:
    """A holding's entry in a vouch: the digest of its piece digests (hex)."""
    return digest(b"".join(bytes.fromhex(d) for d in h.digests)).hex()


def weigh_vouches(vouches: list[tuple[str, Vouch]], held: list[tuple[str, Holding]], present: set[str], *,
                  run_id: str, epoch_id: int, ring: tuple[str, ...], ca: bytes | None,
                  revoked: Callable[[int], bool] | None = None,
                  budget: int = MAX_CASE_BYTES) -> dict[str, tuple[str, str]]:
    """The all-gather ranks whose signed digest lists (``vouches``: (reporter, vouch) pairs; each
    failed rank shows its own and those it got) give them away, after a failed call of epoch
    ``epoch_id`` (``ring``), with the holdings (``held``: (reporter, holding)) shown with them:
    holder -> (why, the reporter that showed its list). A list counts only under a live
    certificate issued to its holder. A holder that signed two lists for one call is convicted;
    so is one whose entry for an origin differs from the entry that more than half of the ring
    signed (the honest ranks, whose entries agree unless the origin signed two versions), where
    no holding of that origin under its signatures bears the entry out (an honest rank given the
    origin's second version holds one, and shows it) and the holder, at the barrier
    (``present``), shows none whose absence its report's room (``budget``) explains."""
    if ca is None:
        return {}
    shown: dict[tuple[int, int, str, tuple[str, ...]], str] = {}  # (step, call, holder, entries) -> reporter
    lists: dict[tuple[int, int], dict[str, set[tuple[str, ...]]]] = {}  # (step, call) -> holder -> its lists
    listed: dict[str, set[tuple]] = {}  # reporter -> the lists it showed whose signatures verify (its room)
    for reporter, v in vouches:
        key = (v.step, v.call, v.holder, tuple(v.entries))
        if v.epoch != epoch_id or reporter not in ring or v.holder not in ring or len(v.entries) != len(ring) \
                or (key, v.cert) in listed.get(reporter, ()):
            continue
        said = holding_statement(run_id, v.step, v.epoch, v.call, v.holder,
                                 digest(b"".join(bytes.fromhex(e) for e in v.entries)).hex())
        try:
            serial = issued(ca, bytes.fromhex(v.cert), v.holder)
        except ValueError:
            continue
        if serial is None or not vouched(ca, v.cert, v.holder, said, der_signature(bytes.fromhex(v.signature)).hex()):
            continue  # (shows nothing: not the holder's word)
        listed.setdefault(reporter, set()).add((key, v.cert))
        if revoked is not None and revoked(serial) or key in shown:
            continue
        shown[key] = reporter
        lists.setdefault((v.step, v.call), {}).setdefault(v.holder, set()).add(key[3])
    mine: dict[tuple[int, int, str], dict[str, Holding]] = {}  # (step, call, reporter) -> origin -> its holding
    for reporter, h in held:
        if _valid(h, epoch_id, ring, reporter):
            mine.setdefault((h.step, h.call, reporter), {}).setdefault(h.origin, h)
    backs = _Signatures(run_id, ca, None)  # (an origin's own signatures back an entry, even if revoked since)
    guilty: dict[str, tuple[str, str]] = {}
    for (step, call), by in lists.items():
        for holder, ls in by.items():
            if len(ls) > 1 and holder not in guilty:
                guilty[holder] = (f"{TWO_LISTS} for one call (call {call}) in an all-gather",
                                  shown[step, call, holder, min(ls)])
        single = {holder: next(iter(ls)) for holder, ls in by.items() if len(ls) == 1}
        held_in = {r: hs for (st, c, r), hs in mine.items() if (st, c) == (step, call)}
        for i, origin in enumerate(ring):
            if not single:
                break
            top, n = Counter(ls[i] for ls in single.values()).most_common(1)[0]
            if 2 * n <= len(ring):
                continue  # (no entry more than half of the ring signed)
            ref = next((hs[origin] for hs in held_in.values() if origin in hs and _entry(hs[origin]) == top), None)
            for holder, ls in single.items():
                if ls[i] == top or holder in guilty:
                    continue
                room = sum(vouch_size(len(k[3]), len(cert) // 2) for k, cert in listed.get(holder, ()))
                why = _unbacked(call, holder, origin, ls[i], ref, held_in.get(holder, {}), backs,
                                holder in present, budget - room)
                if why:
                    guilty[holder] = (why, shown[step, call, holder, ls])
    return guilty


def _unbacked(call: int, holder: str, origin: str, e: str, ref: Holding | None, own: dict[str, Holding],
              backs: _Signatures, present: bool, budget: int) -> str | None:
    """Why ``holder``'s entry ``e`` for ``origin``, against the ring's majority (a holding of that
    entry: ``ref``), convicts it (None: its own holding of the origin bears it out, or it is not
    judged). ``own``: its holdings of the call; ``budget``: what its report had for them."""
    if origin == holder:  # (what it sent: everyone holds it as it signed it)
        return f"{UNBACKED} its own contribution (call {call}) in an all-gather other than the one it sent"
    if not present or ref is None:
        return None  # (gone; or nobody shows the majority's holding, so not even the piece count is known)
    pieces, h = len(ref.numels), own.get(origin)
    if h is None:  # (excused where its report may have had no room left: the holdings that verify, a prefix)
        used = sum(holding_size(pieces, len(x.cert) // 2) for x in own.values()
                   if len(x.numels) == pieces and backs.piece(x, 0))
        if used + holding_size(pieces, MAX_CERT) > budget:
            return None
    elif _entry(h) == e and len(h.digests) == pieces:
        differ = list(islice((j for j, (a, b) in enumerate(zip(h.digests, ref.digests)) if a != b), 4))
        if differ and all(backs.piece(h, j) for j in differ):  # (the origin signed a second version: its fault)
            return None
    return (f"{UNBACKED} {origin}'s contribution (call {call}) in an all-gather that more than half of the ring "
            f"contradict under their signatures, and no holding of it signed by {origin} bears it out")
