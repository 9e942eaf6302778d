"""The coordinator's request handling, independent of how requests arrive.

:class:`CoordinatorService` owns the :class:`~.membership.Membership` (under one condition
variable), its journal and the ticker that evicts silent nodes. ``handle(request, session)``
answers one JSON request; ``sync`` and ``admit`` block until their barrier or admission
(calling ``keepalive`` every ``keepalive_interval`` meanwhile). The socket server
(:mod:`.coordinator`) and the in-process :class:`LocalWire` are thin layers over it, so the
simulation runs the very same request code as a real coordinator.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from intellect_jax.coordinator.clock import REAL, Clock
from intellect_jax.coordinator.journal import Journal, RunRecord
from intellect_jax.coordinator.membership import Membership
from intellect_jax.coordinator.protocol import CoordinatorConfig, CoordinatorError, ProtocolError, Resume
from intellect_jax.net.errors import PeerClosed, PeerTimeout

log = logging.getLogger("intellect_jax.coordinator")
T = TypeVar("T")
Session = tuple[str, str]  # (node id, session token)


class ServiceStopped(PeerClosed):
    """The coordinator stopped (or crashed) while a request was being answered."""


def error_reply(e: CoordinatorError) -> dict[str, Any]:
    return {"ok": False, "error": type(e).__name__, "reason": e.reason, "message": str(e)}


class CoordinatorService:
    """Membership + journal + timeouts behind ``handle`` (see the module docstring)."""

    def __init__(self, config: CoordinatorConfig | None = None, *, run_id: str = "", clock: Clock = REAL,
                 journal: Journal | None = None, instance: str | None = None,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.config = config or CoordinatorConfig()
        self.clock, self.journal = clock, journal
        record = journal.load(run_id) if journal is not None else RunRecord(run_id=run_id)
        self.membership = Membership(self.config, instance or os.urandom(4).hex(), record)
        self._on_event = on_event
        self._cond = clock.Condition()
        self._stopped = False
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
                raise ServiceStopped("coordinator stopped")
            try:
                now = self.clock.now()
                self._excuse_stall(now)
                return fn(now)
            finally:
                for line in self.membership.drain_events():
                    self._emit(line)
                if self.journal is not None:
                    self.journal.save(self.membership.record)
                self._cond.notify_all()

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
        while not self._stopped:
            self.clock.sleep(self.config.tick_interval)
            try:
                self.locked(self.membership.tick)
            except ServiceStopped:
                return

    def disconnect(self, session: Session) -> None:
        """The node's session connection closed: it is evicted at once."""
        try:
            self.locked(lambda now: self.membership.disconnect(*session, now))
        except ServiceStopped:
            pass

    # ---- requests ------------------------------------------------------------------------------
    def handle(self, req: dict[str, Any], session: Session | None = None,
               keepalive: Callable[[], None] | None = None, deadline: float | None = None) -> dict[str, Any]:
        """Answer one request. ``session``: the (node, token) of the connection it came on, if
        that connection registered. Coordinator errors become error replies; malformed requests
        a :class:`ProtocolError` reply; :class:`ServiceStopped` propagates."""
        op = req.get("op")
        try:
            if op == "register" and session is None:
                return self._register(req)
            if op == "hb" and session is not None:
                return {"ok": True, "view": self.locked(lambda now: self.membership.heartbeat(*session, now))}
            if op in ("sync", "admit"):
                return self._blocking(req, keepalive, deadline)
            return self._simple(op, req)
        except CoordinatorError as e:
            return error_reply(e)
        except (KeyError, TypeError, ValueError) as e:
            return error_reply(ProtocolError(f"malformed {op!r} request: {e!r}"))

    def _register(self, req: dict[str, Any]) -> dict[str, Any]:
        res = req.get("resume")
        resume = None
        if res:
            members = res.get("members") or []
            if not isinstance(members, list) or len(members) > 4096 or not all(isinstance(m, str) for m in members):
                raise ValueError("resume.members must be a list of node ids")
            h = res.get("state_hash")
            if h is not None and not isinstance(h, str):
                raise ValueError("resume.state_hash must be a string")
            resume = Resume(int(res["outer_step"]), int(res["epoch_id"]), int(res["rank"]), h, tuple(members))
        steps = req.get("outer_steps")
        reply = self.locked(lambda now: self.membership.register(
            str(req["node"]), str(req["addr"]), int(req["devices"]), int(req["protocol"]), str(req["fingerprint"]),
            now, resume, bool(req.get("founder", True)), None if steps is None else int(steps)))
        return {"ok": True, **asdict(reply)}

    def _simple(self, op: Any, req: dict[str, Any]) -> dict[str, Any]:
        m = self.membership
        if op == "status":
            return {"ok": True, "status": self.locked(m.status)}
        if op == "received":
            ok = self.locked(lambda now: m.state_received(req["node"], req["session"], int(req["step"]), now))
            return {"ok": True, "accepted": ok}
        if op == "leave":
            self.locked(lambda now: m.leave(req["node"], req["session"], now))
            return {"ok": True}
        raise ProtocolError(f"unknown request {op!r}")

    def _blocking(self, req: dict[str, Any], keepalive: Callable[[], None] | None,
                  deadline: float | None) -> dict[str, Any]:
        """``sync`` / ``admit``: register the request, then wait for its result."""
        m, node, sess = self.membership, req["node"], req["session"]
        first: Callable[[float], Any]
        poll: Callable[[], Any]
        if req["op"] == "sync":
            h, retry, out = req.get("state_hash"), req.get("retry_of"), req.get("sits_out")
            retry = None if retry is None else int(retry)
            if h is not None and not (isinstance(h, str) and len(h) <= 128):
                raise ProtocolError(f"sync of {node}: state_hash must be a string of at most 128 characters")
            report = _report(node, req.get("report"))
            first = lambda now: m.arrive(node, sess, int(req["step"]), now, h, retry,  # noqa: E731
                                         None if out is None else str(out)[:200], report)
            poll = lambda: m.epoch_for(node, sess)  # noqa: E731
            key = "epoch"
        else:
            first = lambda now: m.request_admission(node, sess, now, bool(req.get("requeue")))  # noqa: E731
            poll = lambda: m.admission_for(node, sess)  # noqa: E731
            key = "admission"
        result = self.locked(first)
        clock, every = self.clock, self.config.keepalive_interval
        while result is None:
            with self._cond:
                end = clock.now() + every
                while result is None and not self._stopped and clock.now() < end:
                    self._cond.wait(max(0.0, end - clock.now()))
                    result = poll()
            if self._stopped:
                raise ServiceStopped("coordinator stopped")
            if result is None:
                if deadline is not None and clock.now() >= deadline:
                    raise PeerTimeout(f"{req['op']} of {node} not answered in time")
                if keepalive is not None:
                    keepalive()
        return {"ok": True, key: asdict(result)}


def _report(node: str, raw: Any) -> dict[str, Any] | None:
    """A node's report on its last all-reduce, checked before the membership keeps it (a bad one
    would fail every later barrier, not just this request): ``{"avg_failed": bool, "accused":
    [node, why] | None}``."""
    if raw is None:
        return None
    accused = raw.get("accused") if isinstance(raw, dict) else None
    if not (isinstance(raw, dict) and set(raw) <= {"avg_failed", "accused"}
            and isinstance(raw.get("avg_failed", False), bool)
            and (accused is None or (isinstance(accused, list) and len(accused) == 2
                                     and all(isinstance(x, str) and len(x) <= 256 for x in accused)))):
        raise ProtocolError(f"sync of {node}: malformed report {str(raw)[:120]}")
    return raw
