"""The coordinator: a threaded server around :class:`~.membership.Membership`.

It holds run membership only (no tensors). Every connection is authenticated by the
transport's HMAC handshake on channel :data:`CHANNEL`; requests and replies are JSON objects
in META frames. A node's *session* connection (opened by ``register``) carries heartbeats and
its EOF evicts the node at once; blocking requests (``sync``, ``admit``) and everything else
go over short-lived connections, during which the server sends ``{"wait": true}`` keepalive
frames every ``keepalive_interval`` so neither side's I/O timeout fires. One thread per
connection, one :class:`threading.Condition` for barriers, one ticker thread for timeouts.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Self, TypeVar

from intellect_jax.diloco.membership import Membership
from intellect_jax.diloco.protocol import (
    PROTOCOL,
    CoordinatorConfig,
    CoordinatorError,
    ProtocolError,
    Resume,
)
from intellect_jax.net import Connection, Listener, NetError, PeerTimeout, TransportConfig
from intellect_jax.net.frames import MsgType

Address = tuple[str, int]

CHANNEL = "coordinator"
MAX_MSG = 1 << 20
log = logging.getLogger("intellect_jax.coordinator")
T = TypeVar("T")


def send_msg(conn: Connection, msg: dict[str, Any], deadline: float | None = None) -> None:
    """Send one JSON message."""
    conn.send(MsgType.META, json.dumps(msg, separators=(",", ":")).encode(), deadline=deadline)


def recv_msg(conn: Connection, deadline: float | None = None) -> dict[str, Any]:
    """Receive one JSON object (raises ``ValueError`` on a malformed one)."""
    msg = json.loads(conn.recv(MsgType.META, deadline=deadline, max_len=MAX_MSG)[1])
    if not isinstance(msg, dict):
        raise ValueError("a request must be a JSON object")
    return msg


def error_reply(e: CoordinatorError) -> dict[str, Any]:
    return {"ok": False, "error": type(e).__name__, "reason": e.reason, "message": str(e)}


class Coordinator:
    """Run-membership service; ``Coordinator(cfg, host, port).start()`` ... ``.stop()``."""

    def __init__(self, cfg: TransportConfig, host: str = "127.0.0.1", port: int = 0,
                 config: CoordinatorConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.host, self.port = cfg, host, port
        self.config = config or CoordinatorConfig()
        self.clock = clock
        self.membership = Membership(self.config, instance=os.urandom(4).hex())
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._listener: Listener | None = None
        self._conns: set[Connection] = set()
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> Address:
        """Where nodes reach the coordinator (after :meth:`start`)."""
        if self._listener is None:
            raise RuntimeError("coordinator not started")
        return self._listener.address

    @property
    def address_str(self) -> str:
        host, port = self.address
        return f"{host}:{port}"

    def start(self) -> Self:
        """Bind, then serve in background threads; returns ``self``."""
        self._listener = Listener(self.cfg, self.host, self.port)
        for name, target in (("accept", self._accept_loop), ("tick", self._tick_loop)):
            t = threading.Thread(target=target, name=f"coordinator-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("coordinator listening on %s (protocol %d, run fingerprint %s)", self.address_str,
                 PROTOCOL, self.config.fingerprint or "from the first registrant")
        return self

    def stop(self) -> None:
        """Stop abruptly, as a crash would: sockets are closed without any goodbye."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._cond:
            conns = list(self._conns)
            self._cond.notify_all()
        for c in conns:
            c.close()
        for t in self._threads:
            t.join(timeout=2)

    def status(self) -> dict[str, Any]:
        """Membership snapshot (same as the ``status`` request)."""
        with self._cond:
            return self.membership.status(self.clock())

    def __enter__(self) -> Self:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- threads -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn = self._listener.accept(CHANNEL, timeout=0.5)
            except PeerTimeout:
                continue
            except NetError:
                return
            with self._cond:
                if self._stop.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"coordinator-conn-{conn.peer}",
                             daemon=True).start()

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.config.tick_interval):
            self._locked(lambda now: self.membership.tick(now))

    def _locked(self, fn: Callable[[float], T]) -> T:
        """Run ``fn(now)`` on the membership under the lock, then log its events, wake waiters."""
        with self._cond:
            try:
                return fn(self.clock())
            finally:
                for line in self.membership.drain_events():
                    (log.warning if line.startswith("WARNING") else log.info)(line.removeprefix("WARNING "))
                self._cond.notify_all()

    def _serve(self, conn: Connection) -> None:
        """Answer one connection's requests until it closes; a session's EOF evicts its node."""
        session: tuple[str, str] | None = None
        try:
            while not self._stop.is_set():
                try:
                    req = recv_msg(conn)
                except PeerTimeout:  # a quiet session: the heartbeat timeout decides, not io_timeout
                    with self._cond:
                        if session is None or not self.membership.alive(*session):
                            return
                    continue
                except ValueError as e:
                    send_msg(conn, error_reply(ProtocolError(f"malformed request: {e}")))
                    return
                op = req.get("op")
                try:
                    if op == "register" and session is None:
                        reply = self._register(req)
                        session = (reply["node_id"], reply["session"])
                    elif op == "hb" and session is not None:
                        self._heartbeat(*session)
                        reply = {"ok": True}
                    elif op in ("sync", "admit"):
                        self._blocking(conn, req)
                        continue
                    else:
                        reply = self._simple(op, req)
                except CoordinatorError as e:
                    reply = error_reply(e)
                except (KeyError, TypeError, ValueError) as e:
                    reply = error_reply(ProtocolError(f"malformed {op!r} request: {e!r}"))
                send_msg(conn, reply)
        except NetError:
            pass  # connection lost, timed out, or coordinator stopping
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()
            if session is not None and not self._stop.is_set():
                self._locked(lambda now: self.membership.disconnect(*session, now))

    def _heartbeat(self, node_id: str, session: str) -> None:
        self._locked(lambda now: self.membership.heartbeat(node_id, session, now))

    def _register(self, req: dict[str, Any]) -> dict[str, Any]:
        res = req.get("resume")
        resume = Resume(int(res["outer_step"]), int(res["epoch_id"]), int(res["rank"])) if res else None
        reply = self._locked(lambda now: self.membership.register(
            str(req["node"]), str(req["addr"]), int(req["devices"]), int(req["protocol"]), str(req["fingerprint"]),
            now, resume, bool(req.get("founder", True))))
        return {"ok": True, **asdict(reply)}

    def _simple(self, op: Any, req: dict[str, Any]) -> dict[str, Any]:
        m = self.membership
        if op == "status":
            return {"ok": True, "status": self._locked(m.status)}
        if op == "received":
            ok = self._locked(lambda now: m.state_received(req["node"], req["session"], int(req["step"]), now))
            return {"ok": True, "accepted": ok}
        if op == "leave":
            self._locked(lambda now: m.leave(req["node"], req["session"], now))
            return {"ok": True}
        raise ProtocolError(f"unknown request {op!r}")

    def _blocking(self, conn: Connection, req: dict[str, Any]) -> None:
        """``sync`` / ``admit``: register the request, then wait (with keepalives) for its result."""
        m, node, sess = self.membership, req["node"], req["session"]
        first: Callable[[float], Any]
        poll: Callable[[], Any]
        if req["op"] == "sync":
            h, retry = req.get("state_hash"), req.get("retry_of")
            retry = None if retry is None else int(retry)
            first = lambda now: m.arrive(node, sess, int(req["step"]), now, h, retry)
            poll = lambda: m.epoch_for(node, sess)
            key = "epoch"
        else:
            first = lambda now: m.request_admission(node, sess, now, bool(req.get("requeue")))
            poll = lambda: m.admission_for(node, sess)
            key = "admission"
        try:
            result = self._locked(first)
            while result is None:
                with self._cond:
                    end = time.monotonic() + self.config.keepalive_interval
                    while result is None and not self._stop.is_set() and time.monotonic() < end:
                        self._cond.wait(max(0.0, end - time.monotonic()))
                        result = poll()
                if self._stop.is_set():
                    return
                if result is None:
                    send_msg(conn, {"wait": True})
            reply = {"ok": True, key: asdict(result)}
        except CoordinatorError as e:
            reply = error_reply(e)
        send_msg(conn, reply)
