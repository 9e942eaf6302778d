"""The coordinator's request handling, independent of how requests arrive.

:class:`CoordinatorService` owns the :class:`~.membership.Membership` (under one condition
variable), its journal and the ticker that evicts silent nodes. ``handle(request, session,
identity=...)`` answers one JSON request, parsed by :mod:`.schema` first and served only in the
name of the connection's authenticated identity; ``sync`` and ``admit`` block until their barrier
or admission (calling ``keepalive`` every ``keepalive_interval`` meanwhile). The socket server
(:mod:`.server`) and the in-process ``LocalWire`` are thin layers over it, so the simulation
runs the very same request code as a real coordinator.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from intellect_jax.coordinator.clock import REAL, Clock
from intellect_jax.coordinator.claims import Notary
from intellect_jax.coordinator.journal import Journal, RunRecord
from intellect_jax.coordinator.membership import Membership
from intellect_jax.coordinator.protocol import (PROTOCOL, CoordinatorConfig, CoordinatorError, DataPlan, ProtocolError,
                                                RegistrationRefused)
from intellect_jax.coordinator.schema import (MAX_MESSAGE, Admit, Heartbeat, Lease, Leave, Received, Register, Request,
                                              Status, Sync, parse_request)
from intellect_jax.net.errors import NetError, PeerClosed, PeerTimeout
from intellect_jax.net.identity import verify, vote

log = logging.getLogger("intellect_jax.coordinator")
T = TypeVar("T")
Session = tuple[str, str]  # (node id, session token)


class ServiceStopped(PeerClosed):
    """The coordinator stopped (or crashed) while a request was being answered."""


def error_reply(e: CoordinatorError) -> dict[str, Any]:
    return {"ok": False, "error": type(e).__name__, "reason": e.reason[:64], "message": str(e)[:MAX_MESSAGE]}


class CoordinatorService:
    """Membership + journal + timeouts behind ``handle`` (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig | None = None, *, run_id: str = "", clock: Clock = REAL,
                 journal: Journal | None = None, instance: str | None = None,
                 on_event: Callable[[str], None] | None = None,
                 check_addr: Callable[[str], object] | None = None,
                 crl: Callable[[], tuple[int, bytes] | None] | None = None, ca: bytes | None = None,
                 revoked: Callable[[int], bool] | None = None,
                 sign: Callable[[bytes], bytes] | None = None, cert: bytes | None = None) -> None:
        """``sign``, ``cert``: the coordinator's own key and certificate (DER), with which it signs
        each barrier's record (``claims``; with ``ca``, it then takes no claim without one while it
        has no history of the run)."""
        self.config = config or CoordinatorConfig()
        self._check_addr = check_addr  # raises ValueError for a ring address nobody could dial
        self._crl = crl  # (identities revoked, PEM) of the run's revocation list in force, handed to members
        self.clock, self.journal = clock, journal
        record = journal.load(run_id) if journal is not None else RunRecord(run_id=run_id)
        self.membership = Membership(self.config, instance or os.urandom(4).hex(), record)
        self.membership.police.ca = ca  # accusations must show pieces signed under this authority
        self.membership.police.revoked = revoked  # (serial) -> revoked: a strike's certificate must not be
        if sign is not None and cert is not None and ca is not None:
            self.membership.notary = Notary(run_id, sign, cert, ca, revoked)
        self._on_event = on_event
        self._cond = clock.Condition()
        self._stopped = False
        self.failure: str | None = None  # why the service stopped itself (its journal could not be saved)
        self._awake = clock.now()  # the last time this service ran (the ticker runs every tick_interval)
        self.stalls: list[float] = []  # lengths of the stalls this service noticed (and excused)

    def start(self) -> CoordinatorService:
        self._awake = self.clock.now()
        self.clock.spawn(self._tick_loop, name=f"coordinator-tick-{self.membership.instance}")
        if self.journal is None:
            self._emit("WARNING no journal: if this coordinator restarts it forgets the run's history, and waits "
                       "for most members of the newest epoch before it lets the run go on")
        rec = self.membership.record
        if rec.hwm_step is not None:
            self._emit(f"journal: the run is at outer step {rec.hwm_step} (hash {str(rec.hwm_hash)[:16]})"
                       + (", complete" if rec.completed else ""))
        return self

    def stop(self) -> None:
        """Stop answering: every blocked request ends with :class:`ServiceStopped`."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def status(self) -> dict[str, Any]:
        return self.locked(self.membership.status)

    def locked(self, fn: Callable[[float], T]) -> T:
        """Run ``fn(now)`` on the membership under the lock; then log its events, persist the
        journal if it changed, and wake the blocked requests."""
        with self._cond:
            if self._stopped:
                raise ServiceStopped(self.failure or "coordinator stopped")
            try:
                now = self.clock.now()
                self._excuse_stall(now)
                return fn(now)
            finally:
                try:
                    for line in self.membership.drain_events():
                        self._emit(line)
                finally:  # (saved whatever an event's logging does)
                    if self.journal is not None:
                        self._persist()
                    self._cond.notify_all()

    def _persist(self) -> None:
        """(under the lock) Save the journal if the record changed. If it cannot be saved (a full
        or failing disk), stop: a coordinator running ahead of its journal would, once restarted
        on it, refuse the members' honest claims past its newest step as ahead of the run.
        Stopped at the first failed save, before anyone hears of the change (the request that
        made it and every waiter end with :class:`ServiceStopped`), the journal lacks at most
        that one change, and a restarted coordinator takes the claims of the step after its
        newest."""
        try:
            self.journal.save(self.membership.record)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - a disk's error or a bug: either way, no unsaved change goes out
            self.failure = (f"journal {getattr(self.journal, 'path', '(in memory)')}: cannot be saved ({e}); the "
                            "coordinator stops rather than run ahead of its journal (free the disk and restart it)")
            self._stopped = True
            log.error("%s", self.failure)
            self._cond.notify_all()
            raise ServiceStopped(self.failure) from None

    def _excuse_stall(self, now: float) -> None:
        """(under the lock) The ticker enters every ``tick_interval``; a longer gap since the
        service last ran means the coordinator itself could not act (SIGSTOP, swapping, a
        starved VM): nobody's deadline ran meanwhile. Logged once per stall, from 1 s up."""
        gap = now - self._awake - self.config.tick_interval
        self._awake = now
        if gap > self.config.tick_interval:
            self.membership.extend(gap)
            self.stalls.append(gap)
            if gap >= 1.0:
                self._emit(f"WARNING coordinator stalled for {gap:.1f}s (it could not act): every heartbeat, barrier "
                           "and admission deadline moved by as much")

    def _emit(self, line: str) -> None:
        (log.warning if line.startswith("WARNING") else log.info)(line.removeprefix("WARNING "))
        if self._on_event is not None:
            self._on_event(line)

    def _tick_loop(self) -> None:
        """Tick until stopped. A tick that fails is logged with its traceback the first time,
        then in one line at every power of two of failures, and the ticker goes on."""
        failures = 0
        while not self._stopped:
            self.clock.sleep(self.config.tick_interval)
            try:
                self.locked(self.membership.tick)
            except ServiceStopped:
                return
            except Exception as e:  # noqa: BLE001 - a bug must not stop every timeout of the run
                failures += 1
                if failures == 1:
                    log.exception("the membership tick failed; ticking on")
                elif failures & (failures - 1) == 0:
                    log.error("the membership tick failed %d times so far (last: %s: %s)", failures,
                              type(e).__name__, e)

    def revoke(self, node_id: str) -> None:
        """The run's operator revoked ``node_id``'s identity: it is evicted at once."""
        try:
            self.locked(lambda now: self.membership.disconnect(node_id, None, now, "identity revoked by the "
                                                               "run's operator"))
        except ServiceStopped:
            pass

    def disconnect(self, session: Session) -> None:
        """The node's session connection closed: it is evicted at once."""
        try:
            self.locked(lambda now: self.membership.disconnect(*session, now))
        except ServiceStopped:
            pass
        except Exception:  # noqa: BLE001 - a bug: logged, and the server thread ends cleanly
            log.exception("internal error evicting %s (connection lost)", session[0])

    # ---- requests ------------------------------------------------------------------------------
    def handle(self, req: dict[str, Any], session: Session | None = None,
               keepalive: Callable[[], None] | None = None, deadline: float | None = None, *,
               identity: str | None, cert: bytes | None = None) -> dict[str, Any]:
        """Answer one request. ``session``: the (node, token) of the connection it came on, if
        that connection registered; ``identity``: the node id its peer authenticated as (None:
        none), in whose name alone it may act (``status`` excepted); ``cert``: that peer's
        certificate (DER), which must have signed the state hash a ``sync`` states (the journal
        keeps the signatures; an in-process wire has none and signs nothing). A malformed request, one
        in another node's name and coordinator errors become error replies, and so does any
        other failure, logged with its traceback (``reason="internal"``). Only transport
        trouble propagates: :class:`ServiceStopped`, a ``deadline`` passed, a keepalive lost."""
        op = str(req.get("op"))[:40] if isinstance(req, dict) else "?"
        try:
            if op == "register" and type(req.get("protocol")) is int and req["protocol"] != PROTOCOL:
                # (before the strict parse: a node of another version may send fields this one lacks)
                raise RegistrationRefused(f"node {str(req.get('node'))[:128]}: protocol version {req['protocol']} "
                                          f"!= coordinator's {PROTOCOL}", "protocol")
            msg = parse_request(req)
            _check_identity(msg, session, identity)
            vote = _check_vote(msg, cert, self.membership.record.run_id)
            if cert is not None and identity is not None:  # the certificate an audit's signatures must match
                with self._cond:
                    self.membership.police.certs[identity] = cert.hex()
            return self._answer(msg, session, keepalive, deadline, vote)
        except CoordinatorError as e:
            return error_reply(e)
        except NetError:
            raise
        except Exception:  # noqa: BLE001 - a bug: logged with its traceback, answered, and the service goes on
            log.exception("internal error answering a %r request (identity %s)", op, identity)
            return error_reply(CoordinatorError(f"internal error answering a {op!r} request (in the coordinator's "
                                                "log)", "internal"))

    def _answer(self, msg: Request, session: Session | None, keepalive: Callable[[], None] | None,
                deadline: float | None, vote: tuple[str, str] | None) -> dict[str, Any]:
        m = self.membership
        match msg:
            case Status():
                return {"ok": True, "status": self.locked(m.status)}
            case Register() if session is None:
                return self._register(msg)
            case Heartbeat() if session is not None:
                reply = {"ok": True, "view": self.locked(lambda now: m.heartbeat(*session, now))}
                crl = self._crl() if self._crl is not None else None
                if crl is not None and crl[0] > (msg.crl or 0):  # a member whose list revokes fewer gets it
                    reply["crl"] = crl[1].decode()
                return reply
            case Sync() | Admit():
                return self._blocking(msg, keepalive, deadline, vote)
            case Received():
                return {"ok": True, "accepted": self.locked(lambda now: m.state_received(msg.node, msg.session,
                                                                                         msg.step, now))}
            case Leave():
                self.locked(lambda now: m.leave(msg.node, msg.session, now))
                return {"ok": True}
            case Lease():
                return {"ok": True, "units": self.locked(lambda now: m.lease(
                    msg.node, msg.session, msg.round, msg.round_steps, msg.unit_steps, msg.unit_tokens, now,
                    msg.stream))}
        raise ProtocolError(f"{msg.op!r} on a connection that {'already' if session else 'never'} registered")

    def _register(self, msg: Register) -> dict[str, Any]:
        if self._check_addr is not None:  # every member builds rings from it: one bad address fails them all
            try:
                self._check_addr(msg.addr)
            except ValueError as e:
                raise ProtocolError(f"malformed 'register' request: addr: {e}", "malformed") from None
        r = msg.resume
        resume = None if r is None else r.parsed()
        d = msg.data
        data = None if d is None else DataPlan(d.leases, d.rank, d.ranks)
        reply = self.locked(lambda now: self.membership.register(
            msg.node, msg.addr, msg.devices, msg.protocol, msg.fingerprint, now, resume, msg.founder, msg.outer_steps,
            data))
        return {"ok": True, **asdict(reply)}

    def _blocking(self, msg: Sync | Admit, keepalive: Callable[[], None] | None,
                  deadline: float | None, vote: tuple[str, str] | None = None) -> dict[str, Any]:
        """``sync`` / ``admit``: register the request, then wait for its result."""
        m, node, sess = self.membership, msg.node, msg.session
        first: Callable[[float], Any]
        poll: Callable[[], Any]
        if isinstance(msg, Sync):
            first = lambda now: m.arrive(node, sess, msg.step, now, msg.state_hash, msg.retry_of,  # noqa: E731
                                         msg.sits_out, msg.report, vote)
            poll = lambda: m.epoch_for(node, sess)  # noqa: E731
            key = "epoch"
        else:
            first = lambda now: m.request_admission(node, sess, now, msg.requeue)  # noqa: E731
            poll = lambda: m.admission_for(node, sess)  # noqa: E731
            key = "admission"
        result = self.locked(first)
        clock, every = self.clock, self.config.keepalive_interval
        while result is None:
            with self._cond:
                end = clock.now() + every
                # polled before each wait: the barrier may have completed, waking nobody, while this
                # thread was between `first` and the wait; never once stopped (a change whose save
                # failed must not reach anyone, as a result or an error)
                while not self._stopped and (result := poll()) is None and clock.now() < end:
                    self._cond.wait(max(0.0, end - clock.now()))
            if self._stopped:
                raise ServiceStopped(self.failure or "coordinator stopped")
            if result is None:
                if deadline is not None and clock.now() >= deadline:
                    raise PeerTimeout(f"{msg.op} of {node} not answered in time")
                if keepalive is not None:
                    keepalive()
        return {"ok": True, key: asdict(result)}


def _check_vote(msg: Request, cert: bytes | None, run_id: str) -> tuple[str, str] | None:
    """A ``sync`` over the transport states its state hash with its signature, by the
    connection's certificate: returns (signature, certificate), both hex, for the journal."""
    if cert is None or not isinstance(msg, Sync) or msg.state_hash is None:
        return None
    if msg.vote is None or not verify(cert, vote(run_id, msg.step, msg.state_hash), bytes.fromhex(msg.vote)):
        raise ProtocolError(f"sync of {msg.node}: its state hash at outer step {msg.step} is not signed by its "
                            "certificate", "identity")
    return msg.vote, cert.hex()


def _check_identity(msg: Request, session: Session | None, identity: str | None) -> None:
    """Every request but ``status`` acts for one node (its ``node``; a heartbeat's: its
    session's), which must be the connection's authenticated ``identity``."""
    if isinstance(msg, Status) or (isinstance(msg, Heartbeat) and session is None):
        return  # (a heartbeat without a session is refused as such)
    node = session[0] if isinstance(msg, Heartbeat) else msg.node  # type: ignore[union-attr]
    if node != identity:
        cls = RegistrationRefused if isinstance(msg, Register) else ProtocolError
        raise cls(f"{msg.op} in the name of node {node!r} from a connection authenticated as {identity!r}",
                  "identity")
