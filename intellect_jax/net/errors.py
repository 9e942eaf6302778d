"""Exceptions of the inter-node collective layer. Messages name the culprit peer."""

from __future__ import annotations


class NetError(Exception):
    """Base class: any failure of a connection, a frame, or a collective."""


class AuthError(NetError):
    """A peer is not of this run (its certificate), not who it should be, or refused us."""


class FrameError(NetError):
    """A malformed, oversized, unexpected, replayed or corrupted frame."""


class PeerTimeout(NetError, TimeoutError):
    """A peer made no progress within the I/O timeout, or a deadline expired. ``idle``: nothing of
    the awaited frame had arrived, so the connection is still in step and may be read again."""

    def __init__(self, message: str = "", *, idle: bool = False) -> None:
        super().__init__(message)
        self.idle = idle


class PeerClosed(NetError, ConnectionError):
    """A peer closed or reset the connection."""


class ConfigMismatch(NetError):
    """Peers disagree on the collective's parameters (shapes, mode, block size, ring)."""


class RingClosed(NetError):
    """The ring was torn down after a failure (or closed); build a new one."""


class AuditFailed(NetError):
    """Our audit of a butterfly owner showed a member at fault: the call fails on every rank,
    so the forged result is applied by none (the case goes to the coordinator)."""


class AuditFrameError(FrameError):
    """An audit frame whose content does not hold (a commitment its signature does not cover, a
    nonce its header did not bind, another draw): the call fails at once, naming its sender."""
