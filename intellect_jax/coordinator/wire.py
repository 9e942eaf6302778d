"""How a coordinator client reaches its coordinator: the :class:`Wire` protocol (a session
connection for registration and heartbeats, one-off connections for requests) and its socket
implementation over the authenticated transport; ``coordinator_status`` for tools."""

from __future__ import annotations

import time
from typing import Any, Protocol

from intellect_jax.coordinator.server import CHANNEL, MAX_MSG
from intellect_jax.net.identity import COORDINATOR
from intellect_jax.coordinator.protocol import (
    CoordinatorError,
    CoordinatorUnavailable,
    Evicted,
    ProtocolError,
    RegistrationRefused,
    RunCompleted,
    StaleSession,
)
from intellect_jax.coordinator.schema import ErrorReply, StatusOk, parse_reply
from intellect_jax.net import (
    Address,
    Connection,
    NetError,
    PeerTimeout,
    TransportConfig,
    connect,
    parse_address,
    recv_msg,
    send_msg,
)

_ERRORS = {c.__name__: c for c in (RegistrationRefused, Evicted, ProtocolError, StaleSession, CoordinatorUnavailable,
                                   RunCompleted)}
# connection trouble (AuthError is handled before): retried like a dropped connection rather than
# ending a heartbeat thread or a registration (a reply that does not parse is a ProtocolError)
TRANSIENT = (NetError, OSError)


def reply_error(reply: dict[str, Any], source: str = "the coordinator") -> CoordinatorError:
    """The error an error reply carries (a malformed reply: :class:`ProtocolError`)."""
    try:
        e = parse_reply(ErrorReply, reply, "error", source)
    except ProtocolError as err:
        return err
    return _ERRORS.get(e.error, CoordinatorError)(e.message, e.reason)


class Wire(Protocol):
    """How a client reaches its coordinator: a session (register, heartbeats, close = leave
    abruptly) and one-off requests. Transport trouble raises a ``NetError``/``OSError``."""

    name: str

    def open(self, msg: dict[str, Any], timeout: float) -> tuple[Any, dict[str, Any]]: ...

    def beat(self, handle: Any, msg: dict[str, Any], patience: float) -> dict[str, Any]: ...  # waits out a stall

    def close(self, handle: Any) -> None: ...

    def request(self, msg: dict[str, Any], deadline: float | None, connect_timeout: float) -> dict[str, Any]: ...


class SocketWire:
    """The coordinator over the authenticated transport (see :mod:`.server`)."""

    def __init__(self, address: Address | str, cfg: TransportConfig) -> None:
        self.address, self.cfg = parse_address(address), cfg
        self.name = f"coordinator {self.address[0]}:{self.address[1]}"

    def _connect(self, timeout: float) -> Connection:
        return connect(self.cfg, self.address, CHANNEL, expect=COORDINATOR, timeout=timeout, name=self.name)

    def open(self, msg: dict[str, Any], timeout: float) -> tuple[Connection | None, dict[str, Any]]:
        conn = self._connect(timeout)
        try:
            deadline = time.monotonic() + max(timeout, self.cfg.handshake_timeout)
            send_msg(conn, msg, deadline)
            reply = recv_msg(conn, deadline, MAX_MSG)
        except BaseException:
            conn.close()
            raise
        if not reply.get("ok"):
            conn.close()
            return None, reply
        return conn, reply

    def beat(self, handle: Connection, msg: dict[str, Any], patience: float) -> dict[str, Any]:
        """A heartbeat on the session connection. While the connection stays open and silent
        (a coordinator that is alive but stalled: paused, swapping, starved), its reply is
        awaited for up to ``patience`` seconds rather than one I/O timeout: giving the session
        up would get the node evicted for the coordinator's own stall."""
        send_msg(handle, msg)
        end = time.monotonic() + patience
        while True:
            try:
                return recv_msg(handle, end, MAX_MSG)
            except PeerTimeout as e:
                if not e.idle or time.monotonic() >= end:
                    raise

    def close(self, handle: Connection) -> None:
        handle.close()

    def request(self, msg: dict[str, Any], deadline: float | None, connect_timeout: float) -> dict[str, Any]:
        """One request on a fresh connection; skips the server's keepalive frames."""
        conn = self._connect(connect_timeout)
        try:
            send_msg(conn, msg, deadline)
            while True:
                reply = recv_msg(conn, deadline, MAX_MSG)
                if not reply.get("wait"):
                    return reply
        finally:
            conn.close()


def coordinator_status(address: Address | str, cfg: TransportConfig, timeout: float = 10.0) -> dict[str, Any]:
    """Membership, epoch, joiners, hash records and eviction log of a running coordinator."""
    wire = SocketWire(address, cfg)
    reply = wire.request({"op": "status"}, time.monotonic() + timeout, timeout)
    if reply.get("ok") is not True:
        raise reply_error(reply, wire.name)
    return parse_reply(StatusOk, reply, "status", wire.name).status
