"""Mutual-TLS transport: connections bound to identities, a listener that routes by channel.

* :class:`Connection` sends and receives frames (see :mod:`.frames`); payloads go out as
  memoryviews of the caller's buffers and come in with ``recv_into`` into preallocated buffers.
  Every blocking call waits at most ``io_timeout`` without progress and never past the
  caller's deadline. ``conn.identity`` is the verified identity at the other end.
* :func:`connect` dials a peer (retrying until a timeout), runs TLS 1.3 with both sides'
  certificates (:mod:`.identity`), checks the peer is who the caller expects, and names the
  channel; :class:`~intellect_jax.net.listener.Listener` is the accepting side.
* :func:`send_msg` / :func:`recv_msg`: one JSON object in a ``META`` frame, the one way every
  layer exchanges small messages (requests, commands, headers).

A connection supports one sending and one receiving thread at a time.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from intellect_jax.net.errors import AuthError, FrameError, PeerClosed, PeerTimeout
from intellect_jax.net.identity import Credentials, peer_identity
from intellect_jax.net.frames import (
    HEADER_LEN,
    INTEGRITY,
    Header,
    MsgType,
    check_payload,
    pack_header,
    parse_header,
    payload_tag,
    run_hash,
)

Address = tuple[str, int]
Buffer = bytes | bytearray | memoryview | np.ndarray
MAX_MSG = 1 << 20  # default size limit of one JSON message
MAX_CHANNEL_BYTES = 512


def parse_address(addr: Address | str) -> Address:
    """``"host:port"`` (IPv6 hosts in brackets) or ``(host, port)`` -> ``(host, port)``; addresses
    also come from peers (a ring's member list), so anything else raises ``ValueError``."""
    if isinstance(addr, str):
        host, sep, port = addr.rpartition(":")
        host = host.strip("[]")
    elif isinstance(addr, (tuple, list)) and len(addr) == 2:
        (host, port), sep = addr, ":"
    else:
        raise ValueError(f"not an address: {str(addr)[:80]!r}")
    if not sep or not isinstance(host, str) or type(port) not in (int, str) \
            or not str(port).isdigit() or int(port) >= 1 << 16:  # port 0: listen on any free port
        raise ValueError(f"not a host:port address: {str(addr)[:80]!r}")
    return host, int(port)


@dataclass(frozen=True)
class TransportConfig:
    """Everything a node needs to talk to its peers: the run id, its own identity (key,
    certificate, the run authority, the revocation list) and the limits of its connections."""

    run_id: str
    identity: Credentials
    io_timeout: float = 30.0
    connect_timeout: float = 30.0
    handshake_timeout: float = 10.0
    max_frame_bytes: int = 64 << 20
    integrity: str = "crc32"  # TLS authenticates every byte; the payload tag only catches framing bugs
    keepalive: tuple[int, int, int] = (10, 5, 3)  # idle s, interval s, probes
    sock_buf_bytes: int | None = None
    notsent_lowat: int | None = 128 << 10  # unsent bytes a butterfly link queues (Connection.bound_unsent)
    pending_ttl: float = 300.0  # an authenticated connection nobody claims is closed after this
    pending_per_peer: int = 64  # unclaimed authenticated connections one identity may hold
    pending_per_prefix: int = 4096  # ... all identities together, per channel prefix (ring, state, ...)
    first_bytes_timeout: float = 2.0  # an unauthenticated client must send its whole TLS hello this soon
    handshakes_per_source: int = 8  # unauthenticated connections in handshake at once, per source address
    handshakes_per_prefix: int = 32  # ... per /24 (IPv4) or /64 (IPv6) network

    def __post_init__(self) -> None:
        if self.integrity not in INTEGRITY:
            raise ValueError(f"unknown integrity {self.integrity!r}; expected one of {list(INTEGRITY)}")
        if min(self.io_timeout, self.connect_timeout, self.handshake_timeout, self.first_bytes_timeout) <= 0:
            raise ValueError("timeouts must be positive")
        if min(self.handshakes_per_source, self.handshakes_per_prefix, self.pending_per_peer,
               self.pending_per_prefix) < 1:
            raise ValueError("handshakes_per_source, handshakes_per_prefix, pending_per_peer and pending_per_prefix "
                             "must be >= 1")
        if self.notsent_lowat is not None and self.notsent_lowat < 1:
            raise ValueError(f"notsent_lowat must be >= 1 byte (or None), not {self.notsent_lowat}")
        if self.max_frame_bytes < 1 << 16:
            raise ValueError("max_frame_bytes must be at least 64 KiB")

    @property
    def name(self) -> str:
        """This side's identity."""
        return self.identity.name

    @property
    def run(self) -> bytes:
        """16-byte run hash carried by every frame."""
        return run_hash(self.run_id)


def _tune(sock: socket.socket, cfg: TransportConfig) -> None:
    """TCP_NODELAY, keepalive, user timeout and optional buffer sizes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, intvl, cnt = cfg.keepalive
    for opt, val in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", intvl), ("TCP_KEEPCNT", cnt)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # unacknowledged data -> error (dead peer, no FIN)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(cfg.io_timeout * 1000))
    if cfg.sock_buf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.sock_buf_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, cfg.sock_buf_bytes)


def _bytes_view(buf: Buffer) -> memoryview:
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class Connection:
    """One framed connection to a peer (TLS, except in unit tests of the framing):
    ``identity``/``serial`` are the peer certificate's, ``peer`` a name for messages."""

    def __init__(self, sock: socket.socket, cfg: TransportConfig, peer: str, channel: str = "",
                 identity: str = "", serial: int = 0, cert: bytes = b"") -> None:
        self.cfg = cfg
        self.peer = peer
        self.channel = channel
        self.identity = identity
        self.serial = serial
        self.cert = cert  # the peer's certificate (DER): checks what it signs
        self.bytes_sent = 0
        self.bytes_received = 0
        self._sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._waitall = 0 if self._tls else socket.MSG_WAITALL
        self._run = cfg.run
        self._send_seq = 0
        self._recv_seq = 0
        self.unread: Header | None = None  # the last header received whose payload has not been read
        self._timeouts: dict[int, float] = {}
        # plain TCP: a blocking socket, timeouts enforced by the kernel; TLS: non-blocking, each
        # call waiting with its own poll, since Python's one socket timeout would be shared by the
        # sending and the receiving thread (each would wait by the other's deadline)
        sock.settimeout(0.0 if self._tls else None)
        # (TLS) one OpenSSL object serves both directions, its last error and retry state shared:
        # each non-blocking call holds this lock (never a wait), so a sending and a receiving
        # thread each read their own call's outcome
        self._ssl_lock = threading.Lock() if self._tls else contextlib.nullcontext()

    def _arm(self, opt: int, t: float) -> None:
        """(plain TCP) Set the kernel timeout of one direction (a syscall, so only when it
        changes): one ``recv(MSG_WAITALL)`` or ``sendmsg`` then moves a whole payload, instead of
        a Python loop of poll + partial reads."""
        old = self._timeouts.get(opt)
        if old is not None and abs(old - t) <= 0.05 * t:
            return
        self._timeouts[opt] = t
        t = max(t, 0.001)  # 0 would mean "forever"
        self._sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(t), int(t % 1 * 1e6)))

    def _ready(self, e: ssl.SSLError, t: float) -> bool:
        """(TLS) Wait up to ``t`` s until the socket can do what OpenSSL asked for (``e``: it wants
        to read, or to write); False if it cannot by then."""
        fd = self._sock.fileno()
        if fd < 0:
            raise PeerClosed(f"{self.peer}: connection closed")
        poller = select.poll()
        poller.register(fd, select.POLLOUT if isinstance(e, ssl.SSLWantWriteError) else select.POLLIN)
        return bool(poller.poll(max(t, 0.001) * 1000))

    def _timeout(self, deadline: float | None, what: str) -> float:
        t = self.cfg.io_timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(f"{self.peer}: deadline expired while {what}")
            t = min(t, left)
        return t

    def _send_views(self, views: list[memoryview], deadline: float | None, what: str) -> None:
        views = [v for v in views if v.nbytes]
        while views:
            t = self._timeout(deadline, what)
            try:
                if self._tls:  # (a retry after "wants to write" passes the same view, as OpenSSL needs)
                    with self._ssl_lock:
                        k = self._sock.send(views[0])
                else:
                    self._arm(socket.SO_SNDTIMEO, t)
                    k = self._sock.sendmsg(views)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError) as e:
                if not self._ready(e, t):
                    raise PeerTimeout(f"{self.peer}: no progress for {t:.1f}s while {what}") from None
                continue
            except (TimeoutError, BlockingIOError):
                raise PeerTimeout(f"{self.peer}: no progress for {t:.1f}s while {what}") from None
            except OSError as e:
                raise PeerClosed(f"{self.peer}: connection lost while {what} ({e})") from None
            while k:
                if k >= views[0].nbytes:
                    k -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][k:]
                    k = 0

    def _recv_into(self, mv: memoryview, deadline: float | None, what: str) -> None:
        got, n = 0, mv.nbytes
        while got < n:
            t = self._timeout(deadline, "receiving")
            try:
                if not self._tls:
                    self._arm(socket.SO_RCVTIMEO, t)
                with self._ssl_lock:
                    k = self._sock.recv_into(mv[got:], n - got, self._waitall)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
                if self._ready(e, t):
                    continue
                raise PeerTimeout(f"{self.peer}: no data for {t:.1f}s while receiving {what}",
                                  idle=got == 0 and what == "a frame header") from None
            except (TimeoutError, BlockingIOError):
                raise PeerTimeout(f"{self.peer}: no data for {t:.1f}s while receiving {what}",
                                  idle=got == 0 and what == "a frame header") from None
            except ssl.SSLError as e:
                raise FrameError(f"{self.peer}: TLS error while receiving {what} ({e})") from None
            except OSError as e:
                raise PeerClosed(f"{self.peer}: connection lost while receiving {what} ({e})") from None
            if k == 0:
                raise PeerClosed(f"{self.peer} closed the connection while we were receiving {what} ({got}/{n} bytes)")
            got += k
        self.bytes_received += n

    def drain(self, deadline: float) -> bool:
        """Read and drop what the peer sent: False once it has closed the connection."""
        while True:
            t = self._timeout(deadline, "draining")
            try:
                if not self._tls:
                    self._arm(socket.SO_RCVTIMEO, t)
                with self._ssl_lock:
                    return len(self._sock.recv(4096)) > 0
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
                if not self._ready(e, t):
                    raise PeerTimeout(f"{self.peer}: still sending while we drain the connection") from None
            except (TimeoutError, BlockingIOError):
                raise PeerTimeout(f"{self.peer}: still sending while we drain the connection") from None
            except (OSError, ssl.SSLError):
                return False

    def send(
        self, mtype: MsgType, payload: Buffer = b"", *, deadline: float | None = None, ptag: bytes | None = None
    ) -> bytes:
        """Send one frame; returns the payload tag (pass ``ptag`` to forward a verified payload)."""
        mv = _bytes_view(payload)
        n = mv.nbytes
        if n > self.cfg.max_frame_bytes:
            raise FrameError(f"refusing to send a {n}-byte frame to {self.peer} (limit {self.cfg.max_frame_bytes})")
        if ptag is None:
            ptag = payload_tag(mv, self.cfg.integrity)
        hdr = pack_header(mtype, self._run, self._send_seq, n, ptag, self.cfg.integrity)
        self._send_seq += 1
        self._send_views([memoryview(hdr), mv], deadline, "sending a frame")
        self.bytes_sent += HEADER_LEN + n
        return ptag

    def bound_unsent(self, nbytes: int | None) -> None:
        """Queue at most about ``nbytes`` unsent in the kernel (``TCP_NOTSENT_LOWAT``; None: the
        kernel's bound, megabytes). A bulk sender then no longer queues megabytes ahead of its next
        small frame (an audit step), which would wait behind them for their time on the wire; data
        in flight is not bounded, so neither is throughput. For a link that its peer reads all along,
        or nearly (a butterfly receiver pauses between a peer's nonce and the audit's draw): a
        send now blocks as soon as that much waits and the peer's window is full."""
        if nbytes is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, nbytes)

    def recv_header(
        self,
        expect: MsgType | tuple[MsgType, ...],
        *,
        deadline: float | None = None,
        length: int | None = None,
        max_len: int | None = None,
    ) -> Header:
        """Receive and validate the next header (of type ``expect``, or one of them); the caller
        then reads its payload."""
        raw = bytearray(HEADER_LEN)
        self._recv_into(memoryview(raw), deadline, "a frame header")
        limit = self.cfg.max_frame_bytes if max_len is None else min(max_len, self.cfg.max_frame_bytes)
        self.unread = None  # (a header that does not parse: nothing after it is of any use)
        hdr = parse_header(raw, peer=self.peer, run=self._run, max_len=self.cfg.max_frame_bytes,
                           integrity=self.cfg.integrity)
        if hdr.seq != self._recv_seq:
            raise FrameError(f"{self.peer}: frame seq {hdr.seq}, expected {self._recv_seq} (replayed or lost frame)")
        self._recv_seq += 1
        self.unread = hdr
        wanted = expect if isinstance(expect, tuple) else (expect,)
        if hdr.mtype not in wanted:
            if hdr.mtype == MsgType.REJECT and hdr.length <= 4096:
                reason = self._read(hdr, deadline).decode(errors="replace")
                raise AuthError(f"{self.peer} rejected us: {' '.join(reason.split())[:200]!r}")
            raise FrameError(f"{self.peer}: expected a {' or '.join(t.name for t in wanted)} frame, "
                             f"got {hdr.mtype.name}")
        if hdr.length > limit:
            raise FrameError(f"{self.peer}: {hdr.mtype.name} frame announces {hdr.length} bytes, above {limit}")
        if length is not None and hdr.length != length:
            raise FrameError(f"{self.peer}: {hdr.mtype.name} frame of {hdr.length} bytes, expected {length}")
        return hdr

    def recv_payload_into(self, hdr: Header, out: Buffer, *, deadline: float | None = None) -> None:
        """Read the payload announced by ``hdr`` into ``out`` (exactly its size) and verify it."""
        mv = _bytes_view(out)
        if mv.nbytes != hdr.length:
            raise ValueError(f"buffer of {mv.nbytes} bytes for a {hdr.length}-byte payload")
        try:
            self._recv_into(mv, deadline, "a frame payload")
        finally:  # (read, or cut off part way: either way not to be read past again)
            if self.unread is hdr:
                self.unread = None
        check_payload(mv, hdr, self.cfg.integrity, self.peer)

    def skip_unread(self, *, deadline: float | None = None) -> None:
        """Read past the payload of the last header received, if it has not been read (a frame
        its reader refused: the next header follows it)."""
        hdr, chunk = self.unread, 1 << 20
        if hdr is None:
            return
        buf, left = bytearray(min(hdr.length, chunk)), hdr.length
        while left:
            n = min(left, chunk)
            self._recv_into(memoryview(buf)[:n], deadline, "a frame payload")
            left -= n
        self.unread = None

    def _read(self, hdr: Header, deadline: float | None) -> bytes:
        buf = bytearray(hdr.length)
        self.recv_payload_into(hdr, buf, deadline=deadline)
        return bytes(buf)

    def recv(
        self, expect: MsgType, *, deadline: float | None = None, max_len: int | None = None
    ) -> tuple[Header, bytes]:
        """Receive a whole (small) frame of type ``expect``."""
        hdr = self.recv_header(expect, deadline=deadline, max_len=max_len)
        return hdr, self._read(hdr, deadline)

    def hung_up(self) -> bool:
        """Whether the peer has closed its end with nothing left for us to read (a look that
        neither waits nor consumes anything)."""
        try:
            if getattr(self._sock, "pending", lambda: 0)():
                return False  # (bytes already decrypted and buffered)
            poll = select.poll()  # (not select.select: descriptors past 1023)
            poll.register(self._sock, select.POLLIN)
            if not poll.poll(0):
                return False  # (nothing has come, not even its end)
            return socket.socket.recv(self._sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):  # (reset, or closed here already)
            return True

    def abort(self) -> None:
        """Shut the socket down so that blocked threads wake up with an error."""
        shut(self._sock)

    def close(self) -> None:
        """Abort and release the socket."""
        self.abort()
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_msg(conn: Connection, msg: dict[str, Any], deadline: float | None = None) -> None:
    """Send one JSON object (compact) in a ``META`` frame."""
    if not isinstance(msg, dict):
        raise TypeError(f"a message is a JSON object, not {type(msg).__name__}")
    conn.send(MsgType.META, json.dumps(msg, separators=(",", ":")).encode(), deadline=deadline)


def recv_msg(conn: Connection, deadline: float | None = None, max_len: int = MAX_MSG) -> dict[str, Any]:
    """Receive one JSON object of at most ``max_len`` bytes. Anything else (bad UTF-8, bad JSON,
    a valid JSON value that is not an object) raises :class:`FrameError` here, so callers may
    index the result without meeting the peer's mistakes as ``AttributeError`` later."""
    _, raw = conn.recv(MsgType.META, deadline=deadline, max_len=max_len)
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON; nesting too deep
        raise FrameError(f"{conn.peer}: malformed JSON message ({e})") from None
    if not isinstance(msg, dict):
        raise FrameError(f"{conn.peer}: a message must be a JSON object, got {type(msg).__name__}")
    return msg


def shut(sock: socket.socket) -> None:
    """Shut a socket down both ways, so that threads blocked on it wake up with an error (nothing
    if it is closed already)."""
    try:  # the descriptor's shutdown, not SSLSocket's: that one drops the OpenSSL object, and a
        # thread still in a call would go on with plain reads of ciphertext or fail oddly
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def connect(cfg: TransportConfig, address: Address, channel: str, *, expect: str | None = None,
            timeout: float | None = None, name: str | None = None,
            dialing: Callable[[socket.socket], None] | None = None) -> Connection:
    """Dial ``address`` and open ``channel`` on it over mutual TLS 1.3, retrying refused or
    dropped attempts until ``timeout``. ``expect``: the identity the peer must hold (an
    :class:`AuthError` otherwise); None accepts any identity of the run (the caller checks).
    An attempt whose channel request went out waits for the answer as long as the listener may
    take to send it (``handshake_timeout`` + 2 ``first_bytes_timeout`` from the end of our TLS
    handshake), even past ``timeout``: the listener queues the connection for its accepter as
    it answers and cannot tell that we left, so a dial given up then reaches the accepter as a
    link closed before its first frame (a caller that dials in short slices, to stay abortable,
    failed its peer that way under load). So ``connect`` may take that much longer than
    ``timeout`` when a peer stops right after the TLS handshake. ``dialing`` is handed each
    try's socket as it opens: shutting it down ends that try at once (an abort)."""
    timeout = cfg.connect_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    peer = name or f"{address[0]}:{address[1]}"
    delay, last = 0.02, None
    drops = others = 0  # tries that got through TLS and no further; tries that failed otherwise
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if drops >= 2 and not others:  # never refused, never silent: it hangs up on us after TLS
                raise AuthError(f"{peer} dropped the connection on channel {channel!r} after the TLS handshake, "
                                f"{drops} times in {timeout:.1f}s (our certificate refused?): {last}")
            raise PeerTimeout(f"could not connect to {peer} within {timeout:.1f}s ({last})")
        try:
            return _open(cfg, address, channel, expect, peer, min(left, cfg.handshake_timeout), dialing)
        except _Retry as e:
            cause = e.__cause__
            if isinstance(cause, PeerClosed):
                drops += 1
            elif not (isinstance(cause, TimeoutError) and time.monotonic() >= deadline):  # not cut short by us
                others += 1
            last = cause
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(2 * delay, 0.5)


class _Retry(Exception):
    """A connection attempt that failed before anyone's identity was judged."""


def _open(cfg: TransportConfig, address: Address, channel: str, expect: str | None, peer: str,
          timeout: float, dialing: Callable[[socket.socket], None] | None) -> Connection:
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as e:
        raise _Retry() from e
    try:
        if dialing is not None:
            dialing(sock)
        _tune(sock, cfg)
        sock.settimeout(timeout)
        try:
            tls = cfg.identity.client_context.wrap_socket(sock)
        except ssl.SSLCertVerificationError as e:
            raise AuthError(f"{peer}: certificate not of this run ({e.verify_message})") from None
        except ssl.SSLError as e:
            if "alert" in str(e).lower():  # the peer refused our certificate
                raise AuthError(f"{peer} refused our certificate ({e.reason})") from None
            raise _Retry() from e
        except (OSError, EOFError) as e:  # dropped before the handshake finished (listener over budget)
            raise _Retry() from e
        sock = tls
        if dialing is not None:  # (the TLS socket holds the descriptor now; the plain one is detached)
            dialing(tls)
        ident, serial, cert = peer_identity(tls)
        if cfg.identity.revocations.revoked(serial):
            raise AuthError(f"{peer}: identity {ident} is revoked")
        if expect is not None and ident != expect:
            raise AuthError(f"{peer} is {ident!r}, not {expect!r}")
        conn = Connection(tls, cfg, peer, channel, ident, serial, cert)
        # (not the dial's deadline, see connect: the listener's runs handshake_timeout from the end of
        # its TLS handshake, which it may finish up to 2 first_bytes_timeout after the connection came)
        hs_deadline = time.monotonic() + cfg.handshake_timeout + 2 * cfg.first_bytes_timeout
        try:
            try:
                conn.send(MsgType.HELLO, channel.encode(), deadline=hs_deadline)
            except PeerClosed:  # it hung up already: its alert, if it sent one, is still to be read
                conn.recv(MsgType.ACCEPT, deadline=hs_deadline, max_len=0)
                raise
            conn.recv(MsgType.ACCEPT, deadline=hs_deadline, max_len=0)
        except FrameError as e:  # it answered, not with ACCEPT: a TLS alert (TLS 1.3 refuses a client
            # certificate after the handshake), or a frame of another run or protocol
            if "TLS error" in str(e) and "alert" not in str(e).lower():  # a record cut or garbled on the
                raise _Retry() from e  # way (a peer going away mid-stream, e.g. restarting): no refusal
            raise AuthError(f"{peer} refused the connection on channel {channel!r}: {e}") from None
        except PeerClosed as e:  # dropped without a word: most likely it went away (killed, restarted)
            raise _Retry() from e  # ... or its TLS alert was lost to a reset: an AuthError at the deadline
    except BaseException:
        sock.close()
        raise
    return conn
