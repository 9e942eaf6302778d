"""Wire codecs for the ring all-reduce: fp32, bf16 and blockwise int8 (numpy only), and the
entry point to the low-bit codecs of :mod:`.codecs` (int4, int2, int1, top-k, top-1 of G), which share
:func:`encode`, :func:`decode` and :func:`encoded_nbytes`.

Blockwise int8: the input is cut into blocks of ``block`` elements (the last block may be
shorter); each block stores one float32 scale ``amax / 127`` and ``round(x * 127 / amax)``
as int8 in [-127, 127]. Wire layout of an int8 piece of ``n`` elements:
``[float32 scales (ceil(n / block))][int8 codes (n)]``. Every function here is a fixed
sequence of IEEE float32 numpy ufuncs, so identical inputs give identical bytes on every
machine; numpy releases the GIL inside these loops, so codecs overlap with socket I/O.

Non-finite inputs are not rejected (that would cost a pass): a block containing NaN or
Inf decodes to NaN (int8), or keeps the NaN/Inf (fp32, bf16).
"""

from __future__ import annotations

import contextlib

import numpy as np

from intellect_jax.net import codecs

MODES = ("fp32", "bf16", "int8", "int4", "int2", "int1", "topk<K>", "top1of<G>")
_QMAX = np.float32(127.0)


def check_mode(mode: str, block: int) -> None:
    """Raise ValueError for an unknown mode or a non-positive block size."""
    if mode not in MODES[:3] and codecs.family(mode) is None:
        raise ValueError(f"unknown wire mode {mode!r}; expected one of {MODES}")
    if block < 1:
        raise ValueError(f"block size must be >= 1, got {block}")
    codecs.check(mode, block)


def num_blocks(n: int, block: int) -> int:
    """Number of int8 blocks (and float32 scales) for ``n`` elements."""
    return -(-n // block)


def encoded_nbytes(n: int, mode: str, block: int) -> int:
    """Bytes on the wire for ``n`` float32 values in ``mode``."""
    if mode == "fp32":
        return 4 * n
    if mode == "bf16":
        return 2 * n
    if mode != "int8":
        return codecs.nbytes(n, mode, block)
    return n + 4 * num_blocks(n, block)


def _int8_views(buf: np.ndarray, n: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Split an int8 wire buffer into its (scales, codes) views, no copies."""
    nb = num_blocks(n, block)
    raw = buf.view(np.uint8)
    return raw[: 4 * nb].view(np.float32), raw[4 * nb : 4 * nb + n].view(np.int8)


def quantize_int8(
    x: np.ndarray,
    block: int,
    *,
    scale_out: np.ndarray | None = None,
    q_out: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
    scratch: np.ndarray | None = None,
    divisor: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax int8 quantization of a flat float32 array.

    Codes are ``round(x * 127 / amax)`` (round-half-even; with ``rng``, stochastic
    rounding ``floor(y + u)``, ``u ~ U[0, 1)``, which is unbiased) and scales
    ``amax / (127 * divisor)``: so ``divisor = N`` encodes ``x / N`` without a pass for
    the division. ``scratch`` (float32, >= len(x)) avoids a temporary. Returns ``(scales, codes)``.
    """
    n = x.shape[0]
    nb = num_blocks(n, block)
    scale = np.empty(nb, np.float32) if scale_out is None else scale_out
    q = np.empty(n, np.int8) if q_out is None else q_out
    if n == 0:
        return scale, q
    tmp = np.empty(n, np.float32) if scratch is None else scratch[:n]
    full = (n // block) * block
    amax = np.empty(nb, np.float32)
    np.abs(x, out=tmp)
    if full:  # |x| >= 0 orders like its int32 bits, and int max reductions are faster
        np.max(tmp[:full].view(np.int32).reshape(-1, block), axis=1, out=amax[: full // block].view(np.int32))
    if full < n:
        amax[-1] = tmp[full:].max()
    inv = scales_from_amax(amax, divisor, scale)
    finite = bool(np.isfinite(amax).all())  # np.errstate costs ~10 us; only needed for Inf/NaN
    with contextlib.nullcontext() if finite else np.errstate(invalid="ignore", over="ignore"):
        _scale_rows(x, inv, tmp, block, full)
        if rng is None:
            np.rint(tmp, out=tmp)
        else:
            tmp += rng.random(n, dtype=np.float32)
            np.floor(tmp, out=tmp)
        np.copyto(q, tmp, casting="unsafe")
    return scale, q


def scales_from_amax(amax: np.ndarray, divisor: int = 1, scale_out: np.ndarray | None = None) -> np.ndarray:
    """Block scales ``amax / (127 * divisor)`` (into ``scale_out``) and the returned
    multipliers ``127 / amax`` (0 where ``amax`` is 0 or NaN). Shared with the GPU kernel."""
    scale = np.empty_like(amax) if scale_out is None else scale_out
    np.divide(amax, np.float32(127 * divisor), out=scale)
    inv = np.zeros(amax.shape[0], np.float32)
    np.divide(_QMAX, amax, out=inv, where=amax > 0)  # never divides by 0 or NaN: no warnings
    return inv


def dequantize_int8(
    scale: np.ndarray, q: np.ndarray, block: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of :func:`quantize_int8`: ``out[i] = q[i] * scale[i // block]``."""
    n = q.shape[0]
    out = np.empty(n, np.float32) if out is None else out
    full = (n // block) * block
    np.copyto(out, q)  # exact int8 -> float32, then one same-type multiply (no buffered casting)
    if full:
        o = out[:full].reshape(-1, block)
        np.multiply(o, scale[: full // block, None], out=o)
    if full < n:
        np.multiply(out[full:], scale[-1], out=out[full:])
    return out


def _scale_rows(x: np.ndarray, inv: np.ndarray, out: np.ndarray, block: int, full: int) -> None:
    """``out = x * inv[block index]`` with a broadcast over full blocks and the tail."""
    if full:
        np.multiply(x[:full].reshape(-1, block), inv[: full // block, None], out=out[:full].reshape(-1, block))
    if full < x.shape[0]:
        np.multiply(x[full:], inv[-1], out=out[full:])


def to_bf16(x: np.ndarray, out: np.ndarray | None = None, scratch: np.ndarray | None = None) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round-to-nearest-even, NaN kept NaN."""
    n = x.shape[0]
    out = np.empty(n, np.uint16) if out is None else out
    if n == 0:
        return out
    u = x.view(np.uint32)
    r = np.empty(n, np.uint32) if scratch is None else scratch[:n].view(np.uint32)
    np.right_shift(u, 16, out=r)
    np.bitwise_and(r, 1, out=r)
    r += np.uint32(0x7FFF)
    r += u  # NaN inputs may wrap; fixed below
    np.right_shift(r, 16, out=r)
    np.copyto(out, r, casting="unsafe")
    if np.isnan(x.max()):
        out[np.isnan(x)] = 0x7FC0
    return out


def from_bf16(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    out = np.empty(b.shape[0], np.float32) if out is None else out
    np.left_shift(b, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def encode(
    x: np.ndarray,
    mode: str,
    block: int,
    out: np.ndarray | None = None,
    *,
    rng: np.random.Generator | None = None,
    scratch: np.ndarray | None = None,
    divisor: int = 1,
) -> np.ndarray:
    """Encode a flat float32 array into wire bytes (uint8). fp32 returns a view of ``x``.

    ``divisor`` (int8 only) encodes ``x / divisor`` for free (folded into the scales);
    ``rng`` (stochastic rounding) applies to int8 only.
    """
    n = x.shape[0]
    if mode == "fp32":
        return x.view(np.uint8)
    out = np.empty(encoded_nbytes(n, mode, block), np.uint8) if out is None else out
    if mode not in ("bf16", "int8"):
        if divisor != 1:
            raise ValueError(f"divisor is for int8, not {mode}")
        return codecs.encode(x, mode, block, out)
    if mode == "bf16":
        to_bf16(x, out.view(np.uint16), scratch)
    else:
        scale, q = _int8_views(out, n, block)
        quantize_int8(x, block, scale_out=scale, q_out=q, rng=rng, scratch=scratch, divisor=divisor)
    return out


def decode(buf: np.ndarray, n: int, mode: str, block: int, out: np.ndarray | None = None) -> np.ndarray:
    """Decode ``n`` values from wire bytes into float32 (``out`` if given); ValueError for a
    payload of the wrong length or one its codec rejects (:mod:`.codecs`)."""
    expect = encoded_nbytes(n, mode, block)
    if buf.nbytes != expect:
        raise ValueError(f"{mode} payload for {n} values must be {expect} bytes, got {buf.nbytes}")
    out = np.empty(n, np.float32) if out is None else out
    raw = buf.view(np.uint8)
    if mode == "fp32":
        np.copyto(out, raw.view(np.float32))
    elif mode == "bf16":
        from_bf16(raw.view(np.uint16), out)
    elif mode != "int8":
        codecs.decode(raw, n, mode, block, out)
    else:
        scale, q = _int8_views(raw, n, block)
        dequantize_int8(scale, q, block, out)
    return out


def roundtrip(x: np.ndarray, mode: str, block: int) -> np.ndarray:
    """``decode(encode(x))``: the value a chunk owner adopts in the all-gather."""
    return decode(encode(x, mode, block), x.shape[0], mode, block)
