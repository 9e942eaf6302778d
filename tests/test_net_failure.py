"""Failure semantics with real processes: a peer killed, stalled, or sending garbage
mid-reduction makes every survivor raise within the deadline with its input unchanged,
and a retry over a new ring without the culprit succeeds."""

from __future__ import annotations

import hashlib

import pytest

from intellect_jax.net import RingConfig
from intellect_jax.net.plan import simulate
from intellect_jax.testing.faults import Fault, rank_data, run_ring_processes

pytestmark = pytest.mark.processes

DEADLINE = 10.0
NUMEL, PIECE = 1 << 21, 1 << 14
RING = dict(deadline=DEADLINE, numel=NUMEL, piece_numel=PIECE)  # mode and block: RingConfig defaults


def _expected_digest(ranks: list[int]) -> str:
    """sha256 of the ring mean of these ranks' inputs (in ring order), computed in-process."""
    cfg = RingConfig()
    y = simulate([rank_data(r, NUMEL) for r in ranks], cfg.mode, cfg.block_size, PIECE)
    return hashlib.sha256(y.tobytes()).hexdigest()


def _check_failed_then_retried(reports: list[dict], victim: int, world: int) -> list[dict]:
    first = [r for r in reports if r["epoch"] == 0 and r["rank"] != victim]
    retry = [r for r in reports if r["epoch"] == 1]
    assert len(first) == world - 1, reports
    for r in first:
        assert r["status"] == "error", r
        assert r["elapsed"] < DEADLINE + 1.0, r
        assert r["input_unchanged"], r
    assert len(retry) == world - 1 and all(r["status"] == "ok" for r in retry), retry
    assert len({r["digest"] for r in retry}) == 1  # bit-identical on every survivor
    survivors = [r for r in range(world) if r != victim]
    assert retry[0]["digest"] == _expected_digest(survivors)  # and the mean of the survivors' inputs
    return first


def test_healthy_processes_agree() -> None:
    reports = run_ring_processes(3, **RING)
    assert [r["status"] for r in reports] == ["ok"] * 3
    assert len({r["digest"] for r in reports}) == 1 and all(r["input_unchanged"] for r in reports)
    assert reports[0]["digest"] == _expected_digest([0, 1, 2])


def test_peer_killed_mid_reduction() -> None:
    reports = run_ring_processes(4, fault=Fault(2, "kill", after=20), retry=True, **RING)
    first = _check_failed_then_retried(reports, 2, 4)
    assert any("rank 2" in r["message"] for r in first)


def test_peer_stalled_mid_reduction() -> None:
    reports = run_ring_processes(4, fault=Fault(1, "stop", after=20), retry=True, **RING,
                                 io_timeout=2.0)
    first = _check_failed_then_retried(reports, 1, 4)
    assert any(r["error"] == "PeerTimeout" and "rank 1" in r["message"] for r in first)


def test_peer_sending_garbage() -> None:
    reports = run_ring_processes(4, fault=Fault(3, "garbage", after=20), retry=True, **RING)
    first = _check_failed_then_retried(reports, 3, 4)
    successor = next(r for r in first if r["rank"] == 0)
    assert successor["error"] == "FrameError", successor
