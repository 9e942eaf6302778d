"""Low-bit codecs (int4, int2, int1, top-k, top-1) and the all-gather exchange with error feedback."""

from __future__ import annotations

import base64
import threading
from typing import Any

import numpy as np
import pytest

from intellect_jax.coordinator.holdings import weigh_holdings
from intellect_jax.coordinator.policing import REVOKED, Police, weigh
from intellect_jax.coordinator.protocol import CoordinatorConfig
from intellect_jax.coordinator.roster import Arrival, Node, Role
from intellect_jax.coordinator.schema import Evidence, Holding, Report, Vouch
from intellect_jax.net import NetNode, RingConfig, codecs, gather, quant
from intellect_jax.net.comm import bucket_call
from intellect_jax.net.evidence import SAT_OUT, digest, verdict
from intellect_jax.net.frames import HEADER_LEN, MsgType
from intellect_jax.testing.identities import credentials, transport_config
from intellect_jax.testing.local_ring import LocalGroup, ring_bytes

CODECS = [("int4", 64), ("int2", 64), ("int1", 64), ("int1", 1024), ("topk64", 4096), ("topk5", 37), ("top1of4", 4096), ("top1of8", 64),
          ("top1of2", 4096), ("top1of256", 512)]


def _x(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if n:
        x[rng.integers(0, n, max(1, n // 500))] *= 25
    return x


@pytest.mark.parametrize("mode,block", CODECS)
@pytest.mark.parametrize("n", [0, 1, 36, 37, 64, 4095, 4097, 20000])
def test_roundtrip_sizes_and_decode_add(mode: str, block: int, n: int) -> None:
    x = _x(n)
    wire = quant.encode(x, mode, block)
    assert wire.dtype == np.uint8 and wire.nbytes == quant.encoded_nbytes(n, mode, block)
    y = quant.decode(wire, n, mode, block)
    assert np.isfinite(y).all()
    acc = np.full(n, 0.5, np.float32)
    codecs.decode_add(wire, n, mode, block, acc, np.empty(n, np.float32))
    assert np.array_equal(acc, np.float32(0.5) + y)
    if n >= 4096:  # error within the codec's budget; larger magnitudes are kept first
        err = np.linalg.norm(x - y) / np.linalg.norm(x)
        assert err < {"int4": 0.25, "int2": 0.7, "int1": 0.85, "top1of4": 0.8}.get(mode, 0.99), err
    with pytest.raises(ValueError, match="bytes"):
        quant.decode(np.zeros(wire.nbytes + 1, np.uint8), n, mode, block)


def test_bits_per_value() -> None:
    n = 1 << 20
    bits = {m: 8 * quant.encoded_nbytes(n, m, b) / n for m, b in [("int8", 64), *CODECS[:2], CODECS[3], *CODECS[4:7]]}
    assert bits["int8"] == 8.5 and bits["int4"] == 4.5 and bits["int2"] == 2.5
    assert bits["int1"] == 1 + 32 / 1024  # a sign bit a value, a float32 scale a block
    assert abs(bits["topk64"] - (64 * (12 + 2) + 64) / 4096) < 1e-9  # 12-bit index + 2-bit code, 2 fp32 levels
    assert abs(bits["top1of4"] - (1024 * (2 + 2) + 64) / 4096) < 1e-9  # 2-bit position + 2-bit code


def test_random_payloads_decode_or_raise_value_error_only() -> None:
    """Whatever a peer sends, of the right length: values, or one ValueError."""
    rng = np.random.default_rng(1)
    for mode, block in CODECS:
        for n in (1, 5, 257, 4097):
            for _ in range(20):
                raw = rng.integers(0, 256, quant.encoded_nbytes(n, mode, block), dtype=np.uint8)
                try:
                    y = quant.decode(raw, n, mode, block)
                    acc = np.zeros(n, np.float32)
                    codecs.decode_add(raw, n, mode, block, acc, np.empty(n, np.float32))
                except ValueError:
                    continue
                assert y.shape == (n,) and y.dtype == np.float32


def test_huge_finite_values_stay_finite() -> None:
    x = np.full(4096, 1e36, np.float32)
    for mode, block in CODECS:
        if block >= 64:
            assert np.isfinite(quant.decode(quant.encode(x, mode, block), 4096, mode, block)).all(), mode


def test_subnormal_blocks_stay_finite_and_close() -> None:
    """A block whose largest value is subnormal (1 / amax overflows float32) still encodes to
    finite values near it: an honest contribution never decodes to NaN or inf."""
    blocks = [np.r_[np.zeros(63), 1e-39], np.full(64, 2e-39), np.r_[np.full(63, 1e-41), 3e-39]]
    x = np.concatenate(blocks + [np.linspace(-1, 1, 64)]).astype(np.float32)
    for mode, block in CODECS:
        y = quant.decode(quant.encode(x, mode, block), x.shape[0], mode, block)
        assert np.isfinite(y).all(), mode
        if mode in ("int4", "int2", "int1") and block == 64:  # (blockwise: the subnormal blocks have scales of their own)
            assert np.abs(y[:192]).max() <= 2 * np.abs(x[:192]).max(), mode


def test_int1_sends_each_sign_against_its_block_mean_magnitude() -> None:
    """int1: every value decodes to +-(its block's mean magnitude), the sign its own (a zero's
    +): the level that makes a block's squared error least for a sign code."""
    x = _x(3000, 4)
    x[5], x[7] = 0.0, -0.0
    y = quant.decode(quant.encode(x, "int1", 256), 3000, "int1", 256)
    for a in range(0, 3000, 256):
        xb, yb = x[a:a + 256].astype(np.float64), y[a:a + 256]
        level = np.abs(xb).mean()
        assert np.allclose(np.abs(yb), level, rtol=1e-6)
        assert np.array_equal(yb > 0, xb >= 0)
        err = lambda s: ((xb - s * np.where(xb >= 0, 1, -1)) ** 2).sum()  # noqa: E731
        assert err(level) <= min(err(0.9 * level), err(1.1 * level))
    assert y[5] > 0 and y[7] > 0


def test_topk_keeps_largest_and_signs() -> None:
    x = np.zeros(4096, np.float32)
    x[[3, 700, 4000]] = [5.0, -4.0, 4.5]
    x[100] = 0.01
    y = quant.decode(quant.encode(x, "topk4", 4096), 4096, "topk4", 4096)
    assert set(np.flatnonzero(y)) == {3, 100, 700, 4000}
    assert y[3] > 0 and y[700] < 0 and y[4000] > 0 and y[100] > 0
    assert np.allclose(np.abs(y[[3, 700, 4000]]), 4.5)  # one level for the three large ones


def test_top1_keeps_the_largest_of_each_group_and_checks_the_last() -> None:
    x = _x(4097)
    y = quant.decode(quant.encode(x, "top1of4", 4096), 4097, "top1of4", 4096)
    xg, yg = np.zeros(4100, np.float32), np.zeros(4100, np.float32)
    xg[:4097], yg[:4097] = x, y
    xg, yg = xg.reshape(-1, 4), yg.reshape(-1, 4)
    assert ((yg != 0).sum(axis=1) == 1).all()  # exactly one value per group (none is exactly 0 here)
    assert np.array_equal(np.argmax(np.abs(xg), axis=1), np.argmax(np.abs(yg), axis=1))
    assert np.array_equal(np.sign(yg.sum(axis=1)), np.sign(xg[np.arange(1025), np.argmax(np.abs(xg), axis=1)]))
    bad = quant.encode(x, "top1of4", 4096)
    bad[16 + 256] |= 0x03  # the last group (1 value) points at its 4th
    with pytest.raises(ValueError, match="beyond the last group"):
        quant.decode(bad, 4097, "top1of4", 4096)
    with pytest.raises(ValueError, match="whole groups"):
        quant.check_mode("top1of8", 100)


def test_poison_stays_visible() -> None:
    for mode, block in CODECS:
        x = _x(5000)
        x[4321] = np.nan
        y = quant.decode(quant.encode(x, mode, block), 5000, mode, block)
        assert not np.isfinite(y).all(), mode


def test_topk_rejects_bad_indices() -> None:
    x = _x(8192)
    wire = quant.encode(x, "topk4", 4096)
    bad = wire.copy()
    bad[16:19] = [0xFF, 0xFF, 0xFF]  # first index pair of chunk 0 -> 4095, 4095: not increasing
    with pytest.raises(ValueError, match="not strictly increasing"):
        quant.decode(bad, 8192, "topk4", 4096)
    tail = quant.encode(_x(4100), "topk4", 4096)  # last chunk of 4 values: an index 4 is out
    bad = tail.copy()
    off = 16 + 6  # two chunks of levels, then chunk 0's 4 indices (6 bytes)
    bad[off:off + 3] = [0x04, 0x50, 0x00]  # indices 4, 5
    with pytest.raises(ValueError, match="beyond its chunk"):
        quant.decode(bad, 4100, "topk4", 4096)
    with pytest.raises(ValueError, match="K <= chunk"):
        quant.check_mode("topk64", 32)
    with pytest.raises(ValueError, match="unknown wire mode"):
        quant.check_mode("topk0", 4096)


def test_gather_mean_is_rank_ordered_and_feedback_exact() -> None:
    xs = [_x(10000, s) for s in range(3)]
    ds = [np.empty(10000, np.float32) for _ in xs]
    mean = gather.simulate(xs, "topk8", 512, 2048, ds)
    p = gather.gather_plan(10000, 512, 2048)
    dec = [np.concatenate([quant.decode(w, w_n, "topk8", 512) for w, w_n in
                           zip(gather.encode_own(x, p, "topk8", 512), [b - a for a, b in
                                                                       (p.piece(0, j) for j in range(p.pieces))])])
           for x in xs]
    want = ((np.float32(0) + dec[0]) + dec[1]) + dec[2]
    assert np.array_equal(mean, want / np.float32(3))
    for x, d, y in zip(xs, ds, dec):
        assert np.array_equal(d, x - y)  # what error feedback carries: exactly what was lost


def _nodes(n: int) -> list[NetNode]:
    return [NetNode(transport_config(f"g{i}", "gather-test", io_timeout=5.0)) for i in range(n)]


def _run(comms: list[Any], inputs: list[Any], drops: list[Any]) -> tuple[list[Any], list[Any]]:
    outs: list[Any] = [None] * len(comms)
    errs: list[Any] = [None] * len(comms)

    def go(r: int) -> None:
        try:
            outs[r] = comms[r].all_reduce_mean(inputs[r], dropped=drops[r])
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=go, args=(r,)) for r in range(len(comms))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return outs, errs


@pytest.mark.parametrize("mode,block,streams", [("topk16", 1024, 1), ("int2", 64, 2), ("top1of4", 512, 1),
                                                     ("int1", 1024, 1)])
def test_socket_gather_matches_local_fake(mode: str, block: int, streams: int) -> None:
    world = 3
    cfg = RingConfig(mode=mode, block_size=block, streams=streams, piece_numel=3000, bucket_numel=9000, deadline=30)
    trees = [{"a": _x(7000, s), "b": _x(5, s + 9).reshape(5, 1), "c": _x(4000, s + 20)} for s in range(world)]
    like = lambda t: {k: np.empty_like(v) for k, v in t.items()}  # noqa: E731
    nodes = _nodes(world)
    try:
        comms = [n.ring([(m.name, m.address) for m in nodes], r, config=cfg) for r, n in enumerate(nodes)]
        drops = [like(t) for t in trees]
        outs, errs = _run(comms, trees, drops)
        assert errs == [None] * world
        fake_drops = [like(t) for t in trees]
        fake = LocalGroup(world, cfg).all_reduce_mean_all(trees, fake_drops)
        for r in range(world):
            for k in trees[0]:
                assert np.array_equal(outs[r][k], fake[0][k]), (r, k)
                assert np.array_equal(drops[r][k], fake_drops[r][k]), (r, k)
            st = comms[r].last_stats
            data = ring_bytes(7000, world, r, cfg) + ring_bytes(4005, world, r, cfg)  # buckets a | b, c
            assert HEADER_LEN < st.bytes_sent - data < HEADER_LEN + 4096  # plus one META frame
        assert outs[0]["a"].shape == (7000,) and np.isfinite(outs[0]["a"]).all()
    finally:
        for n in nodes:
            n.close()


def test_socket_gather_inspects_the_whole_contribution_and_blames_its_sender() -> None:
    """A NaN far from the first piece is found by the successor, with signed evidence that the
    coordinator's own check upholds."""
    world = 3
    cfg = RingConfig(mode="topk16", block_size=1024, piece_numel=2048, deadline=30)
    xs = [_x(20000, s) for s in range(world)]
    xs[1][19000] = np.nan  # the last piece of rank 1's contribution
    nodes = _nodes(world)
    try:
        comms = [n.ring([(m.name, m.address) for m in nodes], r, config=cfg) for r, n in enumerate(nodes)]
        for c in comms:
            c.inspect = lambda theirs: verdict(theirs, None)
        outs, errs = _run(comms, xs, [None] * world)
        assert errs == [None] * world
        assert not np.isfinite(outs[0]).all()
        assert comms[2].suspect is not None and comms[0].suspect is None and comms[1].suspect is None
        prv, why, ev = comms[2].suspect
        assert prv == 1 and why == "non-finite values" and ev["mode"] == "topk16"
        raw = base64.b64decode(ev["payload"])
        assert len(raw) == quant.encoded_nbytes(ev["numel"], "topk16", 1024)
        found, note = weigh(Evidence.model_validate(ev), accused="g1", accuser="g2", step=0, epoch_id=0,
                            run_id="gather-test", ca=credentials("g1").ca_der, recorded=None)
        assert found == "non-finite values", note
        # signed with a certificate the authority has since revoked (a stolen key): shows nothing
        found, note = weigh(Evidence.model_validate(ev), accused="g1", accuser="g2", step=0, epoch_id=0,
                            run_id="gather-test", ca=credentials("g1").ca_der, recorded=None, revoked=lambda s: True)
        assert found is None and note == REVOKED + "g1", note
        # ... nor against its accuser: the key may have been revoked after it signed
        said: list[str] = []
        police = Police(CoordinatorConfig(), said.append, ca=credentials("g1").ca_der)
        police.revoked = lambda serial: True
        police.formed(0, 0, ("g0", "g1", "g2"))
        members = [Node(i, f"127.0.0.1:{k + 1}", 1, "s", Role.MEMBER, (k, 0), 0.0, arrival=Arrival(
            1, 0.0, "h", False, report=Report(accused=["g1", why], evidence=Evidence.model_validate(ev))
            if i == "g2" else None)) for k, i in enumerate(("g0", "g1", "g2"))]
        keep, evict = police.judge(1, members, "gather-test")
        assert evict == [] and [n.false_accusations for n in members] == [0, 0, 0] and [n.strikes for n in members] \
            == [0, 0, 0]
        assert any("signed with a certificate since revoked" in line for line in said), said
    finally:
        for n in nodes:
            n.close()


def test_socket_gather_leaves_a_sitter_out_and_blames_one_that_sends() -> None:
    """A rank sitting the round out adds nothing on any rank, whatever it sends (the loop then
    rescales by N / n, as for the ring); one that sends values anyway is found by its successor,
    with signed evidence the coordinator upholds against a declared sitter."""
    world, n = 4, 9000
    cfg = RingConfig(mode="top1of4", block_size=512, piece_numel=2048, deadline=30)
    xs = [_x(n, s) for s in range(world)]  # rank 1 sits out, yet sends its values
    nodes = _nodes(world)
    try:
        comms = [nd.ring([(m.name, m.address) for m in nodes], r, config=cfg) for r, nd in enumerate(nodes)]
        for c in comms:
            c.inspect = lambda theirs: verdict(theirs, None)
            c.absent = frozenset({1})
        outs, errs = _run(comms, xs, [None] * world)
        assert errs == [None] * world
        want = gather.simulate([x if r != 1 else np.zeros(n, np.float32) for r, x in enumerate(xs)],
                               cfg.mode, cfg.block_size, cfg.piece_numel)
        assert all(np.array_equal(o, want) for o in outs)  # bit-identical, rank 1's values left out
        assert np.array_equal(LocalGroup(world, cfg).all_reduce_mean_all(xs, absent=frozenset({1}))[0], want)
        assert [c.suspect is not None for c in comms] == [False, False, True, False]
        prv, why, ev = comms[2].suspect
        assert prv == 1 and why == SAT_OUT
        found, note = weigh(Evidence.model_validate(ev), accused="g1", accuser="g2", step=0, epoch_id=0,
                            run_id="gather-test", ca=credentials("g1").ca_der, recorded=None, sat_out=True)
        assert found == SAT_OUT, note
    finally:
        for nd in nodes:
            nd.close()


def test_socket_gather_skips_an_undecodable_piece_and_blames_its_sender() -> None:
    """A signed piece its codec rejects adds nothing on any rank (the mean stays bit-identical),
    and its sender's successor holds evidence that the coordinator upholds."""
    world = 3
    cfg = RingConfig(mode="topk4", block_size=4096, piece_numel=4096, deadline=10)
    nodes = _nodes(world)
    real = quant.encode
    try:
        comms = [n.ring([(m.name, m.address) for m in nodes], r, config=cfg) for r, n in enumerate(nodes)]

        def bad_encode(x: np.ndarray, mode: str, block: int, *a: Any, **k: Any) -> np.ndarray:
            w = real(x, mode, block, *a, **k)
            if threading.current_thread().name == "gather-enc" and x[0] == 7.0 and x.size == 4096:
                w[8:11] = [0xFF, 0xFF, 0xFF]  # the first two indices of its second piece: 4095, 4095
            return w

        quant.encode = bad_encode  # type: ignore[assignment]
        xs = [_x(8192, s) for s in range(world)]
        xs[0][4096] = 7.0
        outs, errs = _run(comms, xs, [None] * world)
        assert errs == [None] * world
        assert all(np.array_equal(outs[0], o) for o in outs[1:])
        quant.encode = real  # type: ignore[assignment]
        p = gather.gather_plan(8192, 4096, 4096)
        pays = [gather.encode_own(x, p, "topk4", 4096) for x in xs]
        pays[0][1][8:11] = 0xFF
        skipped: list[tuple[int, int]] = []
        want = gather.combine(pays, p, "topk4", 4096, np.empty(8192, np.float32), skipped)
        assert skipped == [(0, 1)] and np.array_equal(outs[0], want)  # g0's second piece added nothing
        prv, why, ev = comms[1].suspect
        assert prv == 0 and why.startswith("an undecodable payload") and ev["piece"] == 1
        found, note = weigh(Evidence.model_validate(ev), accused="g0", accuser="g1", step=0, epoch_id=0,
                            run_id="gather-test", ca=credentials("g0").ca_der, recorded=None)
        assert found and found.startswith("an undecodable payload"), note
        assert weigh(Evidence.model_validate(ev), accused="g2", accuser="g1", step=0, epoch_id=0,
                     run_id="gather-test", ca=credentials("g0").ca_der, recorded=None)[0] is None
    finally:
        quant.encode = real  # type: ignore[assignment]
        for n in nodes:
            n.close()


@pytest.mark.parametrize("trick", ["piece", "certificate", "equivocation"])
def test_socket_gather_a_forwarder_cannot_change_what_it_passes_on(monkeypatch: Any, trick: str) -> None:
    """Every forwarded piece carries its origin's signature, checked by every rank: rank 1,
    altering one code of rank 0's piece it forwards (with a fresh frame tag) or forwarding its
    own certificate as rank 0's, is named by rank 2, and no two ranks that complete the call
    hold different results (unchecked, ranks 2 and 3 would have summed the altered piece). Nor
    when rank 0 signs a second version of that piece for rank 2 to pass on instead: rank 3 then
    holds other bytes than ranks 0-2, and the signed digests each rank sends round before it
    sums fail the call (the next test: the origin is then named)."""
    world, n = 4, 6000
    cfg = RingConfig(mode="top1of4", block_size=512, piece_numel=2048, deadline=10)
    xs = [_x(n, s) for s in range(world)]
    real_put = gather._GatherRun.put

    def put(self: Any, m: int, *item: Any) -> None:
        if trick == "equivocation" and self.rank == 2 and m == 2 * self.plan.pieces:  # rank 0's first piece, to 3
            wire, _, _, cert = item
            wire = wire.copy()
            wire[-1] ^= 0x03
            a, b = self.plan.piece(0, 0)
            item = (wire, None, comms[0]._origin_seal(bucket_call(0, 0)).sign(0, b - a, digest(wire)), cert)
        elif trick != "equivocation" and self.rank == 1 and m >= self.plan.pieces and m % self.plan.pieces == 0:
            wire, _, sig, cert = item  # rank 0's first piece, forwarded by rank 1
            if trick == "piece":
                wire = wire.copy()
                wire[-1] ^= 0x03  # one value's 2-bit code: still decodes, to another value
            else:
                cert = credentials("g1").cert_der
            item = (wire, None, sig, cert)
        real_put(self, m, *item)

    monkeypatch.setattr(gather._GatherRun, "put", put)
    nodes = _nodes(world)
    try:
        comms = [nd.ring([(m.name, m.address) for m in nodes], r, config=cfg) for r, nd in enumerate(nodes)]
        outs, errs = _run(comms, xs, [None] * world)
        if trick == "equivocation":
            assert all("hold other contributions than we do of rank(s) [0]" in str(e) for e in errs), errs
        else:
            assert errs[2] is not None and str(errs[2]).startswith("rank 1 (g1 "), errs
            assert ("does not carry rank 0's signature" if trick == "piece" else "forwarded a certificate") in \
                str(errs[2])
        done = [o for o in outs if o is not None]
        want = gather.simulate(xs, cfg.mode, cfg.block_size, cfg.piece_numel)
        assert all(np.array_equal(o, want) for o in done)
    finally:
        for nd in nodes:
            nd.close()


def _judged(comms: list, revoked: bool = False, alter: Any = None, shows: Any = None,
            gone: tuple[str, ...] = (), vouches: dict[str, list] | None = None) -> tuple[list, dict[str, str], list[str]]:
    """What the coordinator makes of every rank's holdings and vouches after a failed all-gather
    of epoch 0: (evicted (node, why), banned, its log); ``alter(holding)`` changes each holding
    first, ``shows(node, holdings)`` what each node shows of its own, ``vouches`` further lists
    a node shows; the ``gone`` are not at the barrier."""
    said: list[str] = []
    ids = tuple(c.ids[c.rank] for c in comms)
    police = Police(CoordinatorConfig(), said.append, ca=credentials("g0").ca_der)
    police.revoked = lambda serial: revoked
    police.formed(0, 0, ids)
    held = {i: (shows or (lambda _, hs: hs))(i, [(alter or (lambda h: h))(Holding.model_validate(h)) for h in c.held])
            for i, c in zip(ids, comms)}
    members = [Node(i, f"127.0.0.1:{k + 1}", 1, "s", Role.MEMBER, (k, 0), 0.0, arrival=Arrival(
        1, 0.0, "h", False, report=Report(holdings=held[i] or None,
                                          vouches=[Vouch.model_validate(v) for v in c.vouched]
                                          + (vouches or {}).get(i, []) or None)
        if held[i] or c.vouched else None))
        for k, (i, c) in enumerate(zip(ids, comms)) if i not in gone]
    _, evict = police.judge(1, members, "gather-test")
    return [(n.node_id, why) for n, why in evict], police.frauds, said


@pytest.mark.parametrize("masked,silenced", [(False, False), (True, False), (False, True)])
def test_socket_gather_an_origin_that_signs_two_versions_is_banned_on_the_holdings(monkeypatch: Any, masked: bool,
                                                                                     silenced: bool) -> None:
    """An origin signs a second version of its first piece and an accomplice passes that one on
    to a single rank: the call fails, and every rank reports its holding of the origin (each
    piece's digest under the origin's signature) with its retry. Two holdings that differ in a
    piece, both signed, convict the origin at the coordinator, whoever passed what on, so the
    colluders cannot hide it (a holding sent round the ring could be altered by them, who stand
    between the two sides). ``masked``: the origin also lies about an honest rank's
    contribution in its signed digests, so that ranks dispute that one too: its holdings all
    agree, and only the origin is banned. ``silenced``: the accomplice also passes none of the
    signed digests on to the victim, which so never learns that its own are disputed; it still
    shows its holding of every origin, so it bears out its own signed digests and is not banned
    with the origin. A holding altered, or signed with a revoked certificate, shows nothing."""
    world, n = 4, 6000
    origin, accomplice, victim = (1, 3, 0) if masked else (0, 2, 3)
    cfg = RingConfig(mode="top1of4", block_size=512, piece_numel=2048, deadline=3 if silenced else 10)
    xs = [_x(n, s) for s in range(world)]
    real_put, real_held, real_pass = gather._GatherRun.put, gather._GatherRun._held, gather._GatherRun._pass

    def _pass(self: Any, out: Any, inn: Any, item: bytes, n: int) -> bytearray:
        if self.rank != accomplice:
            return real_pass(self, out, inn, item, n)
        hdr = inn.recv_header(MsgType.DATA, deadline=self.deadline, length=n)  # (it sends nothing on)
        buf = bytearray(hdr.length)
        inn.recv_payload_into(hdr, buf, deadline=self.deadline)
        return buf

    def put(self: Any, m: int, *item: Any) -> None:
        s, j = divmod(m, self.plan.pieces)
        if self.rank == accomplice and j == 0 and (self.rank - s) % world == origin and \
                (self.rank + 1) % world == victim:  # the origin's first piece, to the victim
            wire, _, _, cert = item
            wire = wire.copy()
            wire[-1] ^= 0x03
            a, b = self.plan.piece(0, 0)
            item = (wire, None, comms[origin]._origin_seal(bucket_call(0, 0)).sign(0, b - a, digest(wire)), cert)
        real_put(self, m, *item)

    def _held(self: Any, o: int) -> bytes:
        return b"\xff" * 32 if masked and (self.rank, o) == (origin, 0) else real_held(self, o)

    monkeypatch.setattr(gather._GatherRun, "put", put)
    monkeypatch.setattr(gather._GatherRun, "_held", _held)
    if silenced:
        monkeypatch.setattr(gather._GatherRun, "_pass", _pass)
    nodes = _nodes(world)
    try:
        comms = [nd.ring([(m.name, m.address) for m in nodes], r, config=cfg) for r, nd in enumerate(nodes)]
        outs, errs = _run(comms, xs, [None] * world)
        assert all(o is None for o in outs) and all(silenced or "hold other contributions than we do" in str(e)
                                                    for e in errs), errs
        g = f"g{origin}"
        assert not silenced or [v["holder"] for v in comms[victim].vouched] == ["g3"] and comms[victim].held
        for c in comms:  # every other origin's, those disputed first
            first = set() if silenced else ({"g0", g} if masked else {g}) - {c.ids[c.rank]}
            held = [h["origin"] for h in c.held]
            assert set(held[:len(first)]) == first and sorted(held) == sorted(set(c.ids) - {c.ids[c.rank]}), held
        why = "signed two versions of its piece 0 (call 0) in an all-gather"
        evicted, banned, said = _judged(comms)
        assert evicted == [(g, why)] and banned == {g: why}, said
        assert any(f"hold {g}'s signatures on two versions of its piece" in line for line in said), said
        if silenced:  # (had it shown only the holdings it knew disputed, none, its digest list would convict it)
            assert "g3" in _judged(comms, shows=lambda i, hs: [] if i == "g3" else hs)[1]
            assert _judged(comms, gone=("g3",))[1] == {}  # (gone: not judged, and nobody shows the second version)
        assert _judged(comms, revoked=True)[:2] == ([], {})
        flip = lambda h: h.model_copy(update={"digests": [("0" if d[0] != "0" else "1") + d[1:]  # noqa: E731
                                                          for d in h.digests]})
        # altered holdings show nothing: no origin's two versions, nor the majority's holding that
        # a list against it would be weighed by
        assert _judged(comms, alter=flip)[:2] == ([], {})
        for c in comms:  # a coordinator that signs nothing (in process) convicts nobody
            assert weigh_holdings([(c.ids[c.rank], Holding.model_validate(h)) for h in c.held], run_id="gather-test",
                                  epoch_id=0, ring=tuple(x.ids[x.rank] for x in comms), ca=None) == {}
    finally:
        for nd in nodes:
            nd.close()


@pytest.mark.parametrize("about", ["another", "itself"])
def test_socket_gather_a_rank_that_signs_a_false_digest_is_banned_on_its_own_signature(monkeypatch: Any,
                                                                                        about: str) -> None:
    """A rank signs a false digest of one contribution (``about`` another rank's or its own) in
    the digest lists that go round before the sum: every other rank holds other digests than it
    signed, so the call fails. Each shows the coordinator its holdings and every list it has; the
    three honest lists agree, and the liar's entry against them is borne out by no holding signed
    by the origin: the liar alone is banned, whatever it shows (its true holdings, none, or the
    false one without the origin's signatures), and so is a rank that signed two lists for one
    call. A reporter that shows an honest rank's holding cut down to one piece convicts nobody;
    one that is gone from the barrier, or whose certificate is revoked, is not judged."""
    world, n, liar = 4, 6000, 2
    target = 0 if about == "another" else liar
    cfg = RingConfig(mode="top1of4", block_size=512, piece_numel=2048, deadline=10)
    real_held, fake = gather._GatherRun._held, "ee" * 32  # (the liar's digest of the target's first piece)

    def _held(self: Any, o: int) -> bytes:
        if (self.rank, o) != (liar, target):
            return real_held(self, o)
        return digest(bytes.fromhex(fake) + b"".join(self.digests[o][1:]))

    monkeypatch.setattr(gather._GatherRun, "_held", _held)
    nodes = _nodes(world)
    try:
        comms = [nd.ring([(m.name, m.address) for m in nodes], r, config=cfg) for r, nd in enumerate(nodes)]
        outs, errs = _run(comms, [_x(n, s) for s in range(world)], [None] * world)
        assert all(o is None for o in outs) and all("hold other contributions than we do" in str(e) for e in errs)
        assert all(sorted(v["holder"] for v in c.vouched) == ["g0", "g1", "g2", "g3"] for c in comms)
        why = ("signed a digest of g0's contribution (call 0) in an all-gather that more than half of the ring "
               "contradict under their signatures, and no holding of it signed by g0 bears it out") \
            if about == "another" else "signed a digest of its own contribution (call 0) in an all-gather other " \
                                       "than the one it sent"
        evicted, banned, said = _judged(comms)
        assert evicted == [("g2", why)] and banned == {"g2": why}, said
        assert any("shows g2's signed digest list, which gives it away" in line for line in said), said
        if about == "another":
            assert _judged(comms, shows=lambda i, hs: [] if i == "g2" else hs)[1] == {"g2": why}
            assert _judged(comms, shows=lambda i, hs: [h.model_copy(update={"digests": [fake, *h.digests[1:]]})
                                                       if (i, h.origin) == ("g2", "g0") else h for h in hs]
                           )[1] == {"g2": why}
            assert _judged(comms, shows=lambda i, hs: [] if i == "g2" else hs, gone=("g2",))[1] == {}
            pad = lambda h: h.model_copy(update={k: getattr(h, k) * 8000 for k in ("numels", "digests",  # noqa: E731
                                                                                  "signatures")})
            assert _judged(comms, shows=lambda i, hs: [pad(h) for h in hs if h.origin != "g0"] if i == "g2" else hs
                           )[1] == {"g2": why}  # (a padded report claims no room: only holdings that verify count)
        cut = lambda h: h.model_copy(update={k: getattr(h, k)[:1] for k in ("numels", "digests", "signatures")})  # noqa: E731
        assert _judged(comms, shows=lambda i, hs: [cut(h) for h in hs] if i == "g1" else hs)[1] == {"g2": why}
        assert _judged(comms, revoked=True)[:2] == ([], {})
        v = Vouch.model_validate(comms[0].vouched[0])  # g0's own list, and a second one signed by g0 (a trick)
        entries = ["11" * 32, *v.entries[1:]]
        second = v.model_copy(update={"entries": entries, "signature": comms[0]._origin_seal(0).vouch(
            digest(b"".join(bytes.fromhex(e) for e in entries))).hex()})
        two = _judged(comms, vouches={"g1": [second]})[1]
        # (a rank with two lists counts for no majority: two honest lists of four make none against g2)
        assert two == {"g0": "signed two digest lists for one call (call 0) in an all-gather"}, two
        seven = [v.model_copy(update={"call": 7, "holder": "g2", "cert": Vouch.model_validate(
            comms[2].vouched[0]).cert, "entries": es, "signature": comms[2]._origin_seal(7).vouch(
            digest(b"".join(bytes.fromhex(e) for e in es))).hex()}) for es in (entries, v.entries)]
        _, banned, said = _judged(comms, vouches={"g2": seven})  # (a call in which every list is doubled)
        assert set(banned) == {"g2"} and not any("could not be checked" in line for line in said), said
    finally:
        for nd in nodes:
            nd.close()


def test_socket_gather_names_the_origin_of_a_revoked_certificate(monkeypatch: Any) -> None:
    """A rank whose certificate another rank holds revoked fails that rank's call naming it, not
    the honest rank that forwarded it."""
    from cryptography import x509

    world, n = 4, 3000  # (rank 2 has no link of its own with rank 0)
    cfg = RingConfig(mode="top1of4", block_size=512, piece_numel=2048, deadline=10)
    g0 = x509.load_der_x509_certificate(credentials("g0").cert_der).serial_number
    monkeypatch.setattr(credentials("g2").revocations, "revoked", lambda serial: serial == g0)
    nodes = _nodes(world)
    try:
        comms = [nd.ring([(m.name, m.address) for m in nodes], r, config=cfg) for r, nd in enumerate(nodes)]
        outs, errs = _run(comms, [_x(n, s) for s in range(world)], [None] * world)
        assert str(errs[2]).startswith("rank 0's certificate is revoked (forwarded by rank 1 (g1 "), errs
    finally:
        for nd in nodes:
            nd.close()


def test_dropped_needs_a_gathered_codec() -> None:
    group = LocalGroup(2, RingConfig(mode="int8"))
    with pytest.raises(ValueError, match="gathered codec"):
        group.communicator(0).all_reduce_mean(np.ones(4, np.float32), dropped=np.ones(4, np.float32))


def test_int4_through_the_ring_is_close_to_the_mean() -> None:
    rng = np.random.default_rng(0)
    common = rng.standard_normal(50000).astype(np.float32)  # nodes' pseudo-gradients share a direction
    xs = [common + np.float32(0.5) * rng.standard_normal(50000).astype(np.float32) for _ in range(4)]
    from intellect_jax.net.plan import simulate

    got = simulate(xs, "int4", 64, 8192)
    exact = np.mean(xs, axis=0)
    # 4 roundings of 4 bits (3 hops and the owner's): ~0.15 here, against ~0.008 for int8
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.2
