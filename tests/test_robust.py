"""Robust aggregators of one segment (net/robust.py): honest rows pass, one attacker cannot
steer, rows of another length or with values that are not finite are dropped, and the same
rows give the same bits (golden digests, signed zeros)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from intellect_jax.net.robust import aggregate, check_mode, norm

MODES = ("clip", "trim1", "cclip")
DIM = 4096


def _rows(n: int, dim: int = DIM, noise: float = 1.0, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    m = rng.standard_normal(dim).astype(np.float32)
    return [m + np.float32(noise) * rng.standard_normal(dim).astype(np.float32) for _ in range(n)]


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.astype(np.float64), b) / (norm(a) * norm(b)))


@pytest.mark.parametrize("mode", ("mean", *MODES))
def test_identical_rows_aggregate_to_themselves(mode):
    x = _rows(1)[0]
    got = aggregate([x.copy() for _ in range(5)], mode, DIM)
    np.testing.assert_allclose(got.value, x, rtol=1e-6, atol=1e-6)
    assert got.weights == (1.0,) * 5 and got.value.dtype == np.float32


@pytest.mark.parametrize("n", (4, 8))
def test_one_sign_flipping_member_cancels_the_mean_but_not_a_robust_aggregate(n):
    rows = _rows(n, noise=0.3)  # honest pseudo-gradients alike (cosine ~0.9), as in the run
    honest = np.mean(np.stack(rows[1:]), axis=0)
    rows[0] = -(n - 1) * rows[0]  # its honest piece, negated and scaled to cancel everyone else
    assert _cos(aggregate(rows, "mean", DIM).value, honest) < 0.5  # (so the test below can fail)
    for mode in MODES:
        assert _cos(aggregate(rows, mode, DIM).value, honest) > 0.8, mode
    assert aggregate(rows, "clip", DIM).weights[0] < 1.0 / (n - 2)  # the attacker's row was scaled down


def test_two_sign_flippers_of_four_cannot_lift_the_bound():
    """Half the rows large: the lower median keeps clip's bound at an honest norm."""
    rows = _rows(4, noise=0.3)
    honest = np.mean(np.stack(rows[2:]), axis=0)
    rows[0], rows[1] = -3 * rows[0], -3 * rows[1]
    assert _cos(aggregate(rows, "mean", DIM).value, honest) < 0  # reversed
    got = aggregate(rows, "clip", DIM)
    assert norm(got.value) <= norm(honest) * 1.1 and max(got.weights[:2]) < 0.5, got.weights


def test_a_steady_push_in_a_fixed_direction_is_bounded():
    rows = _rows(8)
    honest = np.mean(np.stack(rows[1:]), axis=0)
    u = np.random.default_rng(9).standard_normal(rows[0].size).astype(np.float32)
    rows[0] = 7 * norm(rows[1]) * u / np.float32(norm(u))
    assert _cos(aggregate(rows, "mean", DIM).value, honest) < 0.6
    for mode in MODES:
        assert _cos(aggregate(rows, mode, DIM).value, honest) > 0.8, mode


@pytest.mark.parametrize("mode", ("clip", "cclip"))
def test_a_finite_row_whose_squares_overflow_gets_no_weight(mode):
    """Norms are float32 sums of squares: a row of values near float32's largest has an
    infinite norm, and a bound of this round's median scales it to nothing (the rest as if it
    were left out, but for the divisor)."""
    rows = _rows(5)
    rows[1] = np.full(DIM, 3e37, np.float32)  # finite, its square is not
    got = aggregate(rows, mode, DIM)
    assert got.weights[1] == 0.0 and np.isfinite(got.value).all()
    honest = np.mean(np.stack(rows[:1] + rows[2:]), axis=0)
    assert _cos(got.value, honest) > 0.9 and norm(got.value) < 2 * norm(honest)


@pytest.mark.parametrize("mode", ("mean", *MODES))
def test_a_row_not_finite_or_of_another_length_is_dropped(mode):
    rows = _rows(5)
    want = aggregate(rows[:2] + rows[4:], mode, DIM).value
    rows[2] = rows[2].copy()
    rows[2][3000] = np.nan  # outside any first piece
    rows[3] = np.full(1, norm(rows[0]), np.float32)  # one value that would broadcast over the segment
    got = aggregate(rows, mode, DIM)
    assert got.weights[2] == got.weights[3] == 0.0
    np.testing.assert_array_equal(got.value, want)
    big = rows[0].astype(np.float64)
    big[5] = 1e39  # finite as float64, inf as float32
    assert aggregate([big, *rows[:2]], mode, DIM).weights[0] == 0.0
    with pytest.raises(ValueError, match="no row has 4096 finite values"):
        aggregate([rows[2], rows[3]], mode, DIM)


# each aggregate of _rows(6, seed=3), as computed on 2026-11-25 (x86-64, numpy 2.4; clip and
# cclip again on 2026-11-27: float32 norms; cclip again on 2026-11-29: its steps from the Gram
# matrix): another machine's or a changed
# arithmetic or order shows here (the honest nodes must agree bit for bit)
GOLDEN = {"mean": "3a8aebf69c365c11", "clip": "912ee2500e6982ce", "trim1": "65592d5817f9bab2",
          "cclip": "d44dc836f40d5f96"}


@pytest.mark.parametrize("mode", ("mean", *MODES))
def test_the_same_rows_give_the_same_bits_and_signed_zeros_do_not_matter(mode):
    rows = _rows(6, seed=3)
    a = aggregate(rows, mode, DIM).value
    b = aggregate([np.array(r, copy=True) for r in rows], mode, DIM).value
    assert a.dtype == np.float32 and a.tobytes() == b.tobytes()
    assert hashlib.sha256(a.tobytes()).hexdigest()[:16] == GOLDEN[mode]
    zeros = [np.zeros(DIM, np.float32) for _ in range(4)]
    zeros[1][:] = -0.0  # a sort may put -0 before or after +0: the medians are +0 either way
    for n in (3, 4):  # odd and even medians (trim1 of 2 rows falls back to the median)
        got = aggregate(zeros[:n], mode, DIM).value
        assert not np.signbit(got).any(), (mode, n)
    for n in (2, 3):  # trim2 of so few rows is their coordinate-wise median itself
        assert not np.signbit(aggregate(zeros[:n], "trim2", DIM).value).any(), n


@pytest.mark.parametrize("mode", ("mean", *MODES))
def test_a_reused_scratch_gives_the_same_bits_and_the_default_keeps_each_value(mode):
    """With a caller's scratch (the butterfly's workspace, reused across pieces and calls) the
    aggregate is the same bits; without one each value is the caller's own (the thread's
    scratch is reused, the value copied out)."""
    from intellect_jax.net.ring import Workspace

    ws, rows, other = Workspace(), _rows(6, seed=3), _rows(5, seed=4)
    first = aggregate(rows, mode, DIM).value
    second = aggregate(other, mode, DIM).value
    assert hashlib.sha256(first.tobytes()).hexdigest()[:16] == GOLDEN[mode]
    for _ in range(2):
        assert aggregate(rows, mode, DIM, scratch=ws.scratch).value.tobytes() == first.tobytes()
        assert aggregate(other, mode, DIM, scratch=ws.scratch).value.tobytes() == second.tobytes()


def _cclip_reference(rows: list[np.ndarray], factor: float = 1.0, iters: int = 3) -> tuple[np.ndarray, list[float]]:
    """CenteredClip as written, in float64: from the coordinate-wise median, ``iters`` times
    ``v += mean(min(1, tau / |x_i - v|) (x_i - v))``, ``tau`` = ``factor`` x the lower median
    distance."""
    x = np.stack(rows).astype(np.float64)
    v, w = np.median(x, axis=0), []
    for _ in range(iters):
        d = x - v
        dist = np.sqrt(np.einsum("ij,ij->i", d, d))
        tau = factor * np.sort(dist)[(len(rows) - 1) // 2]
        w = [1.0 if q <= tau else tau / q for q in dist]
        v = v + (np.array(w)[:, None] * d).mean(axis=0)
    return v, w


# over three chunks, the last short; 11 and 16 rows take a pass a step, the rest the Gram matrix
@pytest.mark.parametrize("n", (1, 2, 3, 4, 5, 8, 11, 16))
def test_cclip_is_centered_clip_from_the_median(n):
    from intellect_jax.net.robust import CHUNK

    dim = 2 * CHUNK + 123
    rows = _rows(n, dim, noise=0.5, seed=n)
    if n > 2:
        rows[0] = -(n - 1) * rows[0]  # a sign flipper
    if n > 4:
        rows[-1] = rows[-1] + 7 * norm(rows[-1]) * np.float32(1 / dim ** 0.5)  # a push along (1, ..., 1)
    want, w_want = _cclip_reference(rows)
    got = aggregate(rows, "cclip", dim)
    assert norm(got.value - want.astype(np.float32)) <= 1e-5 * norm(want.astype(np.float32))
    np.testing.assert_allclose(got.weights, w_want, rtol=1e-5, atol=1e-6)
    if n > 2:
        assert got.weights[0] < 0.5  # (so a reference that got the clipping wrong would fail above)


def test_cclip_weighs_a_row_whose_squares_overflow_only_over_chunks_as_clip_does():
    """Each chunk's squares fit float32 and their sum does not: no weight, as clip's float32
    norm gives it (a review found the per-chunk sums in float64 had let it keep 5e-18), and an
    empty segment aggregates to nothing (a plan may cut one)."""
    from intellect_jax.net.robust import CHUNK

    n = 2 * CHUNK
    rows = _rows(4, n) + [np.full(n, 5.5e16, np.float32)]  # 2e38 a chunk, 4e38 in all
    for mode in ("clip", "cclip"):
        got = aggregate(rows, mode, n)
        assert got.weights[4] == 0.0 and np.isfinite(got.value).all(), mode
    empty = aggregate([np.zeros(0, np.float32)] * 3, "cclip", 0)
    assert empty.value.shape == (0,) and empty.weights == (1.0, 1.0, 1.0)


def test_cclip_takes_the_same_steps_with_the_gram_matrix_or_a_pass_a_step(monkeypatch):
    import intellect_jax.net.robust as robust

    rows = _rows(6, 3 * 1000 + 7, noise=0.5, seed=2)
    rows[2] = -5 * rows[2]
    monkeypatch.setattr(robust, "CHUNK", 1000)
    gram = aggregate(rows, "cclip", 3007)
    monkeypatch.setattr(robust, "GRAM_ROWS", 5)
    passes = aggregate(rows, "cclip", 3007)
    assert norm(gram.value - passes.value) <= 1e-6 * norm(gram.value)
    np.testing.assert_allclose(gram.weights, passes.weights, rtol=1e-6)
    assert gram.weights[2] < 0.5


@pytest.mark.parametrize("n", range(1, 21))
def test_the_median_program_gives_the_middle_of_the_sorted_rows(n):
    """The sorting network cut down to its middle wire(s) (robust._median_program), on values
    with many ties, both zeros and infinities: the same values as a sort's middle rows."""
    from intellect_jax.net.robust import _median_program, _network

    rng = np.random.default_rng(n)
    choice = np.array([-np.inf, -2.0, -0.0, 0.0, 1.0, 1.5, 3.0, np.inf], np.float32)
    rows = [choice[rng.integers(0, 8, 4096)] for _ in range(n)]
    ops, mid, top = _median_program(n)
    slot = list(rows) + [np.empty(4096, np.float32) for _ in range(top - n)]
    for ufunc, a, b, out in ops:
        assert out >= n  # (never an input row)
        getattr(np, ufunc)(slot[a], slot[b], out=slot[out])
    s = np.sort(np.stack(rows), axis=0)
    assert len(mid) == 1 + (n % 2 == 0)
    for got, want in zip(mid, sorted({(n - 1) // 2, n // 2})):
        np.testing.assert_array_equal(slot[got], s[want])
    if n >= 4:
        assert len(ops) < 2 * len(_network(n))  # (something was cut)


# cclip over chunks: 6 rows (the Gram matrix) and 12 (a pass a step), each of 2 CHUNK + 77
# values, _rows(n, ..., seed=3), on 2026-11-29 (x86-64, numpy 2.4)
GOLDEN_CHUNKS = {6: "4541a49fb0d8eeb5", 12: "e5154961fee3adb9"}


@pytest.mark.parametrize("n", sorted(GOLDEN_CHUNKS))
def test_cclip_over_chunks_gives_the_same_bits(n):
    from intellect_jax.net.robust import CHUNK

    rows = _rows(n, 2 * CHUNK + 77, seed=3)
    rows[1] = -3 * rows[1]
    got = aggregate(rows, "cclip", 2 * CHUNK + 77).value
    assert hashlib.sha256(got.tobytes()).hexdigest()[:16] == GOLDEN_CHUNKS[n]


def test_a_clean_round_loses_little_direction():
    rows = _rows(8, noise=1.0, seed=5)
    want = aggregate(rows, "mean", DIM).value
    for mode in MODES:
        assert _cos(aggregate(rows, mode, DIM).value, want) > 0.95, mode


def test_names_and_factors_are_checked():
    for ok in ("mean", "clip", "cclip", "trim1", "trim12"):
        check_mode(ok)
    for bad in ("trim0", "trim", "median", "trim100"):
        with pytest.raises(ValueError, match="is not one of"):
            check_mode(bad)
    for factor in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor must be finite and > 0"):
            aggregate(_rows(3), "clip", DIM, factor)


def test_outsized_weighs_a_row_against_the_high_median_of_the_rows_shown() -> None:
    """The owner's measure of a steering row (net.evidence.outsized): its norm over the high
    median of the norms shown. A sign flip x3 among three honest rows is 3x; members sending
    tiny rows cannot pull the median below every honest row while a minority of the ring
    cannot fill the rows up to it, and when they could (members sitting out leave too few rows
    shown) there is no verdict: at N = 6 with three honest members sitting out, two colluders'
    tiny rows would make the one honest row shown to a sitting owner 1e9x. Fewer than three
    rows, a NaN, or a zero median give no verdict; norms are summed in float64."""
    from intellect_jax.net.evidence import outsized, row_norm

    assert outsized({1: 3.0, 2: 1.0, 3: 1.1}, 1, 4) == pytest.approx(3 / 1.1)
    assert outsized({1: 1.0, 2: 1e-9, 3: 1.2, 4: 1e-9}, 1, 5) == pytest.approx(1 / 1.0)  # two liars of five
    assert outsized({1: 1.0, 2: 1e-9, 3: 1e-9, 4: 1.1}, 1, 5) == pytest.approx(1 / 1.0)
    assert outsized({0: 1.0, 4: 1e-9, 5: 1e-9}, 0, 6) is None  # (the review's case: a1..a3 sit out)
    assert outsized({0: 1.0, 4: 1e-9, 5: 1e-9, 6: 1.1, 7: 1.2}, 0, 8) is None  # 5 shown of 8: 3 colluders fill 2
    assert outsized({1: 5.0, 2: 1.0}, 1, 3) is None and outsized({1: 5.0, 2: 0.0, 3: 0.0}, 1, 4) is None
    assert outsized({1: 5.0, 2: 1.0, 3: float("nan")}, 1, 4) is None and outsized({2: 1.0, 3: 1.0, 4: 1.0}, 1, 4) is None
    big = np.full(8, 3e38, np.float32)  # squares past float32's range: float64 holds them
    assert row_norm(big) == pytest.approx(3e38 * 8 ** 0.5, rel=1e-6)
    assert row_norm(np.array([1.0, np.inf], np.float32)) == float("inf")
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert row_norm(x) == pytest.approx(float(np.linalg.norm(x.astype(np.float64))), rel=1e-12)
