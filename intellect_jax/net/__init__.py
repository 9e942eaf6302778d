"""intellect_jax.net: authenticated, quantized ring all-reduce between DiLoCo nodes (numpy + sockets).

The DiLoCo layer needs only :class:`Communicator` (``all_reduce_mean(tree) -> tree`` and
``last_stats``); build the real one with :class:`NetNode` + :meth:`NetNode.ring` (or
:func:`open_ring`); the in-process fake is :mod:`intellect_jax.testing.local_ring`. See ``docs/net.md``.
"""

from intellect_jax.net.auth import TLSConfig, load_secret
from intellect_jax.net.blob import recv_blob, send_blob
from intellect_jax.net.comm import (
    CommStats,
    Communicator,
    NetNode,
    RingConfig,
    SocketCommunicator,
    open_ring,
)
from intellect_jax.net.errors import (
    AuthError,
    ConfigMismatch,
    FrameError,
    NetError,
    PeerClosed,
    PeerTimeout,
    RingClosed,
)
from intellect_jax.net.listener import Listener
from intellect_jax.net.transport import Connection, TransportConfig, connect

__all__ = [
    "AuthError",
    "CommStats",
    "Communicator",
    "ConfigMismatch",
    "Connection",
    "FrameError",
    "Listener",
    "NetError",
    "NetNode",
    "PeerClosed",
    "PeerTimeout",
    "RingClosed",
    "RingConfig",
    "SocketCommunicator",
    "TLSConfig",
    "TransportConfig",
    "connect",
    "load_secret",
    "open_ring",
    "recv_blob",
    "send_blob",
]
