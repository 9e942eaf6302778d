"""The audits' share of a butterfly call (:mod:`.audit`): the frames each rank sends and reads
for them on the mesh's links, and the auditor's verdict before its last bytes leave.

They are :attr:`~.frames.MsgType.AUDIT` frames, sent between a rank's aggregates as soon as
each is ready (:meth:`AuditFrames._audit_out`), so the audit's round trips (commitment, then
nonces, then challenge, then answers) overlap the gather rather than follow it; those not out by the last
aggregate go before its tail, and every one must be in before that tail is read.

An answer has a second source: the owner of the audited segment holds every member's row of
it, signed to it by its sender and listed in its signed row lists, and keeps them until its
auditor's challenge (then the challenged piece's only). Once the answer and echo of every
member whose link to it has not ended are in (:meth:`~.audit.Ledger.decide`), the auditor asks
its target for the rows of the members whose answers have not come (an empty request if all
came), takes each supplied row that is the committed one as that member's answer, and judges
without the echoes of the members whose links ended (or went out of step in this bucket:
``_ButterflyRun.resync``). So a member that withholds its answer or echo, its next frame then
out of step, stalls nobody. The target reads the request back before the rows, unless the
auditor's link to it ended before the request came (the auditor is then out of step already);
a member answers an auditor's challenge, or, if that auditor's link to it ended, went out of
step or (on probation) stands quiet before the challenge came, sends :data:`DECLINED` in its
place, and the auditor takes its row from the target.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

import numpy as np

from intellect_jax.net import quant
from intellect_jax.net.audit import DIGEST, ENTRY, judge, passed, signed_piece
from intellect_jax.net.pairing import audited_by, forwarders
from intellect_jax.net.errors import AuditFailed, AuditFrameError, FrameError
from intellect_jax.net.evidence import SAT_OUT, SIG_BYTES, digest
from intellect_jax.net.frames import MsgType
from intellect_jax.net.ring import Finding


ANSWER = -1  # the length of an answer to our audit: known once we have drawn our challenge
# in place of an answer whose challenge never reached us (the auditor's link to us ended, went out of step, or it
# is on probation and quiet): our link to it stays in step, and it takes our row from its target (a constant no
# answer is but by a 2^-128 chance)
DECLINED = digest(b"intellect_jax: no answer, the challenge never came")[:16]


class Unsigned(FrameError):
    """An answer to our audit whose signature does not verify, or of another size than the
    piece's (one of :data:`DECLINED`'s size): another frame read as one (the link out of step:
    its sender withheld the answer) or a bad one, which proves nothing either way. Like a
    frame out of place, it ends that sender's share of the bucket on the link, and the answer
    comes from the owner we audit (:meth:`~.audit.Ledger.decide`)."""


class AuditFrames:
    """The audit steps of one butterfly call (see the module docstring)."""

    audit_sent: dict[int, int]  # link to rank o -> how many of its audit steps went out

    def _audit_out(self, conn, o: int, wait: bool) -> bool:  # noqa: ANN001
        """Send rank ``o`` the audit frames that are ready, in their order: our commitment, the
        commitment we hold of each owner we forward to ``o`` (:func:`~.pairing.forwarders`),
        our nonce (once we hold every owner's commitment), the nonce of each member we forward
        to ``o``, our row lists if the draw makes
        ``o`` our auditor, our challenge, our piece that ``o`` asked for, our echo of the
        owner ``o`` audits (:meth:`_echo_to`), what we ask ``o`` for if we audit it
        (:meth:`_want_from`), and what it asked us for if it audits us (:meth:`_supply`). With
        ``wait``, all of them, each waited for (False: the call failed meanwhile)."""
        led = self.ledger
        assert led is not None
        drawn = lambda: led.drawn is not None  # noqa: E731
        others = [t for t in range(self.world) if t not in (o, self.rank) and
                  self.rank in forwarders(t, o, self.world)]
        steps = [(lambda: led.commit is not None, "our commitment", lambda: self._commit_to(conn))]
        steps += [(lambda t=t: t in led.heads, f"rank {t}'s commitment",  # type: ignore[misc]
                   lambda t=t: all(self._audit_frame(conn, f) for f in led.heads[t])) for t in others]
        steps += [(led.may_reveal, "every owner's commitment", lambda: self._audit_frame(conn, led.ctx.nonce))]
        steps += [(lambda t=t: t in led.reveals, f"rank {t}'s nonce",  # type: ignore[misc]
                   lambda t=t: self._audit_frame(conn, led.reveals[t])) for t in others]
        steps += [(drawn, "every member's nonce", lambda: self._rows_to(conn, o)),
                  (lambda: led.challenge is not None, "the row lists of the segment we audit",
                   lambda: self._audit_frame(conn, np.uint32(led.challenge).tobytes() + led.drawn)),
                  (lambda: o in led.asked or o in self._gone(o != led.auditor), f"rank {o}'s challenge",
                   lambda: self._answer(conn, o)),
                  (lambda: drawn() and self._echoable(audited_by(o, self.world, led.offset)),
                   "the commitment of the segment it audits", lambda: self._echo_to(conn, o)),
                  (lambda: drawn() and (o != led.target or self._decided()),
                   "the answers and echoes of our audit", lambda: self._want_from(conn, o)),
                  (lambda: drawn() and (o != led.auditor or led.wanted is not None or o in self._gone(False)),
                   f"rank {o}'s request for rows", lambda: self._supply(conn, o))]
        done = self.audit_sent.setdefault(o, 0)
        for ready, what, send in steps[done:]:
            if wait:
                if not self.wait_for(ready, what):
                    return False
            else:
                with self.cond:
                    if not ready():
                        return True
            if send() is False:
                return False
            done = self.audit_sent[o] = done + 1
        return True

    def _audit_end(self, conn, o: int) -> bool:  # noqa: ANN001
        """Every audit frame still due to ``o``; then wait until our own audit has every piece
        (answered, or supplied by our target; none of a member whose row our target declared
        left out of it) and every commitment echoed to us by a member whose
        link to us has not ended, and judge (False: the call failed meanwhile)."""
        led = self.ledger
        assert led is not None
        if not self._audit_out(conn, o, wait=True):
            return False
        others = [r for r in range(self.world) if r not in (self.rank, led.target)]

        def complete() -> bool:
            gone = self._gone()
            return led.answered() and all(r in led.echoes or r in gone for r in others)

        if not self.wait_for(complete, "the pieces of our audit"):
            return False
        self._judge()
        return True

    def _audit_frame(self, conn, payload: bytes) -> bool:  # noqa: ANN001
        conn.send(MsgType.AUDIT, payload, deadline=self.deadline)
        return True

    def _commit_to(self, conn) -> bool:  # noqa: ANN001
        led = self.ledger
        assert led is not None and led.commit is not None
        head, sig, _ = led.commit
        return self._audit_frame(conn, head) and self._audit_frame(conn, sig)

    def _rows_to(self, conn, o: int) -> bool:  # noqa: ANN001
        """Our row lists, if the draw makes ``o`` our auditor."""
        led = self.ledger
        assert led is not None and led.commit is not None
        return all(self._audit_frame(conn, r) for r in (led.commit[2] if o == led.auditor else ()))

    def _echo_to(self, conn, o: int) -> bool:  # noqa: ANN001
        """The owner ``o`` audits, as we know it (nothing if that owner is us): the commitment we
        hold, whose aggregates we apply, then the one it sent us itself if that is another
        (else any other it signed that we got, else the held one again). So ``o`` sees every
        version an honest member applies, however it came (a forwarder in league with the owner
        can bring us another than the owner sent the rest), and any other we were sent."""
        led = self.ledger
        assert led is not None
        t = audited_by(o, self.world, led.offset)
        if t == self.rank:
            return True
        held = led.heads[t]
        other = next((v for v in (led.direct.get(t), *led.versions.get(t, ())) if v is not None and v != held), held)
        return all(self._audit_frame(conn, f) for f in (*held, *other))

    def _echoable(self, t: int) -> bool:
        """Whether we may echo owner ``t``'s commitment: the one it sent us itself, or, if it
        sent us none that verified (or its link to us carries no more audit frames), the one we
        hold from another member (:meth:`_echo_to`)."""
        led = self.ledger
        assert led is not None
        return t == self.rank or t in led.direct or t in led.heads and (t in led.undirect or t in self._gone())

    def _gone(self, probation: bool = True) -> set[int]:
        """(Under ``cond``.) The ranks whose links to us carry no more audit frames of this
        bucket, or none we wait for: ended (``relay.Relay.mute``), out of step in it
        (``_ButterflyRun.resync``), or silent: senders we left out that never brought a piece
        in this call, or before any piece of theirs had come and still in step 1 once unpaced
        (``mesh.unheard_still``; a member that opened its link late, sent one piece, then went
        quiet, stalled us, found by review), or that are on probation with us (``mesh.probation``: a call failed without all
        their pieces while their links stood still), and bring nothing now (``ROW_IDLE``). Our
        audit does without their frames, and we skip our answer to their challenge (sending
        :data:`DECLINED`), or the rows they ask for, if those have not come. Never one whose
        piece came before we left it out and that is not on probation: an honest member's first pieces go out on every link at
        once, before any pacing, while a minority can hold its later ones back (a review found
        colluders taking turns to stall a member's links, so that its auditor left it out and
        did without the echo that would show its owner splitting it off; and that a frame of
        ours skipped for a link merely quiet a while put it out of step when the frame it
        answers came after all); no minority can hold them back for a whole call. Without
        ``probation``, those on probation or unheard that sent us a piece are not counted: what we owe our
        own auditor (our own answer, which nobody else holds, and the rows it asks for, which
        have no marker in its place) waits for it, since an honest auditor's challenge or
        request may come late, and without them its audit of us could not pass."""
        mesh, now = self.mesh, time.monotonic()  # type: ignore[attr-defined]
        silent = {q for q in mesh.left_out if (probation and (q in mesh.probation or  # type: ignore[attr-defined]
                                                              mesh.unheard_still(q, now)) or  # type: ignore[attr-defined]
                                               all(b.got[q] == 0 for b in mesh.buckets)) and  # type: ignore[attr-defined]
                  mesh.idle(q, now)}  # type: ignore[attr-defined]
        return mesh.mute | self.gone | silent  # type: ignore[attr-defined]

    def _decided(self) -> bool:
        """(Under ``cond``.) Whether what we ask our target for is settled
        (:meth:`~.audit.Ledger.decide`); every waiter is told when it just was."""
        led = self.ledger
        assert led is not None
        if led.wants is not None:
            return True
        if not led.decide(self._gone()):
            return False
        self.cond.notify_all()
        return True

    def _want_from(self, conn, o: int) -> bool:  # noqa: ANN001
        """What we ask our target ``o`` for (:meth:`~.audit.Ledger.decide`: the rows of the
        members whose answers to our audit have not come; nothing if ``o`` is not our target)."""
        led = self.ledger
        assert led is not None
        return o != led.target or self._audit_frame(conn, led.wants)  # type: ignore[arg-type]

    def _supply(self, conn, o: int) -> bool:  # noqa: ANN001
        """If ``o`` audits us: its request as we read it, then each member's row it asked for
        (its piece of our segment that ``o`` challenged, as the member sent it to us; each is
        checked against our row lists, which carry its sender's signature)."""
        led = self.ledger
        assert led is not None
        wanted = led.wanted
        if o != led.auditor or wanted is None:  # (None: its link to us ended before its request came,
            return True  # so it is out of step already: it reads our tail where this was due, and its link ends)
        j = led.asked[o]
        self._audit_frame(conn, wanted)
        for r in (r for r, v in enumerate(wanted) if v):
            with self.cond:
                row = self.kept_rows[j][r]
            self._audit_frame(conn, bytes(self.row_nbytes(j)) if row is None else row)
        return True

    def _answer(self, conn, o: int) -> bool:  # noqa: ANN001
        """Our piece that auditor ``o`` asked for, signed to it (our own row too, if ``o`` audits
        our segment: we encoded it like every other)."""
        led = self.ledger
        assert led is not None
        if o not in led.asked:  # (its link to us ended, went out of step, or is on probation and quiet, before
            return self._audit_frame(conn, DECLINED)  # its challenge came: keeps our link to it in step)
        seg, j = audited_by(o, self.world, led.offset), led.asked[o]
        a, b = self.plan.piece(seg, j)
        wire = self._encode(seg, j)
        payload = wire.tobytes()
        self.ws.release(wire)
        said = signed_piece(led.ctx, self.rank, o, seg, j, b - a, self.mode, self.block, digest(payload))
        self._audit_frame(conn, payload)
        self._audit_frame(conn, led.ctx.sign(said))
        return True

    def _audit_in(self, o: int) -> Generator[int, bytes, None]:
        """Rank ``o``'s audit frames, in their order: its commitment and those it forwards us,
        its nonce and those it forwards us, its row lists
        if the draw makes it the owner we audit, its challenge (with the draw it made), its
        piece for our audit, (unless ``o`` is the owner we audit) its echo of that owner's
        commitment (two: :meth:`_echo_to`), what it asks us for if it audits us, and if we audit
        it the rows it supplies (our request as it read it, then each row asked for). Yields the
        length of the next frame (:data:`ANSWER`: an answer's, or a supplied row's) and is sent
        its payload; stops early if the call fails while it waits for the draw."""
        led, P = self.ledger, self.plan.pieces
        assert led is not None
        others = [t for t in range(self.world) if t not in (o, self.rank) and
                  o in forwarders(t, self.rank, self.world)]
        for t in [o, *others]:  # its commitment, then those it forwards us (as it holds them)
            head = yield led.head_nbytes
            sig = yield SIG_BYTES
            with self.cond:
                fresh = t not in led.heads
                bad = led.committed(t, head, sig, None if t == o else o)
                wrong = led.contradicted(t) if fresh and t in led.heads else []
                if wrong and self.mesh.relaying:  # (at once: no piece of them counts as settled meanwhile)
                    self.unsettle(t, wrong)
                self.cond.notify_all()
            if wrong:  # it sent us other aggregates before: asked for by relay (butterfly.contradicted)
                self.contradicted(t, wrong, unsettled=True)
            self._bad_frame(o, t, "commitment", bad, lambda t=t: t in led.heads)  # type: ignore[misc]
        for t in [o, *others]:  # its nonce, then those it forwards us
            nonce = yield DIGEST
            with self.cond:
                bad = led.revealed(t, nonce)
                self.cond.notify_all()
            self._bad_frame(o, t, "nonce", bad, lambda t=t: t in led.reveals)  # type: ignore[misc]
        if not self.wait_for(lambda: led.drawn is not None, "every member's nonce"):
            return
        if o == led.target:
            rows = []
            for _ in range(P):
                rows.append((yield self.world * ENTRY))
            with self.cond:
                bad = led.rows_of_target(rows)
                self.cond.notify_all()
            if bad:
                raise FrameError(f"rank {o} sent {bad}")
        asked = yield 4 + DIGEST
        j = int(np.frombuffer(asked[:4], np.uint32)[0])
        if asked[4:] != led.drawn:  # a member showed different nonces (or headers) to different members
            raise FrameError(f"rank {o} audits by another draw of the pairing than ours: the members were "
                             "shown different nonces")
        if j >= P:
            raise FrameError(f"rank {o} asks for piece {j} of {P}")
        with self.cond:
            led.asked[o] = j
            self.cond.notify_all()
        if o == led.auditor:  # (of the rows we kept to supply, only the challenged piece's are still of use)
            self.drop_rows(but=j)
        payload = yield ANSWER
        if payload == DECLINED:  # our challenge never reached it (our link to it is quiet): our target supplies its row
            with self.cond:
                led.declined.add(o)
                self.cond.notify_all()
        elif led.challenge is None:
            raise FrameError(f"rank {o} answered our audit before we asked")
        else:
            yield from self._answer_in(o, payload)
        if o != led.target:  # its echo: the commitment it holds of our target, then another if it got one
            echo = ((yield led.head_nbytes), (yield SIG_BYTES)), ((yield led.head_nbytes), (yield SIG_BYTES))
            with self.cond:
                led.echoes[o] = echo
                self.cond.notify_all()
        if o == led.auditor:  # what it asks us for, for its audit of our segment
            wanted = yield self.world
            with self.cond:
                bad = led.want(wanted)
                self.cond.notify_all()
            if bad:
                raise FrameError(f"rank {o} sent {bad}")
        if o == led.target:  # the rows it supplies of those we asked it for: first what we asked, as it read it
            if (yield self.world) != led.wants:
                raise FrameError(f"rank {o} supplies other rows than we asked it for")
            for r in [r for r, v in enumerate(led.wants) if v]:  # type: ignore[arg-type]
                row = yield ANSWER
                with self.cond:
                    led.supply(r, row)  # (one that is not the committed row is left out: we go on waiting)
                    self.cond.notify_all()

    def _answer_in(self, o: int, payload: bytes) -> Generator[int, bytes, None]:
        """Rank ``o``'s answer to our audit, ``payload``, then its signature: checked, and kept
        (unless our target supplied it first)."""
        led = self.ledger
        assert led is not None
        a, b = self.plan.piece(led.target, led.challenge)  # type: ignore[arg-type]
        if len(payload) != quant.encoded_nbytes(b - a, self.mode, self.block):
            raise Unsigned(f"rank {o}: an answer to our audit of {len(payload)} bytes, expected "
                           f"{quant.encoded_nbytes(b - a, self.mode, self.block)}")
        sig = yield SIG_BYTES
        own = o == led.target
        said = signed_piece(led.ctx, o, self.rank, led.target, led.challenge, b - a,  # type: ignore[arg-type]
                            self.mode, self.block, digest(payload))
        if not led.ctx.verify(o, said, sig):  # (proves nothing to anyone: no worse than no answer)
            raise Unsigned(f"rank {o}: the signature of its answer to our audit does not verify")
        if own:  # the owner's own row, which nobody else ever sees: checked like every other row
            try:
                row = quant.decode(np.frombuffer(payload, np.uint8).copy(), b - a, self.mode, self.block)
            except ValueError as e:
                why: str | None = f"an undecodable payload ({e})"
            else:
                why = (SAT_OUT if row.any() else None) if o in self.absent else \
                    self.inspect(row) if self.inspect is not None else None
            if why:
                with self.cond:
                    if not any(r == o for r, _ in self.findings):
                        self.findings.append((o, Finding(why, led.target, led.challenge,  # type: ignore[arg-type]
                                                         b - a, payload, sig)))
        with self.cond:
            led.answers.setdefault(o, (payload, sig))  # (unless our target supplied it first)
            self.cond.notify_all()

    def _bad_frame(self, o: int, t: int, what: str, bad: str | None, got: Callable[[], bool]) -> None:
        """What to do about rank ``t``'s ``what`` that did not hold (``bad``: why; None: it did),
        arrived from rank ``o``. A forwarded one is left out: another member may have forwarded
        what ``t`` signed or bound, and without it ``t`` alone is at fault. Its own that does not
        verify fails the call unless one that does comes forwarded a while after (``got``: we
        hold one): an owner that garbles its commitment or nonce to one member stalls nobody."""
        if bad is None:
            return
        if o == t:
            self.mesh.owe((self.index, what, t), AuditFrameError(f"rank {t} sent {bad}"), got)

    def _audit_read(self, conn, o: int, hdr, frames: Generator[int, bytes, None], want: int) -> int | None:  # noqa: ANN001
        """Read the audit frame ``hdr`` announces (``want``: the length :meth:`_audit_in` asked
        for) and hand it on; the length of the next one (None: that was the last)."""
        led = self.ledger
        assert led is not None
        if want == ANSWER:
            if hdr.length == len(DECLINED):  # (maybe no answer, which may come before we drew our challenge:
                want = hdr.length  # DECLINED; the reader looks, and a row supplied is checked)
            elif led.challenge is None:
                raise FrameError(f"rank {o} answered our audit before we asked")
            else:
                a, b = self.plan.piece(led.target, led.challenge)
                want = quant.encoded_nbytes(b - a, self.mode, self.block)
        if hdr.length != want:
            raise FrameError(f"rank {o}: an audit frame of {hdr.length} bytes, expected {want}")
        buf = bytearray(want)
        conn.recv_payload_into(hdr, buf, deadline=self.deadline)
        try:
            return frames.send(bytes(buf))
        except StopIteration:
            return None
        except Unsigned:  # (the link is out of step, or the answer no better than none: ends its share here)
            raise
        except FrameError as e:  # (what it says is wrong, not how it came: the call fails at once)
            raise AuditFrameError(str(e)) from None

    def _judge(self) -> None:
        """Our audit, before the tail of our last aggregate leaves (once; every sender calls it):
        the case, and :class:`AuditFailed` if it shows a member at fault, so that no rank completes."""
        led = self.ledger
        assert led is not None
        with self.judging:
            if self.judged is None:
                wire = self._encode(led.target, led.challenge)  # type: ignore[arg-type]
                with self.cond:  # (an echo or answer may still come in meanwhile, to nobody's use)
                    case = led.case(wire.tobytes(), led.other_version())
                self.ws.release(wire)
                self.judged = judge(case, led.ctx.verify)
                if self.judged.guilty is not None:
                    self.verdict = (self.judged.guilty, self.judged.why, case)
                elif self.judged.right:  # (goes with our last piece's tail: relay.py)
                    c = led.ctx
                    self.passes[self.rank] = c.sign(passed(c.run_id, c.step, c.epoch, c.call, c.ids[self.rank]))
        self.mesh.poke.set()  # type: ignore[attr-defined]
        if self.verdict is not None:
            raise AuditFailed(f"our audit of rank {led.target}'s segment shows rank {self.verdict[0]} at fault: "
                              f"{self.verdict[1]}")
        if not self.judged.right:  # it shows nothing either way: what cannot be checked is not applied
            raise AuditFailed(f"our audit of rank {led.target}'s segment is inconclusive: {self.judged.why}")
