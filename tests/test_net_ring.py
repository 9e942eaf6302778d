"""Ring all-reduce over real sockets (ranks as threads in one process) and the local fake."""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

import numpy as np
import pytest

from intellect_jax.net import (
    AuthError,
    Authority,
    ConfigMismatch,
    Credentials,
    NetError,
    NetNode,
    PeerTimeout,
    RingClosed,
    RingConfig,
    TransportConfig,
)
from intellect_jax.coordinator.policing import weigh
from intellect_jax.coordinator.schema import Evidence
from intellect_jax.net.evidence import verdict
from intellect_jax.net.frames import HEADER_LEN
from intellect_jax.testing.identities import credentials, transport_config
from intellect_jax.testing.local_ring import LocalGroup, ring_bytes
from intellect_jax.net.plan import simulate

def _nodes(n: int, first: int = 0, **kw: Any) -> list[NetNode]:
    """``n`` nodes with identities ``r<first>``, ``r<first+1>``, ... of the test authority."""
    kw.setdefault("io_timeout", 5.0)
    return [NetNode(transport_config(f"r{first + i}", "ring-test", **kw)) for i in range(n)]


def _members(nodes: list[NetNode]) -> list[tuple[str, Any]]:
    return [(n.name, n.address) for n in nodes]


def _run(comms: list[Any], inputs: list[Any], **call_kw: Any) -> tuple[list[Any], list[BaseException | None]]:
    outs: list[Any] = [None] * len(comms)
    errs: list[BaseException | None] = [None] * len(comms)

    def go(r: int) -> None:
        try:
            outs[r] = comms[r].all_reduce_mean(inputs[r], **call_kw)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            errs[r] = e

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs, errs


def _ring(nodes: list[NetNode], cfg: RingConfig, epoch: int = 0) -> list[Any]:
    return [n.ring(_members(nodes), r, epoch=epoch, config=cfg) for r, n in enumerate(nodes)]


def _inputs(world: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    for x in xs:
        x[rng.integers(0, n, max(1, n // 500))] *= 25
    return xs


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8"])
def test_ring_bit_identical_and_equal_to_fake(world: int, mode: str) -> None:
    n = 10_007  # divisible neither by the world size nor by the block
    cfg = RingConfig(mode=mode, block_size=64, piece_numel=700, deadline=30)
    xs = _inputs(world, n)
    copies = [x.copy() for x in xs]
    nodes = _nodes(world)
    try:
        outs, errs = _run(_ring(nodes, cfg), xs)
    finally:
        for node in nodes:
            node.close()
    assert errs == [None] * world
    ref = simulate(xs, mode, 64, 700)  # the fake (LocalGroup) computes exactly this: see test_net_local
    for r in range(world):
        assert _same_bits(outs[r], outs[0]), f"rank {r} differs from rank 0"
        assert _same_bits(outs[r], ref)
        assert np.array_equal(xs[r], copies[r]), "input modified"
    true = np.mean(np.stack(xs).astype(np.float64), axis=0)
    tol = {"fp32": 1e-6, "bf16": 1e-2, "int8": 3e-2}[mode] if world > 1 else 0.0
    assert np.linalg.norm(outs[0] - true) / np.linalg.norm(true) <= tol


def test_fp32_sums_in_ring_order() -> None:
    xs = _inputs(3, 999)
    nodes = _nodes(3)
    try:
        outs, errs = _run(_ring(nodes, RingConfig(mode="fp32", piece_numel=100)), xs)
    finally:
        for node in nodes:
            node.close()
    assert errs == [None] * 3
    plan_bounds = [0, 320, 640, 999]  # block-aligned segments of 64-element blocks
    expect = np.empty(999, np.float32)
    for c in range(3):
        a, b = plan_bounds[c], plan_bounds[c + 1]
        acc = xs[c][a:b].copy()
        for k in (1, 2):
            acc = acc + xs[(c + k) % 3][a:b]
        expect[a:b] = acc / np.float32(3)
    assert _same_bits(outs[1], expect)


def test_int8_over_sockets_within_one_percent() -> None:
    world, n = 4, 1 << 19
    rng = np.random.default_rng(1)
    shared = rng.standard_normal(n)
    xs = [(0.7 * shared + 0.7 * rng.standard_normal(n)).astype(np.float32) for _ in range(world)]
    for x in xs:
        x[rng.integers(0, n, n // 10_000)] *= 20
    nodes = _nodes(world)
    try:
        outs, errs = _run(_ring(nodes, RingConfig(mode="int8", streams=2)), xs)
    finally:
        for node in nodes:
            node.close()
    assert errs == [None] * world
    true = np.mean(np.stack(xs).astype(np.float64), axis=0)
    assert np.linalg.norm(outs[2] - true) / np.linalg.norm(true) < 0.01


def test_streams_pytrees_buckets_out_and_reuse() -> None:
    world = 3
    rng = np.random.default_rng(2)
    trees = [{"w": rng.standard_normal((37, 11)).astype(np.float32),
              "b": [rng.standard_normal(5).astype(np.float32), np.float32(rng.standard_normal()) * np.ones((), np.float32)],
              "e": np.zeros((0, 3), np.float32)} for _ in range(world)]
    cfg = RingConfig(mode="int8", block_size=16, streams=3, piece_numel=64, bucket_numel=200, deadline=30)
    nodes = _nodes(world)
    try:
        comms = _ring(nodes, cfg)
        outs, errs = _run(comms, trees)
        assert errs == [None] * world
        again, errs = _run(comms, trees)  # connections are reused
        assert errs == [None] * world
        outs_buf = [{"w": np.empty((37, 11), np.float32), "b": [np.empty(5, np.float32), np.empty((), np.float32)],
                     "e": np.empty((0, 3), np.float32)} for _ in range(world)]
        res = [None] * world

        def go(r: int) -> None:
            res[r] = comms[r].all_reduce_mean(trees[r], out=outs_buf[r])

        threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        stats = comms[1].last_stats
    finally:
        for node in nodes:
            node.close()
    fake = LocalGroup(world, cfg).all_reduce_mean_all(trees)
    for r in range(world):
        for key in ("w", "e"):
            assert _same_bits(outs[r][key], fake[0][key]) and _same_bits(again[r][key], fake[0][key])
        for i in (0, 1):  # b[1] is a 0-d leaf
            assert _same_bits(outs[r]["b"][i], fake[0]["b"][i]) and _same_bits(again[r]["b"][i], fake[0]["b"][i])
        assert outs[r]["b"][1].shape == ()
        assert res[r]["w"] is outs_buf[r]["w"] and _same_bits(outs_buf[r]["w"], fake[0]["w"])
    numel = 37 * 11 + 5 + 1
    assert stats.numel == numel and stats.mode == "int8" and stats.seconds > 0
    # leaves in pytree order: b[0] (5), b[1] (1), e (0) | w (407): two buckets of <= 200 or one big leaf
    data_bytes = ring_bytes(6, world, 1, cfg) + ring_bytes(407, world, 1, cfg)
    assert HEADER_LEN < stats.bytes_sent - data_bytes < HEADER_LEN + 4096  # plus one META frame


def test_stochastic_rounding_matches_fake() -> None:
    cfg = RingConfig(mode="int8", stochastic_rounding=True, seed=7, piece_numel=256)
    xs = _inputs(3, 3000)
    nodes = _nodes(3)
    try:
        outs, errs = _run(_ring(nodes, cfg, epoch=5), xs)
    finally:
        for node in nodes:
            node.close()
    assert errs == [None] * 3
    fake = LocalGroup(3, cfg, epoch=5).all_reduce_mean_all(xs)
    assert all(_same_bits(o, fake[0]) for o in outs)


def test_a_member_address_that_is_no_address_is_a_config_mismatch() -> None:
    """The member list comes from the coordinator: a bad address fails this ring (a NetError the
    outer loop retries in a new epoch), not the process."""
    nodes = _nodes(1)
    try:
        for bad in ("h:x", "no-port", "h:70000"):
            with pytest.raises(ConfigMismatch, match="ring of epoch 4: not a host:port address"):
                nodes[0].ring([(nodes[0].name, nodes[0].address), ("r9", bad)], 0, epoch=4)
    finally:
        nodes[0].close()


@pytest.mark.parametrize("exchange", ["ring", "butterfly"])
def test_links_open_when_every_listener_answers_later_than_a_dial_s_slice(
        monkeypatch: pytest.MonkeyPatch, exchange: str) -> None:
    """A ring dials in slices of half a second (to notice an abort); listeners that take longer
    to answer (a loaded machine) still give every rank working links, not connections whose
    dialer gave up on them after they were queued (over the butterfly every rank then failed
    the call with a peer that closed the connection before its header; over the ring no dial
    ever got through, and every rank failed at the deadline)."""
    from intellect_jax.net.listener import Listener
    reserve = Listener._reserve

    def slow(self: Any, conn: Any) -> Any:
        time.sleep(0.7)
        return reserve(self, conn)

    monkeypatch.setattr(Listener, "_reserve", slow)
    world = 3
    xs = _inputs(world, 3000)
    nodes = _nodes(world)
    try:
        comms = _ring(nodes, RingConfig(exchange=exchange, deadline=20))
        outs, errs = _run(comms, xs)
    finally:
        for node in nodes:
            node.close()
    assert errs == [None] * world
    assert all(_same_bits(o, outs[0]) for o in outs)


@pytest.mark.parametrize("exchange", ["ring", "butterfly"])
def test_an_abort_ends_a_dial_that_waits_for_its_peer_s_answer(monkeypatch: pytest.MonkeyPatch,
                                                                exchange: str) -> None:
    """Every listener takes 6 s to answer a dial (a peer that stops right after the TLS
    handshake); a dial waits for that answer past its own timeout, but an abort (the epoch
    broke) still ends every rank's call at once, not when the answers come."""
    from intellect_jax.net.listener import Listener
    reserve = Listener._reserve

    def stuck(self: Any, conn: Any) -> Any:
        time.sleep(6.0)
        return reserve(self, conn)

    monkeypatch.setattr(Listener, "_reserve", stuck)
    nodes = _nodes(3)
    try:
        comms = _ring(nodes, RingConfig(exchange=exchange, deadline=20))
        threading.Timer(0.5, lambda: [c.abort() for c in comms]).start()
        t0 = time.monotonic()
        _, errs = _run(comms, _inputs(3, 3000))
        took = time.monotonic() - t0
    finally:
        for node in nodes:
            node.close()
    assert all(isinstance(e, NetError) for e in errs) and took < 3.0, (took, errs)


def test_config_mismatch_fails_every_rank_fast() -> None:
    nodes = _nodes(3)
    peers = _members(nodes)
    comms = [n.ring(peers, r, config=RingConfig(block_size=32 if r == 1 else 64, deadline=10))
             for r, n in enumerate(nodes)]
    t0 = time.monotonic()
    try:
        _, errs = _run(comms, _inputs(3, 1000))
    finally:
        for node in nodes:
            node.close()
    assert time.monotonic() - t0 < 8
    assert all(isinstance(e, NetError) for e in errs)
    assert any(isinstance(e, ConfigMismatch) and "block_size" in str(e) for e in errs)
    with pytest.raises(RingClosed):
        comms[0].all_reduce_mean(np.zeros(3, np.float32))


def test_a_rank_of_another_authority_is_rejected_before_any_data(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any) -> None:
    from intellect_jax.net import listener as listener_mod, transport
    from intellect_jax.net.frames import MsgType

    frames: list[tuple[str, MsgType]] = []  # ring frames (META/DATA) sent or received, by anyone
    handed: list[tuple[int, str]] = []  # (listener port, channel) handed over by accept()
    orig_send, orig_hdr, orig_accept = (transport.Connection.send, transport.Connection.recv_header,
                                        listener_mod.Listener.accept)

    def send(self, mtype, *a, **kw):  # noqa: ANN001, ANN202
        if mtype in (MsgType.META, MsgType.DATA):
            frames.append(("sent", mtype))
        return orig_send(self, mtype, *a, **kw)

    def recv_header(self, expect, **kw):  # noqa: ANN001, ANN202
        hdr = orig_hdr(self, expect, **kw)
        if hdr.mtype in (MsgType.META, MsgType.DATA):
            frames.append(("received", hdr.mtype))
        return hdr

    def accept(self, channel, **kw):  # noqa: ANN001, ANN202
        conn = orig_accept(self, channel, **kw)
        handed.append((self.address[1], channel))
        return conn

    monkeypatch.setattr(transport.Connection, "send", send)
    monkeypatch.setattr(transport.Connection, "recv_header", recv_header)
    monkeypatch.setattr(listener_mod.Listener, "accept", accept)
    good = _nodes(2)
    Authority.init(tmp_path, "elsewhere").issue("r2")  # the same name, from another authority
    bad = [NetNode(TransportConfig("ring-test", Credentials.load(tmp_path, "r2"), io_timeout=5.0))]
    nodes = [good[0], good[1], bad[0]]
    peers = _members(nodes)
    comms = [n.ring(peers, r, config=RingConfig(deadline=3)) for r, n in enumerate(nodes)]
    try:
        _, errs = _run(comms, _inputs(3, 1000))
    finally:
        for node in nodes:
            node.close()
    assert isinstance(errs[2], AuthError)  # the intruder cannot authenticate to rank 0 ...
    assert isinstance(errs[1], AuthError)  # ... nor pose as rank 2 to rank 1
    assert isinstance(errs[0], PeerTimeout) and "rejected" in str(errs[0])
    assert all(c.last_stats.bytes_sent == 0 for c in comms)  # no call completed
    assert frames == [], frames  # no META/DATA frame moved on any connection
    # rank 0's listener never handed over a connection from the intruder (rank 2)
    assert not [ch for port, ch in handed if port == good[0].address[1] and ch.startswith("ring/0/2>")], handed


def test_new_epoch_on_same_nodes_after_close() -> None:
    nodes = _nodes(2)
    try:
        xs = _inputs(2, 500)
        first = _ring(nodes, RingConfig(mode="fp32"))
        a, errs = _run(first, xs)
        assert errs == [None, None]
        for c in first:
            c.close()
        b, errs = _run(_ring(nodes, RingConfig(mode="fp32"), epoch=1), xs)
        assert errs == [None, None] and _same_bits(a[0], b[1])
    finally:
        for node in nodes:
            node.close()


def test_rejects_non_float32() -> None:
    with pytest.raises(TypeError, match="float32"):
        LocalGroup(2).all_reduce_mean_all([np.zeros(3), np.zeros(3)])


@pytest.mark.parametrize(("mode", "streams", "bucket", "at", "piece", "call"), [
    ("int8", 1, 1 << 26, 300, 1, 0),  # one bucket: rank 0's own segment is the first third
    ("fp32", 2, 1000, 1100, 0, 1)])  # three leaves in buckets of 1,000: the second one's first third
def test_a_bad_own_piece_is_kept_with_its_sender_s_signature(mode: str, streams: int, bucket: int, at: int,
                                                             piece: int, call: int) -> None:
    """Rank 0's own contribution holds a NaN: its successor keeps that piece, signed by rank 0,
    with rank 0's certificate, as evidence; the coordinator's check accepts it under the run's
    authority, and refuses it altered, held against another node, told by another accuser,
    under another certificate, or for another round."""
    nodes = _nodes(3, first=20)
    try:
        cfg = RingConfig(mode=mode, piece_numel=256, streams=streams, bucket_numel=bucket, deadline=30)
        comms = [n.ring(_members(nodes), r, epoch=7, step=4, config=cfg) for r, n in enumerate(nodes)]
        xs = _inputs(3, 3000)
        xs[0][at] = np.nan
        if bucket < 3000:  # a pytree of three leaves, one bucket each
            xs = [[x[:1000], x[1000:2000], x[2000:]] for x in xs]
        for c in comms:
            c.inspect = lambda theirs: verdict(theirs, None)
        _, errs = _run(comms, xs)
        assert errs == [None] * 3
        assert comms[0].suspect is None and comms[2].suspect is None
        prev, why, ev = comms[1].suspect
        assert (prev, why) == (0, "non-finite values")
        e = Evidence.model_validate(ev)
        assert (e.step, e.epoch, e.mode, e.piece, e.call) == (4, 7, mode, piece, call) and e.signature
        assert e.cert == credentials("r20").cert_der.hex()
        kw: dict[str, Any] = dict(run_id="ring-test", step=4, epoch_id=7, recorded=None, ca=credentials("r20").ca_der)
        assert weigh(e, accuser="r21", accused="r20", **kw) == ("non-finite values", "")
        raw = bytearray(base64.b64decode(e.payload))
        raw[-1] ^= 1
        altered = e.model_copy(update={"payload": base64.b64encode(bytes(raw)).decode()})
        other_cert = e.model_copy(update={"cert": credentials("r22").cert_der.hex()})
        for bad, accuser, accused in ((altered, "r21", "r20"), (e, "r21", "r22"), (e, "r22", "r20"),
                                      (other_cert, "r21", "r20"), (other_cert, "r21", "r22")):
            guilty, flaw = weigh(bad, accuser=accuser, accused=accused, **kw)
            assert guilty is None and "signature" in flaw, flaw
        assert weigh(e, accuser="r21", accused="r20", **{**kw, "step": 5})[0] is None  # another round
    finally:
        for n in nodes:
            n.close()
