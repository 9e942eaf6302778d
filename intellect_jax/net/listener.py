"""The accepting side: a listener that stays up and routes authenticated connections.

It runs each incoming connection's TLS handshake in its own thread (a slow or hostile client
cannot block others), then reads the channel the client asks for (e.g.
``ring/<epoch>/<src>><dst>/<stream>``) and files the connection under it, with the identity its
certificate proves. :meth:`Listener.accept` hands out a channel's connections only from the
identity that owns it (``peer``): a member that opens another member's channel is closed and
counted, never served. Unclaimed connections are closed after ``pending_ttl`` seconds.

Strangers (before authentication) get little: at most ``handshakes_per_source`` connections
per address and ``handshakes_per_prefix`` per /24 (IPv4) or /64 (IPv6) in handshake at once,
``max_handshakes`` in all (the rest are closed on arrival, and counted); each must deliver its
whole TLS hello within ``first_bytes_timeout`` and finish within ``handshake_timeout``. Members
(after authentication) may leave at most ``pending_per_peer`` connections unclaimed each, and
all members together at most ``pending_per_prefix`` per channel prefix (``ring``, ``state``, ...).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import select
import socket
import ssl
import threading
import time

from intellect_jax.net.errors import AuthError, FrameError, NetError, PeerTimeout
from intellect_jax.net.frames import MsgType
from intellect_jax.net.identity import peer_identity
from intellect_jax.net.transport import MAX_CHANNEL_BYTES, Address, Connection, TransportConfig, _tune

log = logging.getLogger("intellect_jax.net")
TLS_RECORD_MAX = 5 + (1 << 14) + 256  # a TLS record: 5-byte header, at most 16 KiB + expansion


def prefix_of(ip: str) -> str:
    """The network an address belongs to for the handshake budget: its /24 (IPv4) or /64 (IPv6)."""
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    bits = 24 if addr.version == 4 else 64
    return str(ipaddress.ip_network(f"{addr}/{bits}", strict=False))


def prefix_kind(channel: str) -> str:
    """A channel's prefix, its first path element (``ring``, ``state``, ``coordinator``)."""
    return channel.split("/", 1)[0][:64]


def await_hello(sock: socket.socket, deadline: float) -> None:
    """Wait (without consuming it) until the client's whole first TLS record, its hello, has
    arrived; :class:`PeerTimeout` at ``deadline``, :class:`FrameError` if it is not TLS.
    ``poll``, not ``select`` (which fails on descriptors past 1023); while a partial hello sits
    unread the socket stays readable, so the wait between peeks grows (5 ms to 80 ms)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    need, pause = 5, 0.005
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise PeerTimeout("no complete TLS hello in time")
        head = sock.recv(need, socket.MSG_PEEK)
        if not head:
            raise FrameError("closed before its TLS hello")
        if len(head) >= 5:
            if head[0] != 0x16:  # handshake record
                raise FrameError("not a TLS client")
            need = 5 + int.from_bytes(head[3:5], "big")
            if need > TLS_RECORD_MAX:
                raise FrameError("oversized TLS hello")
            if len(head) >= need:
                return
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, 0.08)


class Listener:
    """Accepts and authenticates connections in the background; :meth:`accept` by channel."""

    def __init__(self, cfg: TransportConfig, host: str = "127.0.0.1", port: int = 0,
                 max_handshakes: int = 256) -> None:
        self.cfg = cfg
        self._srv = socket.create_server((host, port), backlog=128)
        self.address: Address = self._srv.getsockname()[:2]
        self._ctx = cfg.identity.server_context
        self._cond = threading.Condition()
        self._pending: dict[str, collections.deque[tuple[float, Connection]]] = {}
        self._per_peer: collections.Counter[str] = collections.Counter()  # unclaimed, per identity
        self._per_kind: collections.Counter[str] = collections.Counter()  # unclaimed, per channel prefix
        self._rejections: collections.deque[tuple[float, str]] = collections.deque(maxlen=16)
        self._slots = threading.BoundedSemaphore(max_handshakes)
        self._busy: collections.Counter[str] = collections.Counter()  # handshakes, per address and network
        self.refused: collections.Counter[str] = collections.Counter()  # connections turned away, per reason
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"net-listen-{self.address[1]}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._srv.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            keys = (addr[0], prefix_of(addr[0]))
            with self._cond:
                why = ("source over its handshake budget" if self._busy[keys[0]] >= self.cfg.handshakes_per_source
                       else "network over its handshake budget" if self._busy[keys[1]] >= self.cfg.handshakes_per_prefix
                       else None)
                if why is None:
                    self._busy.update(keys)
            if why is None and not self._slots.acquire(blocking=False):
                self._release(keys)
                why = "too many concurrent handshakes"
            if why is not None:
                self._note(f"{addr[0]}:{addr[1]}: {why}", why)
                sock.close()
                continue
            try:
                threading.Thread(target=self._handshake, args=(sock, addr, keys), daemon=True).start()
            except RuntimeError as e:  # no thread to be had (a process limit): this one is refused
                self._slots.release()
                self._release(keys)
                self._note(f"{addr[0]}:{addr[1]}: {e}", "no thread for a handshake")
                sock.close()
                time.sleep(0.01)

    def _release(self, keys: tuple[str, str]) -> None:
        with self._cond:
            self._busy.subtract(keys)
            for k in keys:
                if self._busy[k] <= 0:
                    del self._busy[k]

    def _note(self, msg: str, why: str = "handshake failed") -> None:
        with self._cond:
            self._rejections.append((time.monotonic(), msg))
            self.refused[why] += 1

    def _handshake(self, sock: socket.socket, addr: tuple, keys: tuple[str, str]) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        cfg = self.cfg
        ident = None  # set once this connection holds one of its identity's pending places
        kind = None  # ... and once it holds one of its channel prefix's
        conn = None  # once TLS is done
        try:
            try:  # a stranger: its whole hello within first_bytes_timeout, TLS done within twice that
                t0 = time.monotonic()
                await_hello(sock, t0 + cfg.first_bytes_timeout)
                _tune(sock, cfg)
                sock.settimeout(max(0.001, t0 + 2 * cfg.first_bytes_timeout - time.monotonic()))
                sock = self._ctx.wrap_socket(sock, server_side=True)
                who, serial, cert = peer_identity(sock)  # type: ignore[arg-type]
            finally:  # a stranger's slot ends with the TLS handshake
                self._slots.release()
                self._release(keys)
            conn = Connection(sock, cfg, f"{who}@{peer}", identity=who, serial=serial, cert=cert)
            deadline = time.monotonic() + cfg.handshake_timeout
            refusal = self._reserve(conn)
            if refusal is None:
                ident = who
            else:  # let its hello arrive (a second at most), so that it reads why it is refused
                deadline = min(deadline, time.monotonic() + 1.0)
            hdr, raw = conn.recv(MsgType.HELLO, deadline=deadline, max_len=MAX_CHANNEL_BYTES)
            if refusal is not None:
                self._reject(conn, refusal, deadline)
                raise AuthError(f"{conn.peer}: {refusal}")
            channel = raw.decode("utf-8", errors="strict") if raw else ""
            if not channel:
                raise FrameError(f"{conn.peer}: empty channel name")
            with self._cond:
                k = prefix_kind(channel)
                if self._per_kind[k] >= cfg.pending_per_prefix:
                    refusal = f"channels {k}/... hold {self._per_kind[k]} unclaimed connections already"
                else:
                    self._per_kind[k] += 1
                    kind = k
            if refusal is not None:
                self._reject(conn, refusal, deadline)
                raise AuthError(f"{conn.peer}: {refusal}")
            conn.send(MsgType.ACCEPT, deadline=deadline)
        except Exception as e:  # noqa: BLE001 - any failure rejects this client only
            if conn is not None and isinstance(e, FrameError):  # say why, or it cannot tell us from a crash
                self._reject(conn, str(e).removeprefix(f"{conn.peer}: "), time.monotonic() + 1.0, drain=True)
            self._note(str(e) if peer in str(e) else f"{peer}: {e}",
                       "no handshake in time" if isinstance(e, (PeerTimeout, TimeoutError)) else
                       "refused" if isinstance(e, AuthError) else "handshake failed")
            with self._cond:
                if ident is not None:
                    self._unreserve(ident)
                if kind is not None:
                    self._unkind(kind)
            sock.close()
            return
        with self._cond:
            if self._closed:
                self._unreserve(ident)
                self._unkind(kind)  # type: ignore[arg-type]
                conn.close()
                return
            conn.channel = channel
            self._pending.setdefault(channel, collections.deque()).append((time.monotonic(), conn))
            self._cond.notify_all()

    def _reserve(self, conn: Connection) -> str | None:
        """Why an authenticated connection is refused; None: it holds one of its identity's
        ``pending_per_peer`` places from now on (while it names its channel, then unclaimed)."""
        try:
            if self.cfg.identity.revocations.revoked(conn.serial):
                return f"identity {conn.identity} is revoked"
        except Exception as e:  # noqa: BLE001 - see Revocations.refresh: it keeps the last good list
            log.warning("%s", e)
        with self._cond:
            self._purge()
            if self._per_peer[conn.identity] >= self.cfg.pending_per_peer:
                return f"{conn.identity} holds {self._per_peer[conn.identity]} unclaimed connections already"
            self._per_peer[conn.identity] += 1
        return None

    def _unreserve(self, ident: str) -> None:
        """(under the lock)"""
        self._per_peer[ident] -= 1
        if self._per_peer[ident] <= 0:
            del self._per_peer[ident]

    def _unkind(self, kind: str) -> None:
        """(under the lock)"""
        self._per_kind[kind] -= 1
        if self._per_kind[kind] <= 0:
            del self._per_kind[kind]

    @staticmethod
    def _reject(conn: Connection, reason: str, deadline: float, drain: bool = False) -> None:
        """Tell the client why (best effort). ``drain``: read what it sent until it hangs up (to
        ``deadline``), since closing over unread bytes resets the connection and loses the reason."""
        try:
            conn.send(MsgType.REJECT, reason.encode(), deadline=deadline)
            while drain and conn.drain(deadline):
                pass
        except (NetError, OSError, ssl.SSLError):
            pass  # best effort; the connection is dropped anyway

    def _take(self, ch: str) -> Connection:
        """(under the lock) The oldest pending connection of ``ch``."""
        q = self._pending[ch]
        conn = q.popleft()[1]
        if not q:
            del self._pending[ch]
        self._unreserve(conn.identity)
        self._unkind(prefix_kind(ch))
        return conn

    def _purge(self) -> None:
        """(under the lock) Drop connections nobody claimed within ``pending_ttl`` (old epochs)."""
        cutoff = time.monotonic() - self.cfg.pending_ttl
        for ch in list(self._pending):
            while ch in self._pending and self._pending[ch][0][0] < cutoff:
                self._take(ch).close()

    def accept(self, channel: str, *, timeout: float, peer: str | None = None, name: str | None = None) -> Connection:
        """Wait for an authenticated connection on ``channel`` from identity ``peer`` (None: any
        identity of the run; the caller then checks ``conn.identity``). Connections on the
        channel from anyone else are closed and counted as refused; those whose dialer has
        closed them already are closed too."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._pending.get(channel):
                    conn = self._take(channel)
                    if peer is not None and conn.identity != peer:
                        self._rejections.append((time.monotonic(), f"{conn.peer} on channel {channel!r}, "
                                                 f"which belongs to {peer}"))
                        self.refused["channel of another identity"] += 1
                        conn.close()
                        continue
                    if conn.hung_up():  # its dialer left after we answered (it gave up, or died): a
                        conn.close()  # dead link would fail the accepter's call; its retry may be next
                        continue
                    if name:
                        conn.peer = name
                    return conn
                if self._closed:
                    raise NetError(f"listener {self.address} is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(
                        f"no authenticated connection from {name or peer or 'peer'} on channel {channel!r} "
                        f"within {timeout:.1f}s{self._recent_rejections(timeout + 60.0)}"
                    )
                self._cond.wait(left)

    def _recent_rejections(self, window: float) -> str:
        cutoff = time.monotonic() - window
        recent = [m for t, m in self._rejections if t >= cutoff]
        return f"; recently rejected: {recent[-3:]}" if recent else ""

    def discard(self, prefix: str) -> None:
        """Close pending connections whose channel starts with ``prefix``."""
        with self._cond:
            for ch in [c for c in self._pending if c.startswith(prefix)]:
                while ch in self._pending:
                    self._take(ch).close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting and close all unclaimed connections."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, {}
            self._per_peer.clear()
            self._per_kind.clear()
            self._cond.notify_all()
        try:
            self._srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._srv.close()
        for q in pending.values():
            for _, conn in q:
                conn.close()
        self._thread.join(timeout=2)
