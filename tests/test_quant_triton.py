"""The GPU quantization kernel (Triton) equals the host codec bit for bit.

On a CPU test run (conftest sets TRITON_INTERPRET=1) the kernel runs in Triton's interpreter
on torch CPU tensors: its very source, only the compiler left out. On a GPU
(`JAX_PLATFORMS=cuda pytest -m gpu`) the same comparison runs compiled, through jax-triton.
"""

import os

import jax
import numpy as np
import pytest
import torch  # installed in CI: a broken install must fail, not skip
import triton

from intellect_jax.kernels import quant_triton as K
from intellect_jax.net import quant

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest: on a CPU-only test run
interpreted = pytest.mark.skipif(not INTERPRETED, reason="the kernel is compiled for a GPU in this run")


def _interpret(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[0]
    nb = quant.num_blocks(n, block)
    s, q = torch.full((nb,), -1.0), torch.full((n,), 99, dtype=torch.int8)  # garbage, to be overwritten
    K.quantize_kernel[(triton.cdiv(nb, K.ROWS),)](torch.from_numpy(x.copy()), n, s, q, BLOCK=block, ROWS=K.ROWS)
    return s.numpy(), q.numpy()


def _same(x: np.ndarray, block: int) -> None:
    s, q = _interpret(x, block)
    rs, rq = quant.quantize_int8(x, block)
    np.testing.assert_array_equal(s.view(np.uint32), rs.view(np.uint32))  # the very bits
    np.testing.assert_array_equal(q, rq)


@interpreted
@pytest.mark.parametrize("block", [16, 64, 256, 1024])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 16 * 1024 + 5])
def test_random_input_bit_identical(n, block):
    rng = np.random.default_rng(n * 7 + block)
    for scale in (1e-30, 1e-3, 1.0, 1e4, 1e30):
        _same((rng.standard_normal(n) * scale).astype(np.float32), block)


@interpreted
def test_ties_round_to_even_and_zero_blocks():
    # amax 127 makes inv exactly 1, so x * inv = x: halves are exact ties
    ties = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 4.5, -4.5, 0.0, -0.0, 5.5, 6.5],
                    np.float32)
    # just under a half: a floor(y + 0.5) rounding gets 0.5 - 2**-25 wrong (the sum rounds up to 1)
    under = np.array([127.0, 0.5 - 2**-25, -(0.5 - 2**-25), 1.5 - 2**-23, 2**-149, *[0.0] * 11], np.float32)
    zeros = np.zeros(16, np.float32)
    x = np.concatenate([ties, under, zeros, ties[:5]])
    _same(x, 16)
    s, q = _interpret(x, 16)
    assert list(q[1:8]) == [0, 2, 2, 0, -2, -2, 126] and q[16 + 1] == 0 and s[2] == 0 and not q[32:48].any()
    # every y in [-127, 127] on a fine grid, through the scale of a realistic block
    rng = np.random.default_rng(1)
    grid = np.linspace(-127, 127, 64 * 1021, dtype=np.float32) * np.float32(0.7331)
    _same(rng.permutation(grid).astype(np.float32), 64)


@interpreted
def test_non_finite_blocks_decode_non_finite_on_both_paths():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(64 * 4).astype(np.float32)
    x[3], x[64 + 10], x[128 + 5] = np.nan, np.inf, -np.inf
    s, q = _interpret(x, 64)
    rs, rq = quant.quantize_int8(x, 64)
    for scales, codes in ((s, q), (rs, rq)):
        out = quant.dequantize_int8(scales, codes, 64)
        assert not np.isfinite(out[:192]).any() and np.isfinite(out[192:]).all()
    np.testing.assert_array_equal(s[3], rs[3])
    np.testing.assert_array_equal(q[192:], rq[192:])  # the finite block is unaffected


def test_quantize_refuses_bad_block_sizes():
    with pytest.raises(ValueError, match="power-of-two block size >= 16, got 48"):
        K.quantize(np.zeros(4, np.float32), 48)


@pytest.mark.gpu
@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs a GPU")
def test_compiled_kernel_on_gpu_bit_identical():
    rng = np.random.default_rng(3)
    for n, block in ((1, 64), (100_003, 256), (2_000_000, 1024)):
        x = rng.standard_normal(n).astype(np.float32)
        s, q = K.quantize(jax.device_put(x, jax.devices("gpu")[0]), block)
        rs, rq = quant.quantize_int8(x, block)
        np.testing.assert_array_equal(np.asarray(s).view(np.uint32), rs.view(np.uint32))
        np.testing.assert_array_equal(np.asarray(q), rq)
