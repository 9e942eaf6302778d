"""The coordinator's socket server: one thread per authenticated connection over
:class:`~.service.CoordinatorService`, which does all the work.

Every connection is authenticated by the transport on channel :data:`CHANNEL`, and its
requests are served only in the name of its peer's identity (``conn.identity``); requests and
replies are JSON objects in META frames. At most ``max_handlers`` connections are served at
once, ``handlers_per_identity`` of them from one identity: past that a connection gets an error
reply and is closed. A node's *session*
connection (opened by ``register``) carries heartbeats and its EOF evicts the node at once;
blocking requests (``sync``, ``admit``) and everything else go over short-lived connections,
during which the server sends ``{"wait": true}`` keepalive frames every ``keepalive_interval``
so neither side's I/O timeout fires.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Self

from intellect_jax.coordinator.journal import Journal
from intellect_jax.coordinator.protocol import PROTOCOL, CoordinatorConfig, CoordinatorError, ProtocolError
from intellect_jax.coordinator.service import CoordinatorService, ServiceStopped, error_reply
from intellect_jax.net import (
    Address,
    Connection,
    FrameError,
    Listener,
    NetError,
    PeerTimeout,
    TransportConfig,
    parse_address,
    recv_msg,
    send_msg,
)

CHANNEL = "coordinator"
MAX_MSG = 16 << 20  # a sync carries one piece of evidence (1 MiB at most) and, within net.audit.MAX_CASE_BYTES,
# after a call that succeeded the rows that show members steering and further accusations, after a failed
# one an audited piece, the members missing and the holdings of an all-gather
log = logging.getLogger("intellect_jax.coordinator")


def dialable(addr: str) -> None:
    """ValueError unless ``addr`` is a ``host:port`` another member could dial (a host, a port > 0)."""
    host, port = parse_address(addr)
    if not host or port == 0:
        raise ValueError(f"not a host:port others can dial: {addr[:80]!r}")


class HandlerCaps:
    """Counts the connections being served, in all and per identity, and refuses one past
    ``max_handlers`` or ``handlers_per_identity`` (each identity refused is logged once;
    ``refused`` counts them all). Not thread-safe: the server holds its lock."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.total = 0
        self.by_identity: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    def acquire(self, identity: str) -> str | None:
        """Count a new connection of ``identity`` in; or why not (it is not counted then)."""
        c = self.config
        if self.total >= c.max_handlers:
            why = f"the coordinator serves {c.max_handlers} connections already"
        elif self.by_identity[identity] >= c.handlers_per_identity:
            why = f"{identity} has {c.handlers_per_identity} connections served already"
        else:
            self.total += 1
            self.by_identity[identity] += 1
            return None
        if not self.refused[identity]:
            log.warning("refusing connections of %s: %s (logged once; counted in refused)", identity, why)
        self.refused[identity] += 1
        return why

    def release(self, identity: str) -> None:
        self.total -= 1
        self.by_identity[identity] -= 1
        if not self.by_identity[identity]:
            del self.by_identity[identity]


class Coordinator:
    """Run-membership service over sockets; ``Coordinator(cfg, host, port).start()`` ... ``.stop()``.
    ``journal``: a file where the run's record survives restarts (None: memory only)."""

    def __init__(self, cfg: TransportConfig, host: str = "127.0.0.1", port: int = 0,
                 config: CoordinatorConfig | None = None, journal: str | None = None) -> None:
        self.cfg, self.host, self.port = cfg, host, port
        self.config = config or CoordinatorConfig()
        self.service = CoordinatorService(self.config, run_id=cfg.run_id, check_addr=dialable,
                                          crl=cfg.identity.revocations.current, ca=cfg.identity.ca_der,
                                          revoked=cfg.identity.revocations.revoked,
                                          journal=Journal(journal) if journal else None,
                                          sign=cfg.identity.sign, cert=cfg.identity.cert_der)
        self.membership = self.service.membership
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: Listener | None = None
        self._conns: set[Connection] = set()
        self.caps = HandlerCaps(self.config)
        self._serials: dict[str, int] = {}  # node -> the certificate serial it registered with
        self._revoked: frozenset[int] = frozenset()
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
        self.service.start()
        t = threading.Thread(target=self._accept_loop, name="coordinator-accept", daemon=True)
        t.start()
        self._threads.append(t)
        rec = self.membership.record
        log.info("coordinator listening on %s (protocol %d, run fingerprint %s)", self.address_str,
                 PROTOCOL, rec.fingerprint or "from the first registrant")
        return self

    def stop(self) -> None:
        """Stop abruptly, as a crash would: sockets are closed without any goodbye."""
        self._stop.set()
        self.service.stop()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close()
        for t in self._threads:
            t.join(timeout=2)

    def status(self) -> dict[str, Any]:
        """Membership snapshot (same as the ``status`` request)."""
        return self.service.status()

    def __enter__(self) -> Self:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- threads -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            if self.service.failure is not None:  # it stopped itself (its journal): nobody is served any more
                self._listener.close()
                return
            self._evict_revoked()
            try:
                conn = self._listener.accept(CHANNEL, timeout=0.5)
            except PeerTimeout:
                continue
            except NetError:
                return
            if conn.serial in self._revoked:  # filed by the listener just before the list changed
                conn.close()
                continue
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                busy = self.caps.acquire(conn.identity)
                if busy is None:
                    self._conns.add(conn)
            if busy is not None:
                self._refuse(conn, busy)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name=f"coordinator-conn-{conn.peer}",
                                 daemon=True).start()
            except RuntimeError as e:  # no thread to be had: this connection is refused
                log.warning("no thread to serve %s: %s", conn.peer, e)
                with self._lock:
                    self._conns.discard(conn)
                    self.caps.release(conn.identity)
                conn.close()

    def _evict_revoked(self) -> None:
        """The run authority's revocation list changed: evict the members it revokes and close
        their connections (the listener already refuses their new ones)."""
        try:
            revoked = self.cfg.identity.revocations.refresh()
        except Exception as e:  # noqa: BLE001 - a damaged list: keep the last good one, say so
            log.warning("revocation list unreadable, keeping the last one read: %s", e)
            return
        if revoked == self._revoked:
            return
        self._revoked = revoked
        with self._lock:
            gone = sorted(n for n, s in self._serials.items() if s in revoked)
            conns = [c for c in self._conns if c.serial in revoked]
        for node in gone:
            self.service.revoke(node)
        for c in conns:
            c.close()

    @staticmethod
    def _refuse(conn: Connection, why: str) -> None:
        """Over a handler cap: one error reply (never waiting long for it), then close."""
        try:
            send_msg(conn, error_reply(CoordinatorError(f"connection refused: {why}", "busy")), time.monotonic() + 1.0)
        except NetError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: Connection) -> None:
        """Answer one connection's requests until it closes; a session's EOF evicts its node."""
        session: tuple[str, str] | None = None
        svc = self.service
        try:
            while not self._stop.is_set():
                try:
                    req = recv_msg(conn, max_len=MAX_MSG)
                except PeerTimeout:  # a quiet session: the heartbeat timeout decides, not io_timeout
                    if session is None or not svc.locked(lambda now: svc.membership.alive(*session)):
                        return
                    continue
                except FrameError as e:  # not a JSON object, or a broken frame: say why, then hang up
                    send_msg(conn, error_reply(ProtocolError(f"malformed request: {e}")))
                    return
                reply = svc.handle(req, session, keepalive=lambda: send_msg(conn, {"wait": True}),
                                   identity=conn.identity, cert=conn.cert)
                if req.get("op") == "register" and session is None and reply.get("ok"):
                    session = (reply["node_id"], reply["session"])
                    with self._lock:
                        self._serials[conn.identity] = conn.serial
                send_msg(conn, reply)
        except (NetError, ServiceStopped):
            pass  # connection lost, timed out, or coordinator stopping
        finally:
            with self._lock:
                self._conns.discard(conn)
                self.caps.release(conn.identity)
            conn.close()
            if session is not None and not self._stop.is_set():
                svc.disconnect(session)
