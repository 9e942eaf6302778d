"""Every JSON header a peer sends is parsed by a strict schema before anything acts on it: fuzzed
headers (any JSON object, a valid one with a field of another type, dropped or added, payloads
that are no JSON object) sent into a ring peer's header check, a blob receiver, and both sides of
a multi-process node fail with a ``NetError`` (a malformed one: a ``FrameError`` naming the
field), never another exception, and the same code then serves correct messages. The joiner's
side of a state transfer: test_join_trust.py."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_jax.diloco.multihost import Follower, Followers, LeadInner, recv_parts, send_parts
from intellect_jax.net.blob import recv_blob, send_blob
from intellect_jax.net.comm import RingConfig, SocketCommunicator
from intellect_jax.net.errors import ConfigMismatch, FrameError, NetError, RingClosed
from intellect_jax.net.frames import MsgType
from intellect_jax.net.ring import Links
from intellect_jax.net.transport import recv_msg, send_msg

from wire_fuzz import JSON, RAW, FakeNet, config, malformed, mutations, pair, send_raw

FUZZ = settings(max_examples=120, deadline=None)


# ---------------------------------------------------------------------------- ring peers
def _comm(rank: int, world: int = 2) -> SocketCommunicator:
    node = SimpleNamespace(cfg=config(), listener=SimpleNamespace(discard=lambda prefix: None))
    members = [(f"r{i}", f"127.0.0.1:{1000 + i}") for i in range(world)]
    cfg = RingConfig(mode="fp32", deadline=10.0)
    return SocketCommunicator(node, members, rank, config=cfg)  # type: ignore[arg-type]


def _ring_meta(comm: SocketCommunicator) -> dict[str, Any]:
    """The header ``all_reduce_mean`` sends for a first call on a 6-element tree."""
    cfg = {k: v for k, v in asdict(comm.config).items() if k != "deadline"}
    return {"v": 6, "call": 0, "step": comm.step, "epoch": comm.epoch, "world": comm.world_size,
            "peers": comm._peers_hash, **cfg, "absent": [],
            "sig": "0123456789abcdef", "buckets": [6], "nonce": ""}


def test_a_ring_peer_meets_fuzzed_headers_with_net_errors_only() -> None:
    comm = _comm(0)
    out, down = pair("rank 1")  # we send our header downstream ...
    inn, up = pair("rank 1 (upstream)")  # ... and read the upstream rank's
    links, ours = Links([out], [inn]), _ring_meta(comm)

    def check(send: Any) -> BaseException | None:
        send(up)
        try:
            comm._check_meta(links, ours, time.monotonic() + 5)
            return None
        except NetError as e:
            return e
        finally:
            assert recv_msg(down, time.monotonic() + 5) == ours

    @FUZZ
    @given(mutations(ours))
    def fuzz(m: tuple[str, str, dict[str, Any]]) -> None:
        kind, key, header = m
        err = check(lambda c: send_msg(c, header))
        assert "\n" not in str(err)  # one line, whatever the peer wrote
        if malformed(kind, key, header, ours):
            assert isinstance(err, FrameError) and "malformed all-reduce header" in str(err)
            assert key[:20] in str(err) or kind == "add"  # the field, by name (an added one may be cut)
        elif header != ours:
            assert isinstance(err, NetError), header

    @FUZZ
    @given(RAW)
    def raw(payload: bytes) -> None:
        assert isinstance(check(lambda c: send_raw(c, payload)), FrameError)

    fuzz()
    raw()
    assert check(lambda c: send_msg(c, ours)) is None  # the connection is still in step
    err = check(lambda c: send_msg(c, {**ours, "block_size": 32}))
    assert isinstance(err, ConfigMismatch) and "block_size: theirs=32 ours=64" in str(err)


def _ring_pair() -> tuple[SocketCommunicator, SocketCommunicator]:
    """Ranks 0 and 1 of a ring, linked over socketpairs (no listener)."""
    r0, r1 = _comm(0), _comm(1)
    a, b = pair("rank 1", "rank 0")
    c, d = pair("rank 0", "rank 1")
    r0._links, r1._links = Links([a], [d]), Links([c], [b])
    return r0, r1


def test_a_ring_call_fails_on_a_malformed_header_and_the_next_ring_works() -> None:
    x = {"w": np.arange(6, dtype=np.float32)}
    r0, r1 = _ring_pair()
    bad = {**_ring_meta(r1), "buckets": "all"}
    up = r1._links.out[0]  # rank 1 speaks for itself, with a header of the wrong form
    send_msg(up, bad)
    with pytest.raises(FrameError, match=r"rank 1.*: malformed all-reduce header: buckets: Input should be a valid"):
        r0.all_reduce_mean(x)
    np.testing.assert_array_equal(x["w"], np.arange(6, dtype=np.float32))  # the input is untouched
    with pytest.raises(RingClosed):
        r0.all_reduce_mean(x)
    r1.close()
    r0, r1 = _ring_pair()  # the next epoch's ring
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(r1=r1.all_reduce_mean({"w": -x["w"] + 2})))
    t.start()
    mean = r0.all_reduce_mean(x)
    t.join(10)
    np.testing.assert_array_equal(mean["w"], np.ones(6, np.float32))
    np.testing.assert_array_equal(got["r1"]["w"], np.ones(6, np.float32))
    r0.close(), r1.close()


# ---------------------------------------------------------------------------- blobs and array lists
def test_a_blob_receiver_meets_fuzzed_headers_with_frame_errors_only() -> None:
    a, b = pair("receiver", "sender")
    valid = {"name": "x", "size": 4, "chunk": 4}

    @FUZZ
    @given(st.one_of(mutations(valid).map(lambda m: m[2]), RAW))
    def fuzz(header: Any) -> None:
        a.send(MsgType.BLOB_BEGIN, header if isinstance(header, bytes) else json.dumps(header).encode())
        with pytest.raises(NetError):  # refused, or well-formed and then no data within the deadline
            recv_blob(b, max_bytes=4, deadline=time.monotonic() + 0.1)

    for header in ({"name": "x", "size": float("inf"), "chunk": 4}, {"name": "x", "size": 1.5, "chunk": 4},
                   {"name": "x", "size": True, "chunk": 4}, {"name": 3, "size": 4, "chunk": 4}):
        a.send(MsgType.BLOB_BEGIN, json.dumps(header).encode())
        with pytest.raises(FrameError, match="malformed blob header"):
            recv_blob(b, max_bytes=4, deadline=time.monotonic() + 0.1)
    fuzz()
    send_blob(a, b"abcd")  # the same connection, still in step
    assert bytes(recv_blob(b, max_bytes=4)[1]) == b"abcd"


# ---------------------------------------------------------------------------- a multi-process node
class DataError(ValueError):
    """What the real data pipeline raises on a position it cannot take (not a NetError)."""


class FakeData:
    def __init__(self) -> None:
        self.state = {"version": 1, "step": 0, "fingerprint": "f" * 16}

    def get_state(self) -> dict[str, Any]:
        return dict(self.state)

    def set_state(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != set(self.state) or type(state["step"]) is not int:
            raise DataError(f"unsupported data iterator state: {str(state)[:80]}")
        self.state = dict(state)


class FakeTrainer:
    """Enough of a `Trainer` for every command (no devices: empty trees)."""

    def __init__(self) -> None:
        self.step, self.data = 0, FakeData()
        self.state = SimpleNamespace(params={}, opt_state={})
        self.abstract_state = SimpleNamespace(params={}, opt_state={})
        self.shardings = SimpleNamespace(params={}, opt_state={})

    def train(self, until: int, stop: Any = None) -> dict[str, Any]:
        if stop is None:  # (in one go: a fuzzed far step took the loop below hours)
            self.step = max(self.step, until)
        while self.step < until and not (stop is not None and stop()):
            self.step += 1
        return {"step": self.step}

    def evaluate(self) -> float:
        return 0.0


class FakePG:
    def mark(self, params: Any) -> None:
        pass

    def pieces(self, params: Any) -> list[Any]:
        return []


COMMANDS = [{"op": "train", "until": 3, "asks": False}, {"op": "train", "until": 3, "asks": True},
            {"op": "place", "opt": False, "step": 4, "data": {"version": 1, "step": 5, "fingerprint": "f" * 16}},
            {"op": "eval"}, {"op": "data"}]


def test_a_follower_meets_fuzzed_commands_with_net_errors_only() -> None:
    @FUZZ
    @given(st.sampled_from(COMMANDS).flatmap(lambda c: mutations(c).map(lambda m: (c, m))))
    def fuzz(cm: tuple[dict[str, Any], tuple[str, str, dict[str, Any]]]) -> None:
        valid, (kind, key, cmd) = cm
        lead, mine = pair("follower", "the node's lead process")
        follower = Follower(FakeTrainer(), FakePG(), mine)  # type: ignore[arg-type]
        send_msg(lead, cmd)
        send_msg(lead, {"op": "stop"})  # a command that was well-formed after all is served, then this
        try:
            follower.run()
            err = None
        except NetError as e:
            err = e
        finally:
            lead.close(), mine.close()
        assert "\n" not in str(err)
        if malformed(kind, key, cmd, valid, loose=("step", "data")):
            assert isinstance(err, FrameError) and "the node's lead process: malformed" in str(err), (cmd, err)

    @FUZZ
    @given(RAW)
    def raw(payload: bytes) -> None:
        lead, mine = pair("follower", "the node's lead process")
        send_raw(lead, payload)
        with pytest.raises(FrameError):
            Follower(FakeTrainer(), FakePG(), mine).run()  # type: ignore[arg-type]
        lead.close(), mine.close()

    fuzz()
    raw()
    lead, mine = pair("follower", "the node's lead process")  # a correct lead is served
    t = FakeTrainer()
    for cmd in ({"op": "train", "until": 3, "asks": False}, {"op": "data"}, {"op": "stop"}):
        send_msg(lead, cmd)
    assert Follower(t, FakePG(), mine).run() == 2 and t.step == 3  # type: ignore[arg-type]
    assert recv_msg(lead) == t.data.get_state()


def _lead() -> tuple[LeadInner, Any]:
    conn, follower = pair("follower", "the node's lead process")
    followers = Followers.__new__(Followers)  # (one follower, connected by hand: no JAX runtime here)
    followers.conns = {1: conn}
    return LeadInner(FakeTrainer(), FakePG(), followers), follower  # type: ignore[arg-type]


def test_a_lead_meets_fuzzed_replies_with_net_errors_only() -> None:
    valid = FakeData().get_state()

    @FUZZ
    @given(mutations(valid), JSON)
    def data_positions(m: tuple[str, str, dict[str, Any]], parts: Any) -> None:
        kind, key, reply = m
        lead, follower = _lead()
        send_msg(follower, reply)
        try:
            assert lead.data_state()["processes"][1] == reply  # (a mutation may leave it well-formed)
        except NetError as e:
            assert not malformed(kind, key, reply, valid) or "malformed data position" in str(e)
        else:
            assert not malformed(kind, key, reply, valid), reply
        assert recv_msg(follower) == {"op": "data"}
        send_msg(follower, {"parts": parts, "arrays": [["float32", [2]]]})
        with pytest.raises(NetError):
            recv_parts(lead.f.conns[1], max_bytes=100)
        lead.f.conns[1].close(), follower.close()

    @FUZZ
    @given(mutations({"process": 1}))
    def hellos(m: tuple[str, str, dict[str, Any]]) -> None:
        kind, key, hello = m
        net = FakeNet()
        follower = net.connect("lead", "node-processes")
        send_msg(follower, hello)
        try:
            Followers(net, 2, timeout=1.0).close()  # type: ignore[arg-type]
        except NetError as e:
            assert not malformed(kind, key, hello, {"process": 1}) or "malformed greeting" in str(e), (hello, e)
        else:
            assert hello == {"process": 1}
        follower.close()

    data_positions()
    hellos()
    lead, follower = _lead()  # correct replies are taken
    send_msg(follower, valid)
    assert lead.data_state()["processes"][1] == valid
    send_parts(follower, [(0, ((0, 2),), [np.ones(2, np.float32)])])
    assert recv_parts(lead.f.conns[1], max_bytes=100, per_part=1)[0][:2] == (0, ((0, 2),))
