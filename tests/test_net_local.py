"""The in-process fake communicator: same interface and results as the socket ring."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from intellect_jax.testing.local_ring import LocalGroup
from intellect_jax.net import Communicator, NetNode, PeerClosed, PeerTimeout, RingConfig
from intellect_jax.testing.identities import transport_config


def _threads(group: LocalGroup, inputs: list[np.ndarray]) -> tuple[list, list]:
    outs, errs = [None] * group.world, [None] * group.world

    def go(r: int) -> None:
        try:
            outs[r] = group.communicator(r).all_reduce_mean(inputs[r])
        except Exception as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=go, args=(r,)) for r in range(group.world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return outs, errs


def test_local_group_blocks_until_all_ranks_and_averages() -> None:
    xs = [np.random.default_rng(r).standard_normal(5000).astype(np.float32) for r in range(4)]
    group = LocalGroup(4, RingConfig(mode="int8"))
    outs, errs = [None] * 4, [None] * 4
    returned = [threading.Event() for _ in range(4)]

    def go(r: int) -> None:
        try:
            outs[r] = group.communicator(r).all_reduce_mean(xs[r])
        except Exception as e:  # noqa: BLE001
            errs[r] = e
        returned[r].set()

    ts = [threading.Thread(target=go, args=(r,)) for r in range(4)]
    for t in ts[:3]:
        t.start()
    time.sleep(0.2)
    assert not any(e.is_set() for e in returned[:3]), "a rank returned before every rank had called"
    ts[3].start()
    for t in ts:
        t.join(30)
    assert all(e.is_set() for e in returned)
    assert errs == [None] * 4
    assert all(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)) for o in outs)  # bit-identical
    true = np.mean(np.stack(xs).astype(np.float64), axis=0)
    assert np.linalg.norm(outs[0] - true) / np.linalg.norm(true) < 1e-2  # int8 tolerance
    assert np.max(np.abs(outs[0] - true)) < 0.05 * np.abs(true).max()
    assert outs[0] is not outs[1]  # every rank owns its result
    stats = group.communicator(2).last_stats
    assert stats.numel == 5000 and stats.bytes_sent > 5000 * 1.5 * 3 / 4


def test_fail_next_and_missing_rank() -> None:
    xs = [np.ones(10, np.float32) * r for r in range(3)]
    group = LocalGroup(3, RingConfig(mode="fp32", deadline=0.5))
    group.fail_next("rank 1 vanished")
    _, errs = _threads(group, xs)
    assert all(isinstance(e, PeerClosed) and "vanished" in str(e) for e in errs)
    assert all(np.array_equal(x, np.ones(10) * r) for r, x in enumerate(xs))
    outs, errs = _threads(group, xs)  # the group recovers on the next call
    assert errs == [None] * 3 and np.allclose(outs[0], 1.0)
    with pytest.raises(PeerTimeout, match="did not join"):
        group.communicator(0).all_reduce_mean(xs[0])


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((13, 7)).astype(np.float32),
            "b": [rng.standard_normal(5).astype(np.float32), np.asarray(rng.standard_normal(), np.float32)]}


def _leaves(tree: dict) -> list[np.ndarray]:
    return [tree["w"], tree["b"][0], tree["b"][1]]


def _call_all(comms: list, trees: list, outs: list | None = None) -> list:
    res, errs = [None] * len(comms), [None] * len(comms)

    def go(r: int) -> None:
        try:
            kw = {} if outs is None else {"out": outs[r]}
            res[r] = comms[r].all_reduce_mean(trees[r], **kw)
        except Exception as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=go, args=(r,)) for r in range(len(comms))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert errs == [None] * len(comms)
    return res


def test_both_implementations_satisfy_the_protocol() -> None:
    with NetNode(transport_config("p0", "p")) as node:
        ring = node.ring([(node.name, node.address)], 0)
        assert isinstance(ring, Communicator)
        x = np.arange(7, dtype=np.float32)
        assert np.array_equal(ring.all_reduce_mean(x), x)  # a ring of one is an exact copy
    assert isinstance(LocalGroup(2).communicator(1), Communicator)

    # the same tree through the fake and a 2-node socket ring gives the same bits
    rcfg = RingConfig(mode="int8", block_size=16, piece_numel=32, bucket_numel=64, deadline=30)
    trees = [_tree(0), _tree(1)]
    copies = [[a.copy() for a in _leaves(t)] for t in trees]
    group = LocalGroup(2, rcfg)
    fake = [group.communicator(r) for r in range(2)]
    nodes = [NetNode(transport_config(f"p{r}", "p")) for r in range(2)]
    try:
        sock = [n.ring([(m.name, m.address) for m in nodes], r, config=rcfg) for r, n in enumerate(nodes)]
        results = {}
        for name, comms in (("fake", fake), ("socket", sock)):
            plain = _call_all(comms, trees)
            bufs = [{"w": np.empty((13, 7), np.float32), "b": [np.empty(5, np.float32), np.empty((), np.float32)]}
                    for _ in range(2)]
            into = _call_all(comms, trees, bufs)
            for r in range(2):
                # the given buffers come back (the socket ring rebuilds the container around them)
                assert all(a is b for a, b in zip(_leaves(into[r]), _leaves(bufs[r]))), name
                for a, b in zip(_leaves(into[r]), _leaves(plain[r])):
                    assert a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
                assert all(np.array_equal(a, c) for a, c in zip(_leaves(trees[r]), copies[r])), "input modified"
            results[name] = (plain, [c.last_stats for c in comms])
    finally:
        for n in nodes:
            n.close()
    (f_out, f_stats), (s_out, s_stats) = results["fake"], results["socket"]
    for r in range(2):
        for a, b in zip(_leaves(f_out[r]), _leaves(s_out[r])):
            assert a.shape == b.shape and a.dtype == b.dtype == np.float32
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"rank {r}: fake and socket ring differ"
        assert f_stats[r].numel == s_stats[r].numel == 13 * 7 + 5 + 1
        assert f_stats[r].mode == s_stats[r].mode == "int8"
        assert f_stats[r].world_size == s_stats[r].world_size == 2
    true = np.mean([trees[0]["w"], trees[1]["w"]], axis=0)
    assert not np.array_equal(f_out[0]["w"], trees[0]["w"]) and np.allclose(f_out[0]["w"], true, atol=0.05)
