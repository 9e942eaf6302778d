"""The audits' share of a butterfly call (:mod:`.audit`): the frames each rank sends and reads
for them on the mesh's links, and the auditor's verdict before its last bytes leave.

A mixin of :class:`~.butterfly._ButterflyRun`, whose sender and receiver threads call these
steps in the frame order of docs/net.md; it uses the run's ``ledger`` (:class:`~.audit.Ledger`),
plan, links, codec and condition variable.
"""

from __future__ import annotations

import numpy as np

from intellect_jax.net import quant
from intellect_jax.net.audit import DIGEST, ENTRY, audited_by, judge, signed_piece
from intellect_jax.net.errors import AuditFailed, FrameError
from intellect_jax.net.evidence import SAT_OUT, SIG_BYTES, digest
from intellect_jax.net.frames import MsgType
from intellect_jax.net.ring import Finding


class AuditFrames:
    """The audit steps of one butterfly call (see the module docstring)."""

    def _audit_sends(self, conn, o: int) -> bool:  # noqa: ANN001
        """Our commitment (row lists too if ``o`` audits us), our challenge, our piece that
        ``o`` asked for and the commitment we got from the owner ``o`` audits; then wait until
        our own audit has every piece and every such commitment, and judge (False: failed)."""
        led = self.ledger
        assert led is not None
        if not self.wait_for(lambda: led.commit is not None, "our commitment"):
            return False
        head, sig, rows = led.commit  # type: ignore[misc]
        conn.send(MsgType.DATA, head, deadline=self.deadline)
        conn.send(MsgType.DATA, sig, deadline=self.deadline)
        if o == led.auditor:
            for r in rows:
                conn.send(MsgType.DATA, r, deadline=self.deadline)
        if not self.wait_for(lambda: led.challenge is not None, f"the commitment of rank {led.target}"):
            return False
        conn.send(MsgType.DATA, np.uint32(led.challenge).tobytes(), deadline=self.deadline)
        if not self.wait_for(lambda: o in led.asked, f"rank {o}'s challenge") or not self._answer(conn, o):
            return False
        t = audited_by(o, self.world, led.ctx.step, led.ctx.call)
        if t != self.rank:  # the commitment we got from o's target, so that o sees any other version
            if not self.wait_for(lambda: t in led.heads, f"the commitment of rank {t}"):
                return False
            for frame in led.heads[t]:
                conn.send(MsgType.DATA, frame, deadline=self.deadline)
        if not self.wait_for(lambda: len(led.answers) == self.world - 1 and len(led.echoes) == self.world - 2,
                             "the pieces of our audit"):
            return False
        self._judge()
        return True

    def _answer(self, conn, o: int) -> bool:  # noqa: ANN001
        """Our piece that auditor ``o`` asked for, signed to it (our own row as we used it, if
        ``o`` audits our segment)."""
        led = self.ledger
        assert led is not None
        seg, j = audited_by(o, self.world, led.ctx.step, led.ctx.call), led.asked[o]
        a, b = self.plan.piece(seg, j)
        own = seg == self.rank
        if own:
            payload = np.ascontiguousarray(self.x[a:b], np.float32).tobytes()
        else:
            wire = self._encode(seg, j)
            payload = wire.tobytes()
            self.ws.release(wire)
        said = signed_piece(led.ctx, self.rank, o, seg, j, b - a, "fp32" if own else self.mode,
                            1 if own else self.block, digest(payload))
        conn.send(MsgType.DATA, payload, deadline=self.deadline)
        conn.send(MsgType.DATA, led.ctx.sign(said), deadline=self.deadline)
        return True

    def _audit_receives(self, conn, o: int) -> None:  # noqa: ANN001
        """Rank ``o``'s commitment, its challenge (what it audits), its piece for our audit and
        (unless ``o`` is the owner we audit) the commitment it got from that owner."""
        led, P = self.ledger, self.plan.pieces
        assert led is not None
        head = self._frame(conn, P * DIGEST + DIGEST)
        sig = self._frame(conn, SIG_BYTES)
        rows = [self._frame(conn, self.world * ENTRY) for _ in range(P)] if o == led.target else None
        with self.cond:
            bad = led.committed(o, head, sig, rows)
            self.cond.notify_all()
        if bad:
            raise FrameError(f"rank {o} sent {bad}")
        j = int(np.frombuffer(self._frame(conn, 4), np.uint32)[0])
        if j >= P:
            raise FrameError(f"rank {o} asks for piece {j} of {P}")
        with self.cond:
            led.asked[o] = j
            self.cond.notify_all()
        if not self.wait_for(lambda: led.challenge is not None, f"the commitment of rank {led.target}"):
            return
        a, b = self.plan.piece(led.target, led.challenge)  # type: ignore[arg-type]
        n = 4 * (b - a) if o == led.target else quant.encoded_nbytes(b - a, self.mode, self.block)
        payload, sig = self._frame(conn, n), self._frame(conn, SIG_BYTES)
        own = o == led.target
        said = signed_piece(led.ctx, o, self.rank, led.target, led.challenge, b - a,  # type: ignore[arg-type]
                            "fp32" if own else self.mode, 1 if own else self.block, digest(payload))
        if not led.ctx.verify(o, said, sig):
            raise FrameError(f"rank {o}: the signature of its answer to our audit does not verify")
        if own:  # the owner's own row, which nobody else ever sees: checked like every other row
            row = np.frombuffer(payload, np.float32)
            why = (SAT_OUT if row.any() else None) if o in self.absent else \
                self.inspect(row) if self.inspect is not None else None
            if why:
                with self.cond:
                    if not any(r == o for r, _ in self.findings):
                        self.findings.append((o, Finding(why, led.target, led.challenge,  # type: ignore[arg-type]
                                                         b - a, payload, sig,
                                                         "fp32", 1)))
        echo = None if o == led.target else (self._frame(conn, P * DIGEST + DIGEST), self._frame(conn, SIG_BYTES))
        with self.cond:
            led.answers[o] = (payload, sig)
            if echo is not None:
                led.echoes[o] = echo
            self.cond.notify_all()

    def _frame(self, conn, n: int) -> bytes:  # noqa: ANN001
        """The next data frame, of exactly ``n`` bytes."""
        hdr = conn.recv_header(MsgType.DATA, deadline=self.deadline, length=n)
        buf = bytearray(n)
        conn.recv_payload_into(hdr, buf, deadline=self.deadline)
        return bytes(buf)

    def _judge(self) -> None:
        """Our audit, before any of our aggregates leaves (once; every sender calls it): the
        case, and :class:`AuditFailed` if it shows a member at fault, so that no rank completes."""
        led = self.ledger
        assert led is not None
        with self.judging:
            if self.judged is None:
                wire = self._encode(led.target, led.challenge)  # type: ignore[arg-type]
                case = led.case(wire.tobytes(), led.other_version())
                self.ws.release(wire)
                self.judged = judge(case, led.ctx.verify)
                if self.judged.guilty is not None:
                    self.verdict = (self.judged.guilty, self.judged.why, case)
        if self.verdict is not None:
            raise AuditFailed(f"our audit of rank {led.target}'s segment shows rank {self.verdict[0]} at fault: "
                              f"{self.verdict[1]}")
        if not self.judged.right:  # it shows nothing either way: what cannot be checked is not applied
            raise AuditFailed(f"our audit of rank {led.target}'s segment is inconclusive: {self.judged.why}")
