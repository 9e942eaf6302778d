"""Failure semantics with real processes: a peer killed, stalled, or sending garbage
mid-reduction makes every survivor raise within the deadline with its input unchanged,
and a retry over a new ring without the culprit succeeds."""

from __future__ import annotations

import pytest

from intellect_jax.net.testing import Fault, run_ring_processes

pytestmark = pytest.mark.slow

DEADLINE = 10.0


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
    return first


def test_healthy_processes_agree() -> None:
    reports = run_ring_processes(3, deadline=DEADLINE)
    assert [r["status"] for r in reports] == ["ok"] * 3
    assert len({r["digest"] for r in reports}) == 1 and all(r["input_unchanged"] for r in reports)


def test_peer_killed_mid_reduction() -> None:
    reports = run_ring_processes(4, fault=Fault(2, "kill", after=20), retry=True, deadline=DEADLINE)
    first = _check_failed_then_retried(reports, 2, 4)
    assert any("rank 2" in r["message"] for r in first)


def test_peer_stalled_mid_reduction() -> None:
    reports = run_ring_processes(4, fault=Fault(1, "stop", after=20), retry=True, deadline=DEADLINE,
                                 io_timeout=2.0)
    first = _check_failed_then_retried(reports, 1, 4)
    assert any(r["error"] == "PeerTimeout" and "rank 1" in r["message"] for r in first)


def test_peer_sending_garbage() -> None:
    reports = run_ring_processes(4, fault=Fault(3, "garbage", after=20), retry=True, deadline=DEADLINE)
    first = _check_failed_then_retried(reports, 3, 4)
    successor = next(r for r in first if r["rank"] == 0)
    assert successor["error"] == "FrameError", successor
