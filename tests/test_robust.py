"""Robust aggregators of one segment (net/robust.py): honest rows pass, one attacker cannot
steer, non-finite rows are dropped, and the same rows give the same bits."""

from __future__ import annotations

import numpy as np
import pytest

from intellect_jax.net.robust import aggregate, check_mode, norm

MODES = ("clip", "trim1", "cclip")


def _rows(n: int, dim: int = 4096, noise: float = 1.0, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    m = rng.standard_normal(dim).astype(np.float32)
    return [m + np.float32(noise) * rng.standard_normal(dim).astype(np.float32) for _ in range(n)]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.astype(np.float64), b) / (norm(a) * norm(b)))


@pytest.mark.parametrize("mode", ("mean", *MODES))
def test_identical_rows_aggregate_to_themselves(mode):
    x = _rows(1)[0]
    got = aggregate([x.copy() for _ in range(5)], mode)
    np.testing.assert_allclose(got.value, x, rtol=1e-6, atol=1e-6)
    assert got.weights == (1.0,) * 5


@pytest.mark.parametrize("n", (4, 8))
def test_one_sign_flipping_member_reverses_the_mean_but_not_a_robust_aggregate(n):
    rows = _rows(n, noise=0.3)  # honest pseudo-gradients alike (cosine ~0.9), as in the run
    honest = np.mean(np.stack(rows[1:]), axis=0)
    rows[0] = -(n - 1) * rows[0]  # its honest piece, negated and scaled to cancel everyone else
    assert _cos(aggregate(rows, "mean").value, honest) < 0.5  # (so the test below can fail)
    for mode in MODES:
        got = aggregate(rows, mode)
        assert _cos(got.value, honest) > 0.8, mode
    assert aggregate(rows, "clip").weights[0] < 1.0 / (n - 2)  # the attacker's row was scaled down


def test_a_steady_push_in_a_fixed_direction_is_bounded():
    rows = _rows(8)
    honest = np.mean(np.stack(rows[1:]), axis=0)
    u = np.random.default_rng(9).standard_normal(rows[0].size).astype(np.float32)
    rows[0] = 7 * norm(rows[1]) * u / np.float32(norm(u))
    assert _cos(aggregate(rows, "mean").value, honest) < 0.6
    for mode in MODES:
        assert _cos(aggregate(rows, mode).value, honest) > 0.8, mode


@pytest.mark.parametrize("mode", ("mean", *MODES))
def test_a_row_that_is_not_finite_is_dropped_by_every_aggregator(mode):
    rows = _rows(4)
    rows[2] = rows[2].copy()
    rows[2][3000] = np.nan  # outside any first piece
    got = aggregate(rows, mode)
    assert np.isfinite(got.value).all() and got.weights[2] == 0.0
    np.testing.assert_array_equal(got.value, aggregate(rows[:2] + rows[3:], mode).value)
    with pytest.raises(ValueError, match="every row"):
        aggregate([rows[2]], mode)


@pytest.mark.parametrize("mode", ("mean", *MODES))
def test_the_same_rows_give_the_same_bits(mode):
    rows = _rows(6, seed=3)
    a = aggregate(rows, mode).value
    b = aggregate([np.array(r, copy=True) for r in rows], mode).value
    assert a.dtype == np.float32 and a.tobytes() == b.tobytes()


def test_a_clean_round_loses_little_direction():
    rows = _rows(8, noise=1.0, seed=5)
    want = aggregate(rows, "mean").value
    for mode in MODES:
        assert _cos(aggregate(rows, mode).value, want) > 0.95, mode


def test_aggregator_names_are_checked():
    for ok in ("mean", "clip", "cclip", "trim1", "trim12"):
        check_mode(ok)
    for bad in ("trim0", "trim", "median", "trim100"):
        with pytest.raises(ValueError, match="is not one of"):
            check_mode(bad)
