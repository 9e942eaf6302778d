"""The butterfly exchange over real sockets (ranks as threads in one process) and its fake."""

from __future__ import annotations

import base64
import socket
import time
from typing import Any

import numpy as np
import pytest

from intellect_jax.coordinator.policing import weigh
from intellect_jax.coordinator.schema import Evidence
from intellect_jax.net import ConfigMismatch, RingConfig, butterfly, mesh_call
from intellect_jax.net.evidence import SAT_OUT, verdict
from intellect_jax.net.frames import HEADER_LEN
from intellect_jax.net.plan import butterfly_plan, make_plan
from intellect_jax.testing.identities import credentials
from intellect_jax.testing.local_ring import LocalGroup, ring_bytes
from tests.test_net_ring import _inputs, _members, _nodes, _run, _same_bits


def _butterfly(world: int, xs: list[Any], cfg: RingConfig, first: int = 0, **kw: Any):
    nodes = _nodes(world, first=first)
    try:
        comms = [n.ring(_members(nodes), r, config=cfg, **kw) for r, n in enumerate(nodes)]
        for c in comms:
            c.inspect = lambda theirs: verdict(theirs, None)
        outs, errs = _run(comms, xs)
        return comms, outs, errs
    finally:
        for n in nodes:
            n.close()


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


@pytest.mark.parametrize(("world", "mode", "how"), [
    (1, "int8", "mean"), (2, "fp32", "mean"), (3, "int8", "mean"), (5, "bf16", "cclip"), (4, "int4", "trim1"),
    (5, "int8", "clip")])
def test_bit_identical_on_every_rank_and_equal_to_the_fake(world: int, mode: str, how: str) -> None:
    n = 10_007  # divisible neither by the world size nor by the block
    cfg = RingConfig(mode=mode, block_size=64, piece_numel=700, deadline=30, exchange="butterfly", robust=how)
    xs = _inputs(world, n)
    copies = [x.copy() for x in xs]
    comms, outs, errs = _butterfly(world, xs, cfg)
    assert errs == [None] * world
    ref = butterfly.simulate(xs, mode, 64, 700, how)
    fake = LocalGroup(world, cfg).all_reduce_mean_all(xs)
    for r in range(world):
        assert _same_bits(outs[r], ref) and _same_bits(fake[r], ref), f"rank {r} differs"
        assert np.array_equal(xs[r], copies[r]), "input modified"
        if world > 1:  # the data frames the fake counts, plus one header frame to each other rank
            extra = comms[r].last_stats.bytes_sent - ring_bytes(n, world, r, cfg)
            assert (world - 1) * HEADER_LEN < extra < (world - 1) * (HEADER_LEN + 4096)
    if how == "mean":
        true = np.mean(np.stack(xs).astype(np.float64), axis=0)
        tol = {"fp32": 1e-6, "bf16": 1e-2, "int8": 3e-2}[mode] if world > 1 else 0.0
        assert np.linalg.norm(outs[0] - true) / np.linalg.norm(true) <= tol


@pytest.mark.parametrize("n", [2_000_000, 25_000_000])
@pytest.mark.parametrize("world", [4, 8, 16])
def test_bytes_per_node_within_ten_percent_of_the_ring(world: int, n: int) -> None:
    """What each rank sends, signatures and audits included, against the ring's, for a vector
    the size of the debug model's (its segments get 16 pieces, so one audited piece per link is
    cheap) and a 25M-value one."""
    ring, fly = RingConfig(), RingConfig(exchange="butterfly", robust="cclip")
    for r in range(world):
        assert abs(ring_bytes(n, world, r, fly) / ring_bytes(n, world, r, ring) - 1) < 0.10


@pytest.mark.parametrize(("numel", "world"), [(2_000_000, 4), (2_000_000, 16), (100_000, 4), (25_000_000, 4),
                                              (10_007, 5), (4_000_000, 2), (262_081, 4)])
def test_the_butterfly_plan_keeps_sixteen_pieces_per_segment_while_they_keep_4096_values(numel: int,
                                                                                         world: int) -> None:
    ring, fly = make_plan(numel, world, 64, 1 << 18), butterfly_plan(numel, world, 64, 1 << 18)
    assert fly.seg_bounds == ring.seg_bounds and fly.pieces >= ring.pieces
    sizes = [b - a for c in range(world) for j in range(fly.pieces) for a, b in [fly.piece(c, j)]]
    assert sum(sizes) == numel and max(sizes) <= 1 << 18
    if fly.pieces > ring.pieces:  # the floor added pieces: never below 4096 values, and no more than 16
        assert fly.pieces <= 16 and min(sizes) >= 4096
    if min(b - a for a, b in zip(ring.seg_bounds, ring.seg_bounds[1:])) >= 16 * 4096:
        assert fly.pieces >= 16


def test_a_small_vector_is_cut_into_sixteen_audited_pieces_per_segment_over_sockets() -> None:
    """The debug model's scale in miniature: one piece per segment by size, sixteen by the
    floor; every rank gets the fake's bits and sends what the fake counts."""
    world, n = 4, 16 * 4096 * 4 + 333
    cfg = RingConfig(mode="int8", deadline=30, exchange="butterfly", robust="cclip")
    assert butterfly_plan(n, world, 64, cfg.piece_numel).pieces == 16
    xs = _inputs(world, n)
    comms, outs, errs = _butterfly(world, xs, cfg)
    assert errs == [None] * world
    ref = butterfly.simulate(xs, "int8", 64, cfg.piece_numel, "cclip")
    for r in range(world):
        assert _same_bits(outs[r], ref), f"rank {r} differs"
        extra = comms[r].last_stats.bytes_sent - ring_bytes(n, world, r, cfg)
        assert (world - 1) * HEADER_LEN < extra < (world - 1) * (HEADER_LEN + 4096)


def test_an_owner_keeps_evidence_against_every_sender_of_a_bad_piece() -> None:
    """Ranks 2 and 3 each put a NaN in a piece of segment 1: rank 1, its owner, holds the signed
    evidence against both (one each, reported together), each upheld by the coordinator's check;
    before, only the first went with a report, and the second sender was evicted rounds later."""
    world, n = 4, 8000
    cfg = RingConfig(mode="int8", piece_numel=256, deadline=30, exchange="butterfly")
    p = butterfly_plan(n, world, 64, 256)
    xs = _inputs(world, n, seed=4)
    xs[2][p.piece(1, p.pieces - 1)[1] - 1] = np.nan
    xs[3][p.piece(1, 0)[0]] = np.nan
    comms, outs, errs = _butterfly(world, xs, cfg, first=40, epoch=3, step=9)
    assert errs == [None] * world
    assert all(not c.suspects for r, c in enumerate(comms) if r != 1)
    assert sorted(s[0] for s in comms[1].suspects) == [2, 3] and comms[1].suspect == comms[1].suspects[0]
    kw: dict[str, Any] = dict(run_id="ring-test", step=9, epoch_id=3, recorded=None, ca=credentials("r40").ca_der)
    for sender, why, ev in comms[1].suspects:
        assert weigh(Evidence.model_validate(ev), accuser="r41", accused=f"r4{sender}", **kw) == (why, "")


def test_nan_far_from_the_first_piece_is_evidence_against_its_sender_and_dropped() -> None:
    """Rank 2 puts a NaN in the last piece of segment 1 (the ring's successor would never see
    it): rank 1, its owner, keeps the piece signed by rank 2 as evidence, which the coordinator's
    check accepts with rank 1 as the accuser; every rank gets the mean of the other rows there,
    bit-identical, and nothing else changes."""
    world, n = 4, 8000
    cfg = RingConfig(mode="int8", piece_numel=256, deadline=30, exchange="butterfly")
    p = butterfly_plan(n, world, 64, 256)
    a, b = p.piece(1, p.pieces - 1)
    xs = _inputs(world, n, seed=3)
    xs[2][b - 1] = np.nan
    comms, outs, errs = _butterfly(world, xs, cfg, first=40, epoch=3, step=9)
    assert errs == [None] * world
    assert all(c.suspect is None for r, c in enumerate(comms) if r != 1)
    sender, why, ev = comms[1].suspect
    assert (sender, why) == (2, "non-finite values")
    e = Evidence.model_validate(ev)
    assert (e.step, e.epoch, e.segment, e.piece) == (9, 3, 1, p.pieces - 1)
    kw: dict[str, Any] = dict(run_id="ring-test", step=9, epoch_id=3, recorded=None, ca=credentials("r40").ca_der)
    assert weigh(e, accuser="r41", accused="r42", **kw) == ("non-finite values", "")
    for accuser, accused in (("r43", "r42"), ("r41", "r40")):  # told by another owner, or of another sender
        assert weigh(e, accuser=accuser, accused=accused, **kw)[0] is None
    raw = bytearray(base64.b64decode(e.payload))
    raw[-1] ^= 1
    assert weigh(e.model_copy(update={"payload": base64.b64encode(bytes(raw)).decode()}),
                 accuser="r41", accused="r42", **kw)[0] is None
    for r in range(world):
        assert _same_bits(outs[r], outs[0]) and np.isfinite(outs[r]).all()
    rows = [butterfly.roundtrip(x[a:b], "int8", 64) for i, x in enumerate(xs) if i != 2]
    want = butterfly.roundtrip(np.mean(np.stack(rows), axis=0, dtype=np.float32), "int8", 64)
    np.testing.assert_allclose(outs[0][a:b], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("how", ["clip", "cclip", "trim1"])
def test_a_sign_flip_does_not_reverse_a_robust_average(how: str) -> None:
    """One of 4 ranks sends -N x its honest contribution: the plain mean points away from the
    honest ranks' mean; each robust owner keeps it within 0.8 cosine of it."""
    world, n = 4, 20_000
    rng = np.random.default_rng(5)
    common = rng.standard_normal(n).astype(np.float32)
    xs = [common + 0.5 * rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    honest = np.mean(np.stack(xs[1:]), axis=0)
    xs[0] = -world * xs[0]
    assert _cos(butterfly.simulate(xs, "int8", 64, 1000, "mean"), honest) < 0
    cfg = RingConfig(mode="int8", piece_numel=1000, deadline=30, exchange="butterfly", robust=how)
    _, outs, errs = _butterfly(world, xs, cfg, first=50)
    assert errs == [None] * world
    assert _cos(outs[0], honest) > 0.8 and all(_same_bits(o, outs[0]) for o in outs)


@pytest.mark.parametrize("audit", [True, False])
def test_every_other_owner_shows_a_flipped_sender_s_rows_outsized(monkeypatch: pytest.MonkeyPatch,
                                                                  audit: bool) -> None:
    """Rank 0 sends -3x its contribution among 4: each other owner finds its rows outsized in
    most pieces of its segment and keeps one piece, every row of it signed to it, which the
    coordinator's re-weighing upholds with that owner as the reporter (and with no other);
    nobody shows an honest rank. Without audits each row kept to be weighed has its signature
    checked as it arrives all the same: a steerer (or an accomplice) signing garbage would
    otherwise leave nothing to show; its owners fail the call at its first piece and name it as
    the member whose pieces did not reach them, as with audits."""
    from intellect_jax.coordinator.policing import weigh_steering
    from intellect_jax.coordinator.schema import Steering
    from intellect_jax.net.comm import SocketCommunicator

    world, n = 4, 20_000
    rng = np.random.default_rng(5)
    common = rng.standard_normal(n).astype(np.float32)
    xs = [common + 0.5 * rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    xs[0] = -3 * xs[0]
    cfg = RingConfig(mode="int8", piece_numel=1000, deadline=30, exchange="butterfly", robust="cclip", audit=audit)
    if not audit:
        seal = SocketCommunicator._mesh_seal

        def garbage(self: Any, call: int, links: Any) -> butterfly.MeshSeal:
            s = seal(self, call, links)
            return s if self.rank else butterfly.MeshSeal(lambda *a: bytes(64), s.verify)

        monkeypatch.setattr(SocketCommunicator, "_mesh_seal", garbage)
    comms, outs, errs = _butterfly(world, xs, cfg, first=56, epoch=2, step=5)
    if not audit:
        assert all(e is not None for e in errs[1:]) and [c.missing for c in comms[1:]] == [(0,)] * 3, errs
        assert all(c.steered == [] for c in comms)
        return
    assert errs == [None] * world and all(_same_bits(o, outs[0]) for o in outs)
    ids = tuple(f"r{56 + i}" for i in range(world))
    kw: dict[str, Any] = dict(run_id="ring-test", step=5, epoch_id=2, ring=ids, sat_out=(),
                              ca=credentials("r56").ca_der, certs={i: credentials(i).cert_der.hex() for i in ids})
    assert comms[0].steered == []
    for r in range(1, world):
        (accused, ev), = comms[r].steered
        shown = Steering.model_validate({"accused": ids[accused], **ev})
        ratio, why, _ = weigh_steering(shown, accuser=ids[r], **kw)
        assert accused == 0 and ratio is not None and ratio > 2.5 and ratio == pytest.approx(ev["ratio"]), why
        assert weigh_steering(shown, accuser=ids[r % 3 + 1], **kw)[0::2] == (None, True)  # not its segment


def test_an_owner_that_left_a_row_out_shows_no_steering_on_that_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 sends -3x its contribution among 6, and rank 5 signs its pieces to owner 1 with
    garbage, so owner 1 leaves rank 5's rows out of its whole segment (the row deadline; the
    other four rows still make a median at N = 6). The
    coordinator takes steering evidence only with every contributor's row, so owner 1 shows
    nothing (a review found it showed rank 0 on pieces without rank 5's row, which the
    coordinator counted as a false accusation against it); owners 2 to 5 show rank 0 as before."""
    from intellect_jax.coordinator.policing import weigh_steering
    from intellect_jax.coordinator.schema import Steering
    from tests.helpers import unsigned_rows

    world, n = 6, 24_000
    rng = np.random.default_rng(5)
    common = rng.standard_normal(n).astype(np.float32)
    xs = [common + 0.5 * rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    xs[0] = -3 * xs[0]
    left = unsigned_rows(monkeypatch, lambda run, o: run.rank == 5 and o == 1)
    cfg = RingConfig(mode="int8", piece_numel=1000, deadline=30, exchange="butterfly", robust="cclip")
    comms, outs, errs = _butterfly(world, xs, cfg, first=76, epoch=2, step=5)
    assert errs == [None] * world and all(_same_bits(o, outs[0]) for o in outs), errs
    assert set(left) == {(1, 5)} and comms[1].steered == [], (left, comms[1].steered)
    ids = tuple(f"r{76 + i}" for i in range(world))
    kw: dict[str, Any] = dict(run_id="ring-test", step=5, epoch_id=2, ring=ids, sat_out=(),
                              ca=credentials("r76").ca_der, certs={i: credentials(i).cert_der.hex() for i in ids})
    for r in range(2, world):
        (accused, ev), = comms[r].steered
        ratio, why, _ = weigh_steering(Steering.model_validate({"accused": ids[accused], **ev}), accuser=ids[r], **kw)
        assert accused == 0 and ratio is not None, why


def test_an_owner_with_another_aggregator_fails_every_rank_with_a_config_mismatch() -> None:
    world = 3
    nodes = _nodes(world, first=60)
    try:
        cfgs = [RingConfig(deadline=20, exchange="butterfly", robust="cclip" if r == 2 else "mean")
                for r in range(world)]
        comms = [n.ring(_members(nodes), r, config=cfgs[r]) for r, n in enumerate(nodes)]
        _, errs = _run(comms, _inputs(world, 1000))
    finally:
        for n in nodes:
            n.close()
    assert all(isinstance(e, ConfigMismatch) for e in errs), errs
    assert "robust" in str(errs[0])


@pytest.mark.parametrize("bad", [dict(mode="int2"), dict(stochastic_rounding=True), dict(streams=2),
                                 dict(robust="median")])
def test_butterfly_settings_it_cannot_run_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RingConfig(exchange="butterfly", **bad)
    with pytest.raises(ValueError, match="butterfly"):
        RingConfig(robust="cclip")


@pytest.mark.parametrize("sends", ["zeros", "values"])
def test_a_member_sitting_out_is_left_out_and_its_values_are_evidence(sends: str) -> None:
    """Rank 1 sits the round out (every rank's ``absent``): with zeros, the result is the
    aggregate of the other three ranks' rows, bit-identical to the fake; with values, every
    owner keeps one of its signed pieces as evidence, which the coordinator upholds only for a
    member that declared it sits out."""
    world, n = 4, 4000
    xs = _inputs(world, n, seed=9)
    if sends == "zeros":
        xs[1][...] = 0
    cfg = RingConfig(mode="int8", piece_numel=256, deadline=30, exchange="butterfly", robust="cclip")
    nodes = _nodes(world, first=80)
    try:
        comms = [nd.ring(_members(nodes), r, epoch=2, step=5, config=cfg) for r, nd in enumerate(nodes)]
        for c in comms:
            c.inspect, c.absent = (lambda theirs: verdict(theirs, None)), frozenset({1})
        outs, errs = _run(comms, xs)
    finally:
        for nd in nodes:
            nd.close()
    assert errs == [None] * world
    ref = butterfly.simulate(xs, "int8", 64, 256, "cclip", frozenset({1}))
    assert all(_same_bits(o, ref) for o in outs)
    group = LocalGroup(world, cfg)
    for c in group.comms:
        c.absent = frozenset({1})
    assert _same_bits(group.all_reduce_mean_all(xs, absent=frozenset({1}))[0], ref)
    if sends == "zeros":
        assert all(c.suspect is None for c in comms)
        return
    kw: dict[str, Any] = dict(run_id="ring-test", step=5, epoch_id=2, recorded=None, ca=credentials("r80").ca_der)
    for owner in (0, 2, 3):
        sender, why, ev = comms[owner].suspect
        assert (sender, why) == (1, SAT_OUT)
        e = Evidence.model_validate(ev)
        assert weigh(e, accuser=f"r8{owner}", accused="r81", sat_out=True, **kw) == (SAT_OUT, "")
        assert weigh(e, accuser=f"r8{owner}", accused="r81", **kw)[0] is None  # it did not declare it


def test_a_flat_view_of_several_leaves_reads_and_writes_them_without_a_copy() -> None:
    """``tree.Flat``: a bucket of several leaves as one vector (a butterfly call holds every
    bucket at once; gathering each into one array would copy the model). Every range reads as
    the concatenation would, a view where it lies in one leaf; ``put`` writes through."""
    from intellect_jax.net.tree import Flat, overlaps, view

    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal(n).astype(np.float32) for n in (5, 0, 7, 1, 9)]
    whole, flat = np.concatenate(leaves), view(leaves, [0, 1, 2, 3, 4])
    assert isinstance(flat, Flat) and flat.shape == whole.shape and view(leaves, [2]) is not None
    for a in range(whole.shape[0] + 1):
        for b in range(a, whole.shape[0] + 1):
            assert np.array_equal(flat[a:b], whole[a:b]), (a, b)
    assert np.shares_memory(flat[5:9], leaves[2]) and overlaps([flat], [leaves[4]])
    assert not overlaps([flat], [whole]) and not overlaps([leaves[0], leaves[2]], [leaves[4], flat[0:0]])
    assert overlaps([whole[:3]], [leaves[0], whole[2:4]]) and not overlaps([whole[:3]], [whole[3:]])
    with pytest.raises(ValueError):
        flat.put(20, np.zeros(3, np.float32))
    values = rng.standard_normal(whole.shape[0]).astype(np.float32)
    for a, b in ((0, 22), (3, 14), (12, 13), (13, 22)):
        flat.put(a, values[a:b])
        assert np.array_equal(np.concatenate(leaves)[a:b], values[a:b]), (a, b)


def test_a_tree_of_several_buckets_is_reduced_in_one_call_into_the_callers_arrays() -> None:
    """Leaves of 300, 700, 0, 5000, 100 and 100 values in buckets of at most 1000: [a b c], [d],
    [e f], one butterfly call with every bucket's pieces before any aggregate, audited. Each
    bucket's result is the fake's of that bucket's flat vector on every rank, bit for bit, and
    lands in the ``out`` arrays given (a multi-leaf bucket through a copy, one leaf in place)."""
    import threading

    world, sizes = 4, {"a": 300, "b": 700, "c": 0, "d": 5000, "e": 100, "f": 100}
    cfg = RingConfig(mode="int8", block_size=64, piece_numel=256, deadline=30, exchange="butterfly", robust="cclip",
                     bucket_numel=1000)
    rng = np.random.default_rng(3)
    trees = [{k: rng.standard_normal(n).astype(np.float32) for k, n in sizes.items()} for _ in range(world)]
    outs = [{k: np.full(n, 7, np.float32) for k, n in sizes.items()} for _ in range(world)]
    nodes = _nodes(world, first=40)
    errs: list[BaseException | None] = [None] * world
    try:
        comms = [n.ring(_members(nodes), r, config=cfg) for r, n in enumerate(nodes)]

        def go(r: int) -> None:
            try:
                comms[r].inspect = lambda theirs: verdict(theirs, None)
                assert comms[r].all_reduce_mean(trees[r], out=outs[r]) is not None
            except BaseException as e:  # noqa: BLE001 - inspected below
                errs[r] = e

        threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for n in nodes:
            n.close()
    assert errs == [None] * world, errs
    for keys in (["a", "b", "c"], ["d"], ["e", "f"]):
        ref = butterfly.simulate([np.concatenate([t[k] for k in keys]) for t in trees], "int8", 64, 256, "cclip")
        for r in range(world):
            assert _same_bits(np.concatenate([outs[r][k] for k in keys]), ref), (keys, r)


@pytest.mark.parametrize("how", ["slow", "failed"])
def test_an_owner_keeps_the_rows_of_two_buckets_at_most(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Eight buckets in one call, every bucket's pieces before any aggregate: rank 3 holds back
    its first piece for 1 s (``slow``), or ranks 2 and 3 sign their pieces to owner 0 with
    garbage, which fails the call there at once (``failed``: one is left out, a minority of the
    contributors; the second is one too many). Meanwhile the other senders' pieces of every bucket
    arrive. An owner decodes into float32 rows only the pieces of the bucket it aggregates and
    the next one (later ones wait encoded), and none after the call failed (they are counted for
    its gaps, not kept): at most two buckets' rows are alive at once on any rank. Before, every
    bucket's rows were: 3 senders x 8 buckets."""
    import threading

    from intellect_jax.net.butterfly import MeshSeal

    world, buckets, n = 4, 8, 8192
    lock, live, peak = threading.Lock(), [0] * world, [0] * world
    row, release, honest = butterfly._ButterflyRun._row, butterfly._ButterflyRun._release_rows, \
        butterfly._ButterflyRun._scatter_to

    def counted(self: Any, m: int) -> Any:
        with lock:
            live[self.rank] += 1
            peak[self.rank] = max(peak[self.rank], live[self.rank])
        return row(self, m)

    def released(self: Any, rows: Any) -> None:
        with lock:
            live[self.rank] -= sum(r is not None for r in rows)
        release(self, rows)

    def scatter(self: Any, k: int) -> None:
        if self.rank == 3 and how == "slow" and self.first == 0:
            time.sleep(1.0)
        if self.rank in (2, 3) and how == "failed" and not getattr(self.mseal, "bad", False):
            sign = self.mseal.sign

            class Bad(MeshSeal):
                bad = True
            self.mseal = Bad(lambda owner, *a: bytes(64) if owner == 0 else sign(owner, *a), self.mseal.verify)
        honest(self, k)

    monkeypatch.setattr(butterfly._ButterflyRun, "_row", counted)
    monkeypatch.setattr(butterfly._ButterflyRun, "_release_rows", released)
    monkeypatch.setattr(butterfly._ButterflyRun, "_scatter_to", scatter)
    cfg = RingConfig(deadline=8, exchange="butterfly", robust="clip", piece_numel=1024, bucket_numel=n)
    trees = [{f"l{b}": _inputs(world, n, seed=b)[r] for b in range(buckets)} for r in range(world)]
    comms, _, errs = _butterfly(world, trees, cfg, first=60)
    assert (errs == [None] * world) if how == "slow" else all(e is not None for e in errs), errs
    per_bucket = butterfly_plan(n, world, cfg.block_size, cfg.piece_numel).pieces * world  # rows, our own included
    assert max(peak) <= 2 * per_bucket, (peak, per_bucket)
    if how == "failed":
        assert comms[0].missing == (2, 3), [c.missing for c in comms]  # (one left out: a minority; two, no)


def test_our_own_pieces_go_before_our_aggregates_and_every_mesh_link_bounds_its_backlog(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank sends its aggregates (step 3) only once its own pieces (step 1) are out on every
    link, so that every owner aggregates, and commits, as early as the links allow; and every
    link of the mesh queues at most ``notsent_lowat`` unsent bytes, so a small frame (an audit
    step) does not wait behind megabytes of aggregates (docs/results.md)."""
    from intellect_jax.net import transport

    world, events = 4, {r: [] for r in range(4)}
    sent, over, bound = mesh_call.MeshCall._sent, mesh_call.MeshCall._over, transport.Connection.bound_unsent
    bounded: list[int] = []

    def on_sent(self: Any, phase: int, k: int) -> None:
        events[self.rank].append(("sent", phase))
        sent(self, phase, k)

    def on_over(self: Any, side: int, k: int) -> bool:
        events[self.rank].append(("over", side))
        return over(self, side, k)

    def on_bound(self: Any, n: int | None) -> None:
        bound(self, n)
        bounded.append(self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT))

    monkeypatch.setattr(mesh_call, "PACE_HOLD", 10.0)  # (no link counts as stuck on a loaded machine)
    monkeypatch.setattr(mesh_call.MeshCall, "_sent", on_sent)
    monkeypatch.setattr(mesh_call.MeshCall, "_over", on_over)
    monkeypatch.setattr(transport.Connection, "bound_unsent", on_bound)
    cfg = RingConfig(mode="int8", block_size=64, piece_numel=512, deadline=30, exchange="butterfly", robust="mean")
    xs = _inputs(world, 20_000)
    _, outs, errs = _butterfly(world, xs, cfg)
    assert errs == [None] * world and all(_same_bits(o, outs[0]) for o in outs)
    assert bounded == [128 << 10] * (world * (world - 1))
    for r, ev in events.items():
        first = ev.index(("sent", 1))
        assert ev[:first].count(("over", 0)) == world - 1, (r, ev)


def test_a_mesh_link_whose_opener_starts_late_still_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each link of the mesh opens in its own thread (net/mesh.py). One that starts only after
    the call has its new links in hand must still open its own connection, or reuse the last
    call's, never wait for itself (it did: the opener read the new links, and every link timed
    out)."""
    from intellect_jax.net import mesh

    opened = mesh.Pending._open

    def late(self: Any, opener: Any) -> None:
        time.sleep(0.05)
        opened(self, opener)

    monkeypatch.setattr(mesh.Pending, "_open", late)
    cfg = RingConfig(mode="int8", block_size=64, piece_numel=512, deadline=4, exchange="butterfly", robust="mean")
    xs = _inputs(3, 3000)
    nodes = _nodes(3)
    try:
        comms = [n.ring(_members(nodes), r, config=cfg) for r, n in enumerate(nodes)]
        for _ in range(2):  # the first call opens its links, the second reuses them
            outs, errs = _run(comms, xs)
            assert errs == [None] * 3 and all(_same_bits(o, outs[0]) for o in outs), errs
    finally:
        for n in nodes:
            n.close()
