"""Policing at a barrier: which members have to go for what they contributed.

Six rules, counted per member across barriers on its :class:`~.roster.Node`: a member whose own
pseudo-gradient checks failed (it sat out, contributing zeros) at ``sit_out_limit`` barriers in
a row is broken; a member shown to have sent a bad piece of its own contribution in ``strikes``
rounds poisons the run; a member that an audit of a butterfly owner shows at fault by its own
signatures (a forged aggregate, two commitments for one call, two different pieces signed for
one place: ``net.audit``), or that signed two versions of a piece of its contribution to an
all-gather (``net.gather``), is evicted at once and banned, since no honest member ever signs
such a thing; a member that accuses falsely ``strikes`` times is evicted; a member that withholds
its own pieces (:meth:`Police._stalls`) is evicted once most of the others have said so after
``stall_calls`` failed calls in a row; a member whose own rows most of the others show outsized
against the rest of their pieces (:meth:`Police._steering`, each piece re-weighed on its rows'
own signatures) is evicted at once.

Absence cannot be signed, so the evidence of a stall is a quorum of witnesses. After a failed
butterfly call every member reports whose own pieces never all reached it as a segment owner
(``Report.missing``); in that exchange a failure on one link cuts nobody's pieces short on the
others (``net.butterfly``, ``net.mesh``), so an honest member's pieces reach every honest owner
whatever else failed, and only a member that withheld them, or could not deliver them before the
deadline, is named by most others. A minority of liars cannot reach that quorum against an
honest member, and when half the ring or more would be named (a partition, not a staller)
nobody is.

An accuser must show the accused's own piece (:func:`weigh`, ``net.evidence``). In a run with
identities that piece carries the accused's signature over a statement naming the accuser as its
receiver, and the coordinator re-runs the verdict on it: the accusation stands on what the
accused itself signed, so when the verdict is clear-cut (non-finite or undecodable values, any
value from a member that declared it sits the round out) one such round counts as a strike
whoever else saw it; a magnitude verdict (an RMS above 10x the outer params') is a heuristic an
unusual honest piece could meet, so it counts only in a round whose average most members found
bad, as before. The accuser can
be any member of the reported epoch: in the ring only the successor receives a member's own
pieces, in the butterfly exchange every segment's owner does, and the signed receiver tells
which. An in-process run signs nothing: there only the accused's ring successor may accuse, and
a blame counts only in a round whose average most members found bad (its evidence is the
accuser's word, so the damage must be seen by the others). An accusation without evidence, or
with evidence that does not hold up, is false and counts against the accuser.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable

import numpy as np
from cryptography import x509

from intellect_jax.coordinator.protocol import CoordinatorConfig
from intellect_jax.coordinator.roster import Node
from intellect_jax.coordinator.holdings import EQUIVOCATED, TWO_LISTS, UNBACKED, weigh_holdings, weigh_vouches
from intellect_jax.coordinator.schema import Audit, Evidence, Holding, Steering, Vouch
from intellect_jax.net import audit, codecs, quant
from intellect_jax.net.evidence import (EVERYONE, OUTSIZE, SUSPECT_FACTOR, clear_cut, der_signature, digest, outsized,
                                        piece_statement, reference_rms, row_norm, seal, statement, verdict)
from intellect_jax.net.identity import vouched

# the coordinator's verdict allows for float sums done in another order on the accuser's machine
LENIENCY = 0.999


def follows(ring: tuple[str, ...], accuser: str, accused: str) -> bool:
    """Whether ``accuser`` is ``accused``'s successor in ``ring`` (the node that receives its chunks)."""
    return accused in ring and accuser in ring and ring.index(accuser) == (ring.index(accused) + 1) % len(ring)


REVOKED = "the evidence's piece is signed with a revoked certificate of "  # (shows nothing, against nobody)


def weigh(ev: Evidence | None, *, run_id: str, step: int, epoch_id: int, accuser: str, accused: str,
          ca: bytes | None, recorded: str | None, sat_out: bool = False,
          revoked: Callable[[int], bool] | None = None) -> tuple[str | None, str]:
    """Whether ``ev`` shows ``accused``'s own piece in outer step ``step``'s all-reduce (epoch
    ``epoch_id``, received by ``accuser``) bad: (verdict, "") or (None, why it does not).
    ``ca``: the run authority's certificate (DER), which must have issued to ``accused`` the
    certificate that signed the piece (None: an in-process run, nothing is signed);
    ``recorded``: the hash the run recorded for ``step``, which the scale must open;
    ``sat_out``: the accused declared it sits that all-reduce out (any value it sent is bad);
    ``revoked(serial)``: whether the authority revoked the certificate the piece was signed with
    (a key stolen and since revoked signs nothing against its identity's new certificate)."""
    if ev is None:
        return None, "no evidence"
    if (ev.step, ev.epoch) != (step, epoch_id):
        return None, f"evidence from outer step {ev.step} in epoch {ev.epoch}, not {step} in {epoch_id}"
    try:
        raw = base64.b64decode(ev.payload, validate=True)
    except (binascii.Error, ValueError):
        return None, "the evidence's piece is not base64"
    try:
        quant.check_mode(ev.mode, ev.block)
        if len(raw) != quant.encoded_nbytes(ev.numel, ev.mode, ev.block):
            return None, f"the evidence's piece is {len(raw)} bytes, not {ev.numel} values in {ev.mode}"
    except ValueError as e:
        return None, f"the evidence's codec is not one ({e})"
    if ca is not None:
        to = EVERYONE if codecs.gathered(ev.mode) else accuser  # (a gathered piece names no receiver)
        said = statement(run_id, ev.step, ev.epoch, ev.call, accused, to, ev.segment, ev.piece, ev.numel,
                         ev.mode, ev.block, raw)
        if ev.signature is None or ev.cert is None or not vouched(
                ca, ev.cert, accused, said, der_signature(bytes.fromhex(ev.signature)).hex()):
            return None, f"the evidence's piece does not carry {accused}'s signature"
        if revoked is not None and revoked(x509.load_der_x509_certificate(bytes.fromhex(ev.cert)).serial_number):
            return None, f"{REVOKED}{accused}"
    ref = None
    if ev.opening is not None:
        o = ev.opening
        if recorded is None or seal(o.core, o.numel, o.scale) != recorded:
            return None, f"the evidence's scale does not open the hash recorded for outer step {step}"
        ref = reference_rms(o.scale, o.numel)
    try:
        theirs = quant.decode(np.frombuffer(raw, np.uint8).copy(), ev.numel, ev.mode, ev.block)
    except ValueError as e:  # signed (above) yet no payload of its codec: bad on its face
        return f"an undecodable payload ({e})", ""
    why = verdict(theirs, ref, SUSPECT_FACTOR * LENIENCY, sat_out)
    return (why, "") if why else (None, "the evidence's piece is within bounds")


def weigh_audit(ev: Audit, *, run_id: str, step: int, epoch_id: int, accuser: str, ring: tuple[str, ...],
                ca: bytes | None, certs: dict[str, str]) -> tuple[str | None, str, bool]:
    """(guilty member, why, False) when the audited piece ``ev``, reported by ``accuser``, shows
    a member of ``ring`` (outer step ``step``'s all-reduce, epoch ``epoch_id``) at fault by its
    own signatures (``net.audit.judge``); else (None, why not, whether that is the reporter's
    fault: a case that is not the reporter's to make, or whose owner was right). Every
    signature is checked against the certificate its signer presented to this coordinator
    (``certs``: node -> DER, hex), which the run authority ``ca`` issued to it, never against
    one the reporter brings; a case whose signatures do not verify shows nothing either way. An
    in-process run (``ca`` None) signs nothing: no case holds."""
    if ca is None:
        return None, "an in-process run signs nothing to audit", False
    if (ev.step, ev.epoch) != (step, epoch_id):
        return None, f"the audit is of outer step {ev.step} in epoch {ev.epoch}, not {step} in {epoch_id}", True
    if len(ev.payloads) != len(ring) or not ev.auditor < len(ring) or ring[ev.auditor] != accuser:
        return None, f"the audit is not {accuser}'s in the ring of epoch {epoch_id}", True
    try:
        case = audit.from_wire(ev, run_id, ring)
    except ValueError as e:
        return None, str(e), True

    def signed(rank: int, data: bytes, sig: bytes) -> bool:
        cert = certs.get(ring[rank])
        return cert is not None and vouched(ca, cert, ring[rank], data, der_signature(sig).hex())

    guilty, why, right = audit.judge(case, signed)
    return (ring[guilty], why, False) if guilty is not None else (None, why, right)


def weigh_steering(ev: Steering, *, run_id: str, step: int, epoch_id: int, accuser: str, ring: tuple[str, ...],
                   sat_out: tuple[str, ...], ca: bytes | None, certs: dict[str, str]) -> tuple[float | None, str, bool]:
    """(ratio, "", False) when ``ev``, reported by ``accuser`` (the owner of its segment in outer
    step ``step``'s all-reduce, epoch ``epoch_id``), shows the accused's row outsized
    (``net.evidence.outsized``) against every other row it may show, each signed by its
    sender; else (None, why not, whether that is the reporter's fault: rows that are not those of
    its piece, or no outsized row in them). A row whose signature does not verify shows nothing
    either way. In-process runs (``ca`` None) sign nothing: nothing holds."""
    if ca is None:
        return None, "an in-process run signs nothing to show", False
    if (ev.step, ev.epoch) != (step, epoch_id):
        return None, f"the rows are of outer step {ev.step} in epoch {ev.epoch}, not {step} in {epoch_id}", True
    world = len(ring)
    if accuser not in ring or ev.segment != ring.index(accuser) or ev.accused not in ring or ev.accused == accuser \
            or len(ev.payloads) != world or len(ev.signatures) != world:
        return None, f"the rows are not of {accuser}'s segment in the ring of epoch {epoch_id}", True
    shown = [i for i in range(world) if i != ev.segment and ring[i] not in sat_out]
    if [i for i in range(world) if ev.payloads[i] is not None] != shown:
        return None, "the rows are not every member's but the owner's and the sitters'", True
    try:
        quant.check_mode(ev.mode, ev.block)
        want = quant.encoded_nbytes(ev.numel, ev.mode, ev.block)
    except ValueError as e:
        return None, f"the rows' codec is not one ({e})", True
    rows: dict[int, bytes] = {}
    for i in shown:
        try:
            rows[i] = base64.b64decode(ev.payloads[i], validate=True)  # type: ignore[arg-type]
        except (binascii.Error, ValueError):
            return None, f"{ring[i]}'s row is not base64", True
        if len(rows[i]) != want:
            return None, f"{ring[i]}'s row is {len(rows[i])} bytes, not {ev.numel} values in {ev.mode}", True
    norms: dict[int, float] = {}
    for i, raw in rows.items():  # (the weighing first: rows that show nothing cost no signature check)
        try:
            norms[i] = row_norm(quant.decode(np.frombuffer(raw, np.uint8).copy(), ev.numel, ev.mode, ev.block))
        except ValueError:  # signed (checked below) yet no payload of its codec: the owner could not weigh it
            norms[i] = float("nan")
    ratio = outsized(norms, ring.index(ev.accused), world)
    if ratio is None or not ratio > OUTSIZE * LENIENCY:
        return None, f"its row is not outsized ({ratio if ratio is None else round(ratio, 2)}x the median)", True
    for i, raw in rows.items():
        cert, sig = certs.get(ring[i]), ev.signatures[i]
        said = piece_statement(run_id, ev.step, ev.epoch, ev.call, ring[i], accuser, ev.segment, ev.piece, ev.numel,
                               ev.mode, ev.block, digest(raw).hex())
        if sig is None or cert is None or not vouched(ca, cert, ring[i], said, der_signature(bytes.fromhex(sig)).hex()):
            return None, f"{ring[i]}'s row does not carry its signature", False
    return ratio, "", False


def average_skipped(members: list[Node]) -> bool:
    """Whether most of barrier k's members that report on the all-reduce of outer step k say its
    average failed its checks, so that every node skipped it (data leases: its units are trained
    again). Those that took part report; so does any other holder of state k (a process that
    restarted from its checkpoint, a joiner): the verdict is part of the hashed state."""
    reports = [n.arrival.report for n in members if n.arrival.report]  # type: ignore[union-attr]
    return sum(1 for r in reports if r.avg_failed) * 2 > len(reports)


class Police:
    """The rules above; ``say`` logs an event. It knows the ring of the newest epoch formed at
    each of the last two barriers: a report at barrier k is on the all-reduce of barrier k-1's
    epoch (after a coordinator restart that ring is unknown, and accusations are ignored)."""

    def __init__(self, config: CoordinatorConfig, say: Callable[[str], None], ca: bytes | None = None) -> None:
        self.config, self._say = config, say
        self.ca = ca  # the run authority's certificate (DER): evidence must be signed (None: in process)
        self.revoked: Callable[[int], bool] | None = None  # (serial) -> whether the authority revoked it
        self.frauds: dict[str, str] = {}  # the last barrier's members shown at fault by an audit (banned)
        self.certs: dict[str, str] = {}  # node -> the certificate (DER, hex) it presents to this coordinator
        # barrier step -> (epoch id, ring order, members sitting that all-reduce out)
        self._rings: dict[int, tuple[int, tuple[str, ...], tuple[str, ...]]] = {}

    def formed(self, step: int, epoch_id: int, ring: tuple[str, ...], sitting_out: tuple[str, ...] = ()) -> None:
        """Barrier ``step`` formed epoch ``epoch_id`` (a retry replaces the failed epoch), in
        which ``sitting_out`` declared they contribute nothing (so must send zeros)."""
        self._rings = {k: v for k, v in self._rings.items() if k == step - 1} | {step: (epoch_id, ring, sitting_out)}

    def judge(self, step: int, members: list[Node], run_id: str = "",
              recorded: str | None = None) -> tuple[list[Node], list[tuple[Node, str]]]:
        """Count barrier ``step``'s sit-outs, blames and false accusations; returns (members kept,
        (member, why) to evict), in ring order. Every member has arrived (with its report).
        ``recorded``: the hash recorded for outer step ``step - 1``, whose all-reduce is reported."""
        reports = [(n, n.arrival.report) for n in members if n.arrival.report]  # type: ignore[union-attr]
        failed = sum(1 for _, r in reports if r.avg_failed) * 2 > len(members)
        signed = self.ca is not None  # evidence is the accused's signature, not the accuser's word
        epoch_id, ring, sat_out = self._rings.get(step - 1, (0, None, ()))
        by_id = {n.node_id: n for n in members}
        blamed: dict[str, str] = {}
        for n, r in reports:
            if ring is None:
                continue
            seen: set[str] = set()
            for pair, ev in ([(r.accused, r.evidence)] if r.accused else []) + [(a.accused, a.evidence)
                                                                                for a in r.more or ()]:
                accused, why = pair
                if accused in seen:  # (one accusation of each member per report)
                    continue
                seen.add(accused)
                self._blame(n, accused, why, ev, blamed, failed=failed, step=step, epoch_id=epoch_id, ring=ring,
                            sat_out=sat_out, by_id=by_id, run_id=run_id, recorded=recorded)
        self.frauds = frauds = self._audits(step, reports, by_id, run_id)
        stalled = self._stalls(step, reports, set(by_id))
        steered = self._steering(step, reports, run_id)
        keep: list[Node] = []
        evict: list[tuple[Node, str]] = []
        for n in members:
            n.sit_outs = n.sit_outs + 1 if n.arrival.sits_out else 0  # type: ignore[union-attr]
            n.strikes += int(n.node_id in blamed and (failed or (signed and clear_cut(blamed[n.node_id]))))
            n.stalls = n.stalls + 1 if n.node_id in stalled else 0
            if n.node_id in frauds:
                why = frauds[n.node_id]
                evict.append((n, why if why.startswith((EQUIVOCATED, TWO_LISTS, UNBACKED)) else f"shown at fault by an audit: {why}"))
            elif n.node_id in steered:
                evict.append((n, f"steered the average: {steered[n.node_id]}"))
            elif n.stalls >= self.config.stall_calls:
                evict.append((n, f"stalled the all-reduce: in {n.stalls} failed calls in a row most of the others "
                                 f"said its own pieces never reached them ({stalled[n.node_id]})"))
            elif n.sit_outs >= self.config.sit_out_limit:
                evict.append((n, f"its own pseudo-gradient checks failed at {n.sit_outs} barriers in a row "
                                 f"({n.arrival.sits_out})"))  # type: ignore[union-attr]
            elif n.strikes >= self.config.strikes:
                evict.append((n, f"poisoned contributions: shown in {n.strikes} rounds "
                                 + ("with its own signed pieces" if signed else "whose average failed")
                                 + f" ({blamed.get(n.node_id)})"))
            elif n.false_accusations >= self.config.strikes:
                evict.append((n, f"false accusations: {n.false_accusations} accusations without valid evidence "
                                 "or of nodes that sent it nothing"))
            else:
                keep.append(n)
        return keep, evict

    def _blame(self, n: Node, accused: str, why: str, ev: Evidence | None, blamed: dict[str, str], *, failed: bool,
               step: int, epoch_id: int, ring: tuple[str, ...], sat_out: tuple[str, ...], by_id: dict[str, Node],
               run_id: str, recorded: str | None) -> None:
        """Weigh ``n``'s accusation of ``accused`` (``why``, evidence ``ev``) at barrier ``step``:
        the verdict goes to ``blamed``, an accusation that does not hold counts against ``n``."""
        signed = self.ca is not None
        if not follows(ring, n.node_id, accused) and not (signed and accused in ring and accused != n.node_id):
            self._false(n, accused, why, f"is not its ring successor in epoch {epoch_id} ([{', '.join(ring)}])"
                        if not signed else f"was not in the ring of epoch {epoch_id} with it")
            return
        if accused not in by_id:
            return  # gone already: nothing to weigh it against
        try:
            guilty, flaw = weigh(ev, run_id=run_id, step=step - 1, epoch_id=epoch_id, accuser=n.node_id,
                                 accused=accused, ca=self.ca, recorded=recorded, sat_out=accused in sat_out,
                                 revoked=self.revoked)
        except Exception as e:  # noqa: BLE001 - whatever a peer sent, the barrier goes on
            guilty, flaw = None, f"it could not be checked ({type(e).__name__})"
        if guilty is None and flaw.startswith(REVOKED):  # (maybe revoked after it signed: against nobody)
            self._say(f"{n.node_id} shows a piece of {accused} signed with a certificate since revoked: "
                      "it counts for nothing")
            return
        if guilty is None:
            self._false(n, accused, why, f"its evidence does not hold: {flaw}")
            return
        if not clear_cut(blamed.get(accused, "")):  # a clear-cut verdict stands against later magnitude ones
            blamed[accused] = guilty
        if failed or (signed and clear_cut(guilty)):
            self._say(f"WARNING {n.node_id} shows {accused}'s own piece {ev.piece} of segment {ev.segment} "  # type: ignore[union-attr]
                      f"(call {ev.call}) in outer step {step - 1}'s all-reduce, signed by {accused}: {guilty}")

    def _audits(self, step: int, reports: list, by_id: dict[str, Node], run_id: str) -> dict[str, str]:
        """Members shown at fault by the audits reported at barrier ``step`` (member -> why): one
        such case is proof by the member's own signatures, so it is evicted at once. A case is on
        the all-reduce of barrier ``step - 1``'s epoch, or, with a retry of barrier ``step``, on
        the epoch that the audit failed. A case that is not its reporter's to make, or whose owner
        was right, counts against its reporter; one whose signatures do not verify is only logged."""
        frauds: dict[str, str] = {}
        for n, r in reports:
            ev = r.audit
            if ev is None or ev.step not in self._rings:
                continue
            epoch_id, ring, _ = self._rings[ev.step]
            try:
                guilty, why, false = weigh_audit(ev, run_id=run_id, step=ev.step, epoch_id=epoch_id,
                                                 accuser=n.node_id, ring=ring, ca=self.ca, certs=self.certs)
            except Exception as e:  # noqa: BLE001 - whatever a peer sent, the barrier goes on
                guilty, why, false = None, f"it could not be checked ({type(e).__name__})", False
            owner = ring[ev.owner] if ev.owner < len(ring) else f"rank {ev.owner}"
            if guilty is None:
                if false:
                    self._false(n, owner, "its aggregate", f"its audit does not hold: {why}")
                elif self.ca is not None:
                    self._say(f"WARNING {n.node_id}'s audit of {owner}'s segment shows nothing either way: {why}")
                continue
            if guilty not in frauds:  # (also one that left meanwhile: it is banned all the same)
                frauds[guilty] = why
                self._say(f"WARNING {n.node_id}'s audit of {owner}'s segment (piece {ev.piece}, call {ev.call}) in "
                          f"outer step {ev.step}'s all-reduce (epoch {epoch_id}) shows {guilty} at fault by its own "
                          f"signature: {why}")
        by_step: dict[int, tuple[list[tuple[str, Holding]], list[tuple[str, Vouch]]]] = {}  # an all-gather's
        for n, r in reports:
            for h in r.holdings or ():
                if h.step in self._rings:
                    by_step.setdefault(h.step, ([], []))[0].append((n.node_id, h))
            for v in r.vouches or ():
                if v.step in self._rings:
                    by_step.setdefault(v.step, ([], []))[1].append((n.node_id, v))
        for k, (held, vouches) in by_step.items():
            epoch_id, ring, _ = self._rings[k]
            try:
                found = weigh_holdings(held, run_id=run_id, epoch_id=epoch_id, ring=ring, ca=self.ca,
                                       revoked=self.revoked)
            except Exception as e:  # noqa: BLE001 - whatever a peer sent, the barrier goes on
                found = {}
                self._say(f"WARNING the holdings reported on outer step {k}'s all-reduce could not be checked "
                          f"({type(e).__name__})")
            try:
                unbacked = weigh_vouches(vouches, held, set(by_id), run_id=run_id, epoch_id=epoch_id, ring=ring,
                                         ca=self.ca, revoked=self.revoked)
            except Exception as e:  # noqa: BLE001 - whatever a peer sent, the barrier goes on
                unbacked = {}
                self._say(f"WARNING the digest lists reported on outer step {k}'s all-reduce could not be checked "
                          f"({type(e).__name__})")
            for origin, (why, (a, b)) in found.items():
                if origin not in frauds:
                    frauds[origin] = why
                    self._say(f"WARNING {a} and {b} hold {origin}'s signatures on two versions of its piece: {why}, "
                              f"in outer step {k}'s all-reduce (epoch {epoch_id})")
            for holder, (why, a) in unbacked.items():
                if holder not in frauds:
                    frauds[holder] = why
                    self._say(f"WARNING {a} shows {holder}'s signed digest list, which gives it away: {why}, in "
                              f"outer step {k}'s all-reduce (epoch {epoch_id})")
        return frauds

    def _steering(self, step: int, reports: list, run_id: str) -> dict[str, str]:
        """Members that more than half of the others show, at barrier ``step``, sending rows
        outsized in most pieces of their segments (``Report.steering``, on the all-reduce of
        barrier ``step - 1``'s epoch), each by one piece whose rows carry their senders'
        signatures (member -> what showed it). One owner's piece could be an honest member's odd
        one out, or one that a lying owner picked: the majority needs at least one honest owner,
        which reports only a member outsized in most of the pieces it weighed. One piece per
        accused and at most half the ring's worth of accused per reporter are weighed. Evidence
        that is not the reporter's to show counts against it as a false accusation."""
        epoch_id, ring, sat_out = self._rings.get(step - 1, (0, None, ()))
        if ring is None:
            return {}
        shown: dict[str, dict[str, float]] = {}  # accused -> reporter -> ratio
        for n, r in reports:
            seen: set[str] = set()
            for ev in r.steering or ():
                if ev.accused in seen or len(seen) >= len(ring) // 2:  # a minority steers: one piece each
                    continue
                seen.add(ev.accused)
                try:
                    ratio, why, false = weigh_steering(ev, run_id=run_id, step=step - 1, epoch_id=epoch_id,
                                                       accuser=n.node_id, ring=ring, sat_out=sat_out, ca=self.ca,
                                                       certs=self.certs)
                except Exception as e:  # noqa: BLE001 - whatever a peer sent, the barrier goes on
                    ratio, why, false = None, f"it could not be checked ({type(e).__name__})", False
                if ratio is None:
                    if false:
                        self._false(n, ev.accused, "outsized rows", f"its rows do not show it: {why}")
                    elif self.ca is not None:
                        self._say(f"WARNING {n.node_id}'s rows against {ev.accused} show nothing either way: {why}")
                    continue
                shown.setdefault(ev.accused, {})[n.node_id] = ratio
        out: dict[str, str] = {}
        for x, by in sorted(shown.items()):
            self._say(f"WARNING outer step {step - 1}'s all-reduce (epoch {epoch_id}): {len(by)} of the "
                      f"{len(ring) - 1} others ({', '.join(sorted(by))}) show {x}'s own pieces outsized, up to "
                      f"{max(by.values()):.1f}x the median row, signed by their senders")
            if 2 * len(by) > len(ring) - 1:
                out[x] = (f"{len(by)} of the {len(ring) - 1} others showed its own pieces outsized in most of their "
                          f"segments (up to {max(by.values()):.1f}x the median row, signed by it)")
        return out

    def _stalls(self, step: int, reports: list, present: set[str]) -> dict[str, str]:
        """Members named, at this retry of barrier ``step``, by most of the other members of the
        epoch whose call failed as having withheld their own pieces (member -> who named it).
        Only reports on that epoch count, one per reporter and member; nobody is named when half
        the ring or more would be, nor when a member of that epoch is not ``present`` at this
        barrier: it left, died or came back as a joiner, so the epoch broke under the call, and
        whoever aborted first on hearing so cut its own pieces short through no fault of its own."""
        epoch_id, ring, _ = self._rings.get(step, (None, (), ()))
        if set(ring) - present:
            return {}
        names: dict[str, set[str]] = {}
        for n, r in reports:
            m = r.missing
            if m is None or m.step != step or m.epoch != epoch_id or n.node_id not in ring:
                continue
            for x in set(m.nodes) & set(ring) - {n.node_id}:
                names.setdefault(x, set()).add(n.node_id)
        named = {x: by for x, by in names.items() if 2 * len(by) > len(ring) - 1}
        if named and 2 * len(named) >= len(ring):
            self._say(f"WARNING outer step {step}'s all-reduce (epoch {epoch_id}): most members say the pieces of "
                      f"{', '.join(sorted(named))} never reached them, half the ring or more: a partition, nobody "
                      "is evicted for it")
            return {}
        for x, by in sorted(named.items()):
            self._say(f"WARNING outer step {step}'s all-reduce (epoch {epoch_id}) failed: {len(by)} of the "
                      f"{len(ring) - 1} others ({', '.join(sorted(by))}) say {x}'s own pieces never reached them")
        return {x: f"{len(by)} of {len(ring) - 1} in the last" for x, by in named.items()}

    def _false(self, n: Node, accused: str, why: str, flaw: str) -> None:
        n.false_accusations += 1
        self._say(f"WARNING false accusation: {n.node_id} accused {accused} of a bad contribution ({why[:80]}) but "
                  f"{flaw}; {n.false_accusations} by {n.node_id} so far")
