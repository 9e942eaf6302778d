"""Node-side client of the coordinator (see ``docs/coordinator.md``).

Typical outer loop (``k`` = completed outer steps)::

    client = CoordinatorClient(addr, transport_cfg, "node-a", "10.0.0.5:7000", devices=8, fingerprint=fp)
    reply = client.register()
    if not reply.member:                      # joiner: wait for a boundary, fetch the state
        adm = client.wait_admission()         # donor + outer step of the state to fetch
        ...receive the state from adm.donor_addr...; client.state_received(adm.outer_step)
        k = adm.outer_step
    while training:
        ...H inner steps...
        epoch = client.sync(k, state_hash=h)  # barrier; the ring for outer step k+1
        ...all-reduce over epoch.addresses (on NetError: epoch = client.sync(k, h, retry_of=epoch.epoch_id))...
        ...outer step; stream the new state to each joiner in epoch.serve...; k += 1
    client.leave()

A background thread heartbeats over the session connection. If the coordinator goes away,
the client reconnects with backoff for up to ``reconnect_timeout`` and re-registers with its
(outer step, epoch, rank); an in-flight request is then re-issued transparently.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, fields, replace
from typing import Any, Self

from intellect_jax.diloco.coordinator import CHANNEL, Address, recv_msg, send_msg
from intellect_jax.diloco.protocol import (
    PROTOCOL,
    Admission,
    CoordinatorError,
    CoordinatorUnavailable,
    Epoch,
    Evicted,
    ProtocolError,
    RegisterReply,
    RegistrationRefused,
    Resume,
    StaleSession,
)
from intellect_jax.net import AuthError, Connection, NetError, PeerTimeout, TransportConfig, connect
from intellect_jax.net.comm import parse_address

__all__ = ["Admission", "CoordinatorClient", "CoordinatorError", "CoordinatorUnavailable", "Epoch", "Evicted",
           "ProtocolError", "RegisterReply", "RegistrationRefused", "coordinator_status"]

log = logging.getLogger("intellect_jax.coordinator.client")
_ERRORS = {c.__name__: c for c in (RegistrationRefused, Evicted, ProtocolError, StaleSession, CoordinatorUnavailable)}
_TRANSIENT = (NetError, OSError, ValueError)  # connection trouble (AuthError is handled before)


def _error(reply: dict[str, Any]) -> CoordinatorError:
    cls = _ERRORS.get(str(reply.get("error")), CoordinatorError)
    return cls(str(reply.get("message", reply)), reply.get("reason"))


def _request(cfg: TransportConfig, address: Address, msg: dict[str, Any], *, connect_timeout: float,
             deadline: float | None = None) -> dict[str, Any]:
    """One request on a fresh connection; skips the server's keepalive frames."""
    conn = connect(cfg, address, CHANNEL, timeout=connect_timeout, name=f"coordinator {address[0]}:{address[1]}")
    try:
        send_msg(conn, msg, deadline)
        while True:
            reply = recv_msg(conn, deadline)
            if not reply.get("wait"):
                return reply
    finally:
        conn.close()


def coordinator_status(address: Address | str, cfg: TransportConfig, timeout: float = 10.0) -> dict[str, Any]:
    """Membership, epoch, joiners, hash records and eviction log of a running coordinator."""
    reply = _request(cfg, parse_address(address), {"op": "status"}, connect_timeout=timeout,
                     deadline=time.monotonic() + timeout)
    if not reply.get("ok"):
        raise _error(reply)
    return reply["status"]


class CoordinatorClient:
    """One node's membership in the run: register, heartbeat, sync at boundaries, leave."""

    def __init__(self, address: Address | str, transport_cfg: TransportConfig, node_id: str, ring_addr: str,
                 devices: int = 1, fingerprint: str = "", protocol: int = PROTOCOL, *,
                 heartbeat_interval: float = 1.0, reconnect_timeout: float = 60.0,
                 connect_timeout: float = 10.0, io_timeout: float = 10.0) -> None:
        self.address = parse_address(address)
        # coordinator replies (and its keepalives) come within ~1 s: a silent peer is a dead one
        self.cfg = replace(transport_cfg, io_timeout=min(transport_cfg.io_timeout, io_timeout))
        self.node_id, self.ring_addr, self.devices = node_id, ring_addr, devices
        self.fingerprint, self.protocol = fingerprint, protocol
        self.heartbeat_interval, self.reconnect_timeout = heartbeat_interval, reconnect_timeout
        self.connect_timeout = connect_timeout
        self._name = f"coordinator {self.address[0]}:{self.address[1]}"
        self._lock = threading.Lock()  # client state below
        self._io_lock = threading.Lock()  # session connection I/O
        self._recover_lock = threading.Lock()
        self._conn: Connection | None = None
        self._session: str | None = None
        self._gen = 0  # session generation (bumped by every registration)
        self._fatal: CoordinatorError | None = None
        self._seen_run = False  # this node has seen the run started (so it never founds it)
        self._has_state = False
        self._step = self._epoch = self._rank = 0
        self._closed = False
        self._stop = threading.Event()
        self._hb: threading.Thread | None = None

    # ---- state ---------------------------------------------------------------------------
    @property
    def registered(self) -> bool:
        return self._session is not None and self._fatal is None

    @property
    def member(self) -> bool:
        """Holds the run's state (founding/resumed member, or a joiner past ``state_received``)."""
        return self._has_state

    @property
    def outer_step(self) -> int:
        return self._step

    @property
    def epoch_id(self) -> int:
        return self._epoch

    # ---- requests ------------------------------------------------------------------------
    def register(self, outer_step: int | None = None, epoch_id: int = 0) -> RegisterReply:
        """Join the run: as a founding member of a fresh run, else as a joiner (``reply.member``).

        ``outer_step``: this node holds the state after that many outer steps (e.g. from its
        checkpoint after a whole-run restart); accepted only while the coordinator rebuilds the
        run, otherwise the node registers as a joiner. Raises :class:`RegistrationRefused`
        (wrong secret, model fingerprint, protocol, duplicate live node id).
        """
        with self._lock:
            if self._session is not None and self._fatal is None:
                raise ProtocolError(f"node {self.node_id} is already registered")
            self._fatal = None
            self._has_state = False
        if outer_step is not None:
            try:
                reply = self._register(Resume(outer_step, epoch_id, 0), self.connect_timeout)
            except Evicted as e:  # the run moved on without this state: join instead
                log.info("node %s: %s", self.node_id, e)
                self._seen_run = True
            else:
                with self._lock:
                    self._has_state, self._step, self._epoch = True, outer_step, epoch_id
                return reply
        return self._register(None, self.connect_timeout)

    def sync(self, k: int, state_hash: str | None = None, retry_of: int | None = None,
             timeout: float | None = None) -> Epoch:
        """Barrier at boundary ``k`` (``k`` completed outer steps); returns the epoch of step ``k+1``.

        ``retry_of``: the epoch whose all-reduce just failed. Raises :class:`Evicted` if the node
        was dropped (re-register as a joiner), :class:`CoordinatorUnavailable`.
        """
        with self._lock:
            self._step = k
        reply = self._call("sync", {"step": k, "state_hash": state_hash, "retry_of": retry_of}, timeout)
        ep = Epoch.from_json(reply["epoch"])
        with self._lock:
            self._epoch, self._rank, self._has_state, self._seen_run = ep.epoch_id, ep.rank, True, True
        if ep.hash_mismatch:
            log.warning("node %s: state hashes disagree at outer step %d: %s", self.node_id, k,
                        ", ".join(f"{n}={h[:16]}" for n, h in ep.hash_mismatch))
        return ep

    def wait_admission(self, requeue: bool = False, timeout: float | None = None) -> Admission:
        """Joiner: block until a boundary admits us; ``requeue=True`` after a failed state transfer."""
        reply = self._call("admit", {"requeue": requeue}, timeout, reissue={"requeue": False})
        adm = Admission(**reply["admission"])
        with self._lock:
            self._epoch = adm.epoch_id
        return adm

    def state_received(self, k: int) -> bool:
        """Joiner: we hold the state after outer step ``k``; False means re-queued (wait_admission again)."""
        accepted = bool(self._call("received", {"step": k})["accepted"])
        if accepted:
            with self._lock:
                self._has_state, self._step = True, k
        return accepted

    def leave(self) -> None:
        """Leave gracefully (removed at once; the next barrier forms a new epoch without us)."""
        try:
            self._call("leave", {}, recover=False)
        finally:
            self._drop_session()

    def status(self) -> dict[str, Any]:
        return coordinator_status(self.address, self.cfg, self.connect_timeout)

    def close(self) -> None:
        """Stop heartbeating and close the session (the coordinator evicts us unless we left)."""
        self._closed = True
        self._stop.set()
        self._drop_session()
        if self._hb is not None and self._hb is not threading.current_thread():
            self._hb.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------
    def _register(self, resume: Resume | None, timeout: float) -> RegisterReply:
        try:
            conn = connect(self.cfg, self.address, CHANNEL, timeout=timeout, name=self._name)
        except AuthError as e:
            raise RegistrationRefused(f"{self._name} refused node {self.node_id}'s handshake (wrong run secret "
                                      f"or run id?): {e}", "auth") from e
        try:
            deadline = time.monotonic() + max(timeout, self.cfg.handshake_timeout)
            send_msg(conn, {"op": "register", "node": self.node_id, "addr": self.ring_addr, "devices": self.devices,
                            "protocol": self.protocol, "fingerprint": self.fingerprint,
                            "founder": not self._seen_run,
                            "resume": asdict(resume) if resume else None}, deadline)
            reply = recv_msg(conn, deadline)
            if not reply.get("ok"):
                raise _error(reply)
        except BaseException:
            conn.close()
            raise
        r = RegisterReply(**{f.name: reply[f.name] for f in fields(RegisterReply)})
        with self._lock:
            self._conn, self._session, self._gen, self._fatal = conn, r.session, self._gen + 1, None
            self._seen_run = self._seen_run or not r.member or r.epoch_id > 0
            if resume is None:
                self._has_state, self._step = r.member, r.outer_step if r.member else 0
            if self._hb is None:
                self._hb = threading.Thread(target=self._heartbeat_loop, name=f"coordinator-hb-{self.node_id}",
                                            daemon=True)
                self._hb.start()
        log.info("node %s registered with %s as %s (outer step %d, epoch %d)", self.node_id, self._name,
                 "member" if r.member else "joiner", r.outer_step, r.epoch_id)
        return r

    def _beat(self, conn: Connection) -> None:
        with self._io_lock:
            send_msg(conn, {"op": "hb"})
            reply = recv_msg(conn)
        if not reply.get("ok"):
            raise _error(reply)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            with self._lock:
                conn, gen = self._conn, self._gen
            if conn is None:
                continue
            try:
                self._beat(conn)
            except CoordinatorError as e:
                self._fail(e)
            except _TRANSIENT:
                if self._stop.is_set():
                    return
                try:
                    self._recover(gen)
                except CoordinatorError:
                    pass  # recorded by _fail; the next request raises it

    def _fail(self, e: CoordinatorError) -> None:
        """Record a fatal error (eviction, refusal, coordinator gone) and drop the session."""
        with self._lock:
            self._fatal = e
            if isinstance(e, Evicted):
                self._has_state = False
        log.warning("node %s: %s", self.node_id, e)
        self._drop_session(keep_thread=True)

    def _drop_session(self, keep_thread: bool = False) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if not keep_thread:
                self._session = None
        if conn is not None:
            conn.close()

    def _recover(self, gen: int) -> None:
        """The coordinator is unreachable: reconnect with backoff and re-register (once per generation)."""
        with self._recover_lock:
            with self._lock:
                if self._fatal is not None:
                    raise self._fatal
                if self._closed:
                    raise CoordinatorUnavailable(f"node {self.node_id}: client closed")
                if self._gen != gen:
                    return  # another thread already re-registered
            self._drop_session(keep_thread=True)
            log.warning("node %s lost %s; reconnecting for up to %.0fs", self.node_id, self._name,
                        self.reconnect_timeout)
            deadline, delay = time.monotonic() + self.reconnect_timeout, 0.05
            last: Exception | None = None
            while not self._closed:
                resume = Resume(self._step, self._epoch, self._rank) if self._has_state else None
                try:
                    self._register(resume, max(0.1, deadline - time.monotonic()))
                    return
                except RegistrationRefused as e:  # duplicate: our old session is not yet seen dead
                    if e.reason != "duplicate" or time.monotonic() >= deadline:
                        self._fail(e)
                        raise
                    last = e
                except CoordinatorError as e:
                    self._fail(e)
                    raise
                except _TRANSIENT as e:
                    last = e
                if time.monotonic() >= deadline:
                    break
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(2 * delay, 1.0)
            err = CoordinatorUnavailable(f"node {self.node_id}: {self._name} unreachable for "
                                         f"{self.reconnect_timeout:.0f}s ({last})")
            self._fail(err)
            raise err

    def _call(self, op: str, args: dict[str, Any], timeout: float | None = None,
              reissue: dict[str, Any] | None = None, recover: bool = True) -> dict[str, Any]:
        """A request on its own connection; survives coordinator restarts by re-registering and
        re-issuing (``recover=False``: fail at once with :class:`CoordinatorUnavailable`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failing_since: float | None = None
        while True:
            with self._lock:
                if self._fatal is not None:
                    raise self._fatal
                if self._session is None:
                    raise ProtocolError(f"node {self.node_id} is not registered; call register()")
                gen, msg = self._gen, {"op": op, "node": self.node_id, "session": self._session, **args}
            try:
                reply = _request(self.cfg, self.address, msg, connect_timeout=self.connect_timeout, deadline=deadline)
            except AuthError:
                raise
            except _TRANSIENT as e:
                if not recover:
                    raise CoordinatorUnavailable(f"node {self.node_id}: {op} to {self._name} failed ({e})") from e
                if deadline is not None and time.monotonic() >= deadline:
                    raise PeerTimeout(f"node {self.node_id}: {op} not answered within {timeout:.1f}s") from e
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > self.reconnect_timeout:
                    raise CoordinatorUnavailable(f"node {self.node_id}: {op} to {self._name} failing for "
                                                 f"{now - failing_since:.0f}s ({e})") from e
                self._check_session(gen)
                args = {**args, **(reissue or {})}
                continue
            if reply.get("ok"):
                return reply
            err = _error(reply)
            if isinstance(err, StaleSession):
                self._recover(gen)
                continue
            if isinstance(err, Evicted):
                self._fail(err)
            raise err

    def _check_session(self, gen: int) -> None:
        """After a failed request: if the session still answers, retry; otherwise recover it."""
        with self._lock:
            conn = self._conn if self._gen == gen else None
        if conn is None:
            with self._recover_lock:  # wait for a recovery in progress
                pass
            time.sleep(0.05)
            return
        try:
            self._beat(conn)
            time.sleep(0.1)
        except CoordinatorError as e:
            self._fail(e)
            raise
        except _TRANSIENT:
            self._recover(gen)
