"""intellect_jax.net: mutual-TLS, quantized ring all-reduce between DiLoCo nodes (numpy + sockets).

The DiLoCo layer needs only :class:`Communicator` (``all_reduce_mean(tree) -> tree`` and
``last_stats``); build the real one with :class:`NetNode` + :meth:`NetNode.ring`; the in-process
fake is :mod:`intellect_jax.testing.local_ring`. Above the frames, every layer exchanges JSON
objects (:func:`send_msg` / :func:`recv_msg`), lists of arrays (:func:`send_arrays` /
:func:`recv_arrays`) and blobs (:func:`send_blob` / :func:`recv_blob`). See ``docs/net.md``.
"""

from intellect_jax.net.arrays import recv_arrays, send_arrays
from intellect_jax.net.blob import recv_blob, send_blob
from intellect_jax.net.comm import (
    CommStats,
    Communicator,
    NetNode,
    RingConfig,
    SocketCommunicator,
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
from intellect_jax.net.identity import Authority, Credentials, IdentityError
from intellect_jax.net.listener import Listener
from intellect_jax.net.transport import (
    Address,
    Connection,
    TransportConfig,
    connect,
    parse_address,
    recv_msg,
    send_msg,
)

__all__ = [
    "Address",
    "AuthError",
    "Authority",
    "CommStats",
    "Communicator",
    "ConfigMismatch",
    "Connection",
    "Credentials",
    "FrameError",
    "IdentityError",
    "Listener",
    "NetError",
    "NetNode",
    "PeerClosed",
    "PeerTimeout",
    "RingClosed",
    "RingConfig",
    "SocketCommunicator",
    "TransportConfig",
    "connect",
    "parse_address",
    "recv_arrays",
    "recv_blob",
    "recv_msg",
    "send_arrays",
    "send_blob",
    "send_msg",
]
