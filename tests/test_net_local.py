"""The in-process fake communicator: same interface and results as the socket ring."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from intellect_jax.net import Communicator, LocalGroup, NetNode, PeerClosed, PeerTimeout, RingConfig, TransportConfig
from intellect_jax.net.plan import simulate


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


def test_local_group_blocks_until_all_ranks_and_matches_simulation() -> None:
    xs = [np.random.default_rng(r).standard_normal(5000).astype(np.float32) for r in range(4)]
    group = LocalGroup(4, RingConfig(mode="int8"))
    outs, errs = _threads(group, xs)
    assert errs == [None] * 4
    ref = simulate(xs, "int8", 64, RingConfig().piece_numel)
    assert all(np.array_equal(o, ref) for o in outs)
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


def test_both_implementations_satisfy_the_protocol() -> None:
    cfg = TransportConfig(run_id="p", secret=b"0123456789abcdef0123")
    with NetNode(cfg) as node:
        ring = node.ring([node.address], 0)
        assert isinstance(ring, Communicator)
        x = np.arange(7, dtype=np.float32)
        assert np.array_equal(ring.all_reduce_mean(x), x)  # a ring of one is an exact copy
    assert isinstance(LocalGroup(2).communicator(1), Communicator)
