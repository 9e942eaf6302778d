"""Run secret loading, mutual HMAC-SHA256 challenge-response, and TLS contexts.

Handshake (every connection, before any data; channel = what the connection is for):

1. client -> HELLO     client_nonce(32) | channel
2. server -> CHALLENGE server_nonce(32) | HMAC(secret, "srv" | run | cn | sn | channel)
3. client -> PROOF     HMAC(secret, "cli" | run | cn | sn | channel)
4. server -> ACCEPT    (or REJECT with a reason, at any step)

Both sides prove knowledge of the secret on fresh nonces (no replay, no reflection: the
two proofs use different labels). Session keys for the per-frame header MAC are derived
from the secret and both nonces, one per direction.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
import stat
import warnings
from dataclasses import dataclass
from typing import Protocol

from intellect_jax.net.errors import AuthError, PeerClosed
from intellect_jax.net.frames import Header, MsgType

SECRET_ENV = "INTELLECT_NET_SECRET"
SECRET_FILE_ENV = "INTELLECT_NET_SECRET_FILE"
MIN_SECRET_BYTES = 16
NONCE_LEN = 32
MAX_CHANNEL_BYTES = 512


def load_secret(path: str | os.PathLike[str] | None = None, env: str = SECRET_ENV) -> bytes:
    """Read the run secret from a file (``path`` or ``$INTELLECT_NET_SECRET_FILE``) or ``$env``.

    Never from the command line (visible in ``ps``). Raises :class:`AuthError` if none is
    set or it is shorter than 16 bytes; warns if the file is readable by group or others.
    """
    path = path or os.environ.get(SECRET_FILE_ENV)
    if path:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.warn(f"run secret file {path} is accessible by group/others; chmod 600 it", stacklevel=2)
        with open(path, "rb") as f:
            secret = f.read().strip()
        source = f"file {path}"
    else:
        secret = os.environ.get(env, "").encode()
        source = f"${env}"
        if not secret:
            raise AuthError(f"no run secret: set ${env} or ${SECRET_FILE_ENV} (a file with the secret)")
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"run secret from {source} is {len(secret)} bytes; need at least {MIN_SECRET_BYTES}")
    return secret


@dataclass(frozen=True)
class TLSConfig:
    """Certificates for TLS on every connection (mutual TLS when ``cafile`` is set).

    Peers are addressed by IP, so host names are not checked; the certificate must chain
    to ``cafile``, and the HMAC handshake still runs inside TLS.
    """

    certfile: str
    keyfile: str
    cafile: str | None = None

    def server_context(self) -> ssl.SSLContext:
        """Context for the listening side."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.certfile, self.keyfile)
        if self.cafile:
            ctx.load_verify_locations(self.cafile)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """Context for the connecting side."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.load_cert_chain(self.certfile, self.keyfile)
        if self.cafile:
            ctx.load_verify_locations(self.cafile)
            ctx.verify_mode = ssl.CERT_REQUIRED
        else:
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


class FrameIO(Protocol):
    """What the handshake needs from a connection (unkeyed frames)."""

    peer: str

    def send(self, mtype: MsgType, payload: bytes = b"", *, deadline: float | None = None) -> bytes: ...

    def recv(self, expect: MsgType, *, deadline: float | None = None, max_len: int = ...) -> tuple[Header, bytes]: ...


def _proof(secret: bytes, label: bytes, run: bytes, cn: bytes, sn: bytes, channel: bytes) -> bytes:
    return hmac.digest(secret, b"IJNT-" + label + run + cn + sn + channel, "sha256")


def _session_keys(secret: bytes, run: bytes, cn: bytes, sn: bytes, channel: bytes) -> tuple[bytes, bytes]:
    k = _proof(secret, b"key", run, cn, sn, channel)
    return hmac.digest(k, b"c2s", "sha256"), hmac.digest(k, b"s2c", "sha256")


def client_handshake(io: FrameIO, secret: bytes, run: bytes, channel: str, deadline: float) -> tuple[bytes, bytes]:
    """Authenticate to a server; returns ``(send_key, recv_key)``."""
    ch = channel.encode()
    cn = os.urandom(NONCE_LEN)
    io.send(MsgType.HELLO, cn + ch, deadline=deadline)
    payload = io.recv(MsgType.CHALLENGE, deadline=deadline, max_len=4096)[1]
    if len(payload) != 2 * NONCE_LEN:
        raise AuthError(f"{io.peer}: malformed handshake challenge")
    sn, sproof = payload[:NONCE_LEN], payload[NONCE_LEN:]
    if not hmac.compare_digest(sproof, _proof(secret, b"srv", run, cn, sn, ch)):
        raise AuthError(f"{io.peer} failed authentication (different run secret or run id)")
    io.send(MsgType.PROOF, _proof(secret, b"cli", run, cn, sn, ch), deadline=deadline)
    io.recv(MsgType.ACCEPT, deadline=deadline, max_len=0)
    c2s, s2c = _session_keys(secret, run, cn, sn, ch)
    return c2s, s2c


def server_handshake(io: FrameIO, secret: bytes, run: bytes, deadline: float) -> tuple[str, bytes, bytes]:
    """Authenticate a client; returns ``(channel, send_key, recv_key)``.

    Sends REJECT (with a reason) and raises :class:`AuthError` if the client fails; a
    REJECT received by the client surfaces there as :class:`AuthError` too (see transport).
    """
    hdr, payload = io.recv(MsgType.HELLO, deadline=deadline, max_len=NONCE_LEN + MAX_CHANNEL_BYTES)
    if hdr.run != run:
        _reject(io, "run id mismatch", deadline)
        raise AuthError(f"{io.peer}: handshake for another run id")
    if len(payload) <= NONCE_LEN:
        _reject(io, "malformed hello", deadline)
        raise AuthError(f"{io.peer}: malformed handshake hello")
    cn, ch = payload[:NONCE_LEN], payload[NONCE_LEN:]
    try:
        channel = ch.decode()
    except UnicodeDecodeError:
        _reject(io, "malformed channel", deadline)
        raise AuthError(f"{io.peer}: malformed channel name") from None
    sn = os.urandom(NONCE_LEN)
    io.send(MsgType.CHALLENGE, sn + _proof(secret, b"srv", run, cn, sn, ch), deadline=deadline)
    try:
        proof = io.recv(MsgType.PROOF, deadline=deadline, max_len=64)[1]
    except PeerClosed:
        raise AuthError(f"{io.peer} hung up during the handshake (it does not share our run secret?)") from None
    if not hmac.compare_digest(proof, _proof(secret, b"cli", run, cn, sn, ch)):
        _reject(io, "authentication failed", deadline)
        raise AuthError(f"{io.peer} failed authentication on channel {channel!r} (wrong run secret)")
    io.send(MsgType.ACCEPT, deadline=deadline)
    c2s, s2c = _session_keys(secret, run, cn, sn, ch)
    return channel, s2c, c2s


def _reject(io: FrameIO, reason: str, deadline: float) -> None:
    try:
        io.send(MsgType.REJECT, reason.encode(), deadline=deadline)
    except Exception:  # noqa: BLE001 - best effort; the connection is dropped anyway
        pass


def fingerprint(secret: bytes) -> str:
    """Short, non-reversible identifier of a secret for logs (never log the secret)."""
    return hashlib.sha256(b"IJNT-fp" + secret).hexdigest()[:12]
