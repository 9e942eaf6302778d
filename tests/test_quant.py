"""Wire codecs: blockwise int8, bf16, fp32 (numpy), and the ring mean's error.

The GPU kernel's equality with the host codec is tested in tests/test_quant_triton.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intellect_jax.net import quant
from intellect_jax.net.plan import simulate


def _data(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if n >= 100:
        x[rng.integers(0, n, max(1, n // 1000))] *= 30  # outliers
    return x


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_int8_roundtrip_error_bounded_per_block(n: int, block: int) -> None:
    x = _data(n)
    wire = quant.encode(x, "int8", block)
    assert wire.nbytes == quant.encoded_nbytes(n, "int8", block) == n + 4 * quant.num_blocks(n, block)
    y = quant.decode(wire, n, "int8", block)
    for b in range(quant.num_blocks(n, block)):
        blk = slice(b * block, (b + 1) * block)
        step = np.abs(x[blk]).max() / 127
        assert np.all(np.abs(y[blk] - x[blk]) <= step * 0.5000001 + 1e-30)


def test_int8_codes_are_symmetric_and_exact_at_extremes() -> None:
    x = np.array([3.0, -3.0, 1.5, 0.0, 2.0 * 127 / 127], np.float32)
    scale, q = quant.quantize_int8(x, 8)
    assert scale[0] == np.float32(3.0) / np.float32(127)
    assert q.tolist()[:4] == [127, -127, 64, 0]  # 63.5 rounds half to even -> 64
    assert q.min() >= -127


def test_all_zero_block_and_nan_block() -> None:
    x = np.zeros(16, np.float32)
    x[8:] = [1, 2, np.nan, 4, 5, 6, 7, 8]
    y = quant.decode(quant.encode(x, "int8", 8), 16, "int8", 8)
    assert np.all(y[:8] == 0)
    assert np.all(np.isnan(y[8:]))  # a non-finite value poisons its own block only


def test_divisor_encodes_the_quotient() -> None:
    x = _data(1000)
    a = quant.decode(quant.encode(x, "int8", 64, divisor=4), 1000, "int8", 64)
    b = quant.decode(quant.encode(x / np.float32(4), "int8", 64), 1000, "int8", 64)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_stochastic_rounding_is_unbiased() -> None:
    x = np.full(64 * 2000, 0.3, np.float32)
    x[::64] = 1.0  # amax 1 -> y = 38.1 per element
    rng = np.random.default_rng(0)
    y = quant.decode(quant.encode(x, "int8", 64, rng=rng), x.size, "int8", 64)
    mask = x != 1.0
    assert abs(y[mask].mean() - 0.3) < 2e-4
    assert set(np.unique(np.round(y[mask] * 127))) == {38.0, 39.0}


def _bf16_ref(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bfloat16 via float64 arithmetic (independent reference)."""
    out = []
    for v in x.astype(np.float64):
        if not np.isfinite(v):
            out.append(v)
            continue
        bits = np.array([v], np.float32).view(np.uint32)[0]
        lo, hi = bits & ~np.uint32(0xFFFF), (bits & ~np.uint32(0xFFFF)) + np.uint32(0x10000)
        a, b = (np.array([lo, hi], np.uint32).view(np.float32).astype(np.float64))
        b_dist = b if np.isfinite(b) else np.copysign(2.0**128, v)  # overflow rounds to inf
        if abs(v - a) < abs(b_dist - v) or (abs(v - a) == abs(b_dist - v) and not (lo >> 16) & 1):
            out.append(a)
        else:
            out.append(b)
    return np.array(out, np.float32)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_bf16_matches_reference_rounding(values: list[float]) -> None:
    x = np.array(values, np.float32)
    y = quant.decode(quant.encode(x, "bf16", 64), x.size, "bf16", 64)
    ref = _bf16_ref(x)
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    assert np.array_equal(y[~np.isnan(y)], ref[~np.isnan(ref)])


def test_fp32_is_a_zero_copy_view() -> None:
    x = _data(100)
    wire = quant.encode(x, "fp32", 64)
    assert np.shares_memory(wire, x)
    assert np.array_equal(quant.decode(wire, 100, "fp32", 64), x)


def test_decode_rejects_wrong_size() -> None:
    with pytest.raises(ValueError, match="bytes"):
        quant.decode(np.zeros(10, np.uint8), 10, "int8", 64)
    with pytest.raises(ValueError, match="unknown wire mode"):
        quant.check_mode("int3", 64)


def _pseudo_grads(world: int, n: int, seed: int = 0) -> list[np.ndarray]:
    """DiLoCo-like pseudo-gradients: a shared direction plus per-node noise, per-tensor
    (1024-element row) scales spanning ~2 orders of magnitude, and 20x outlier spikes."""
    rng = np.random.default_rng(seed)
    rows = np.repeat(np.exp(rng.normal(0.0, 1.0, n // 1024 + 1)), 1024)[:n]
    shared = rng.standard_normal(n)
    out = []
    for _ in range(world):
        x = (np.sqrt(0.5) * shared + np.sqrt(0.5) * rng.standard_normal(n)) * rows
        x[rng.integers(0, n, n // 10_000)] *= 20
        out.append(x.astype(np.float32))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_int8_ring_mean_within_one_percent(world: int) -> None:
    xs = _pseudo_grads(world, 1 << 20)
    ref = np.mean(np.stack(xs).astype(np.float64), axis=0)
    got = simulate(xs, "int8", 64, 1 << 16)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 0.01, f"relative L2 error {err:.4%}"


def test_fp32_ring_is_exact_up_to_summation_order() -> None:
    xs = _pseudo_grads(3, 10_000)
    got = simulate(xs, "fp32", 64, 1000)
    ref = np.mean(np.stack(xs).astype(np.float64), axis=0)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
