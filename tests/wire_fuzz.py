"""Shared pieces of the header fuzz tests: framed connection pairs over a socketpair (no TLS, no
listener: the framing alone, as a peer's bytes arrive), fake node endpoints that hand such
connections out, and Hypothesis strategies for JSON headers: any JSON object, a valid header
with one field of another JSON type, dropped, or added, and raw ``META`` payloads that are not
JSON objects at all."""

from __future__ import annotations

import json
import queue
import socket
from collections.abc import Collection
from typing import Any

from hypothesis import strategies as st

from intellect_jax.net.frames import MsgType
from intellect_jax.net.transport import Connection, TransportConfig

_CFG: list[TransportConfig] = []


def config() -> TransportConfig:
    """One test identity's transport config (made on first use)."""
    if not _CFG:
        from intellect_jax.testing.identities import transport_config

        _CFG.append(transport_config("fuzz", "fuzz-run", io_timeout=5.0))
    return _CFG[0]


def pair(a_peer: str = "b", b_peer: str = "a") -> tuple[Connection, Connection]:
    """Two framed connections ``a``, ``b`` over a socketpair, named for messages as their peers."""
    sa, sb = socket.socketpair()
    return Connection(sa, config(), a_peer), Connection(sb, config(), b_peer)


class FakeNet:
    """A ``NetNode`` stand-in: ``connect`` makes a pair, queues one end for ``accept``, returns the other."""

    name = "fuzz"  # this node's identity

    def __init__(self) -> None:
        self.cfg = config()
        self.pending: queue.Queue[Connection] = queue.Queue()

    def connect(self, address: Any, channel: str, **kw: Any) -> Connection:
        mine, theirs = pair(kw.get("name") or "dialled", "dialler")
        self.pending.put(theirs)
        return mine

    def accept(self, channel: str, *, timeout: float, name: str | None = None, **kw: Any) -> Connection:
        try:
            conn = self.pending.get(timeout=timeout)
        except queue.Empty:
            from intellect_jax.net.errors import PeerTimeout

            raise PeerTimeout(f"nothing on {channel}") from None
        conn.peer = name or conn.peer
        return conn


SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)


def same_type(a: Any, b: Any) -> bool:
    """Whether two JSON values have the same type (bool is no int, int no float)."""
    return type(a) is type(b)


def mutations(valid: dict[str, Any]) -> st.SearchStrategy[tuple[str, str, dict[str, Any]]]:
    """``(kind, key, header)``: ``valid`` with ``key`` set to any JSON value ("set"), dropped
    ("drop") or added ("add"), or any JSON object ("any", key "")."""
    keys = sorted(valid)
    return st.one_of(
        st.tuples(st.sampled_from(keys), JSON).map(lambda kv: ("set", kv[0], {**valid, kv[0]: kv[1]})),
        st.sampled_from(keys).map(lambda k: ("drop", k, {x: v for x, v in valid.items() if x != k})),
        st.tuples(st.text(min_size=1, max_size=8).filter(lambda k: k not in valid), JSON)
        .map(lambda kv: ("add", kv[0], {**valid, kv[0]: kv[1]})),
        st.dictionaries(st.text(max_size=8), JSON, max_size=5).map(lambda d: ("any", "", d)),
    )


def malformed(kind: str, key: str, header: dict[str, Any], valid: dict[str, Any], loose: Collection[str] = ()) -> bool:
    """Whether the mutation surely breaks the header's form: a field added, dropped or set to a
    value of another JSON type (a value of the right type may still be well-formed); ``loose``:
    fields that may also be absent or null."""
    if kind == "add":
        return True
    if key in loose and (kind == "drop" or header[key] is None):
        return False
    return kind == "drop" or (kind == "set" and not same_type(header[key], valid[key]))


RAW = st.one_of(JSON.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
                st.binary(max_size=24))  # valid JSON that is no object, or bytes that are no JSON


def send_raw(conn: Connection, raw: bytes) -> None:
    """A ``META`` frame whose payload is ``raw``, not a JSON object."""
    conn.send(MsgType.META, raw)
