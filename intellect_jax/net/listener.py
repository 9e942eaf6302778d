"""The accepting side: a listener that stays up and routes authenticated connections.

It authenticates every incoming connection in its own thread (a slow or hostile client
cannot block others) and files it under the channel the client asked for (e.g.
``ring/<epoch>/<src>><dst>/<stream>`` or ``blob/<name>``), so rings for new epochs, or a
background blob transfer, cost only new connections. Unclaimed connections are closed after
``pending_ttl`` seconds.

Before authentication a connection is a stranger's, so strangers get little: at most
``handshakes_per_source`` connections per source address in handshake at once (the rest are
closed on arrival, and counted), at most ``max_handshakes`` in all, and ``first_bytes_timeout``
to start the handshake, ``handshake_timeout`` to finish it. One address holding hundreds of idle
connections occupies a few slots for a couple of seconds each; peers from other addresses
(every node, every member of the run) keep getting served.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time

from intellect_jax.net import auth
from intellect_jax.net.errors import NetError, PeerTimeout
from intellect_jax.net.transport import Address, Connection, TransportConfig, _tune


class Listener:
    """Accepts and authenticates connections in the background; :meth:`accept` by channel."""

    def __init__(self, cfg: TransportConfig, host: str = "127.0.0.1", port: int = 0,
                 max_handshakes: int = 256) -> None:
        self.cfg = cfg
        self._srv = socket.create_server((host, port), backlog=128)
        self.address: Address = self._srv.getsockname()[:2]
        self._ctx = cfg.tls.server_context() if cfg.tls is not None else None
        self._cond = threading.Condition()
        self._pending: dict[str, collections.deque[tuple[float, Connection]]] = {}
        self._rejections: collections.deque[tuple[float, str]] = collections.deque(maxlen=16)
        self._slots = threading.BoundedSemaphore(max_handshakes)
        self._per_source: collections.Counter[str] = collections.Counter()  # handshakes in progress
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
            with self._cond:
                busy = self._per_source[addr[0]] >= self.cfg.handshakes_per_source
                if not busy:
                    self._per_source[addr[0]] += 1
            if busy or not self._slots.acquire(blocking=False):
                if not busy:
                    self._release_source(addr[0])
                why = "source over its handshake budget" if busy else "too many concurrent handshakes"
                self._note(f"{addr[0]}:{addr[1]}: {why}", why)
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock, addr), daemon=True).start()

    def _release_source(self, ip: str) -> None:
        with self._cond:
            self._per_source[ip] -= 1
            if self._per_source[ip] <= 0:
                del self._per_source[ip]

    def _note(self, msg: str, why: str = "handshake failed") -> None:
        with self._cond:
            self._rejections.append((time.monotonic(), msg))
            self.refused[why] += 1

    def _handshake(self, sock: socket.socket, addr: tuple) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        try:
            if not select.select([sock], [], [], self.cfg.first_bytes_timeout)[0]:
                raise PeerTimeout(f"{peer}: no handshake within {self.cfg.first_bytes_timeout:.1f}s")
            _tune(sock, self.cfg)
            sock.settimeout(self.cfg.handshake_timeout)
            if self._ctx is not None:
                sock = self._ctx.wrap_socket(sock, server_side=True)
            conn = Connection(sock, self.cfg, peer)
            deadline = time.monotonic() + self.cfg.handshake_timeout
            channel, send_key, recv_key = auth.server_handshake(conn, self.cfg.secret, self.cfg.run, deadline)
            conn.set_keys(send_key, recv_key)
            conn.channel = channel
        except Exception as e:  # noqa: BLE001 - any failure rejects this client only
            self._note(str(e) if peer in str(e) else f"{peer}: {e}",
                       "no handshake in time" if isinstance(e, PeerTimeout) else "handshake failed")
            sock.close()
            return
        finally:
            self._slots.release()
            self._release_source(addr[0])
        with self._cond:
            if self._closed:
                conn.close()
                return
            self._purge()
            self._pending.setdefault(channel, collections.deque()).append((time.monotonic(), conn))
            self._cond.notify_all()

    def _purge(self) -> None:
        """Drop connections nobody claimed within ``pending_ttl`` (old epochs)."""
        cutoff = time.monotonic() - self.cfg.pending_ttl
        for ch in list(self._pending):
            q = self._pending[ch]
            while q and q[0][0] < cutoff:
                q.popleft()[1].close()
            if not q:
                del self._pending[ch]

    def accept(self, channel: str, *, timeout: float, name: str | None = None) -> Connection:
        """Wait for an authenticated connection on ``channel``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                q = self._pending.get(channel)
                if q:
                    conn = q.popleft()[1]
                    if not q:
                        del self._pending[channel]
                    if name:
                        conn.peer = name
                    return conn
                if self._closed:
                    raise NetError(f"listener {self.address} is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(
                        f"no authenticated connection from {name or 'peer'} on channel {channel!r} "
                        f"within {timeout:.1f}s{self._recent_rejections(timeout + 60.0)}"
                    )
                self._cond.wait(left)

    def _recent_rejections(self, window: float) -> str:
        cutoff = time.monotonic() - window
        recent = [m for t, m in self._rejections if t >= cutoff]
        return f"; recently rejected handshakes: {recent[-3:]}" if recent else ""

    def discard(self, prefix: str) -> None:
        """Close pending connections whose channel starts with ``prefix``."""
        with self._cond:
            for ch in [c for c in self._pending if c.startswith(prefix)]:
                for _, conn in self._pending.pop(ch):
                    conn.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting and close all unclaimed connections."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, {}
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
