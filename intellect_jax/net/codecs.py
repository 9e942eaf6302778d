"""Low-bit wire codecs for pseudo-gradients: int4, 2-bit and 1-bit blockwise; top-k and top-1 of
every group, with 2-bit values.

Each codec is a fixed sequence of numpy operations on a flat float32 piece of ``n`` values,
with a payload whose size depends only on ``n`` and the codec's parameters (so a receiver
knows every frame's length in advance). ``block`` is the codec's parameter: values per scale
for the blockwise codecs, values per chunk (a pair of magnitude levels) for top-k and top-1.
Wire layouts, little-endian:

* ``int4`` (blockwise, ring): ``[float32 scales (ceil(n/block))][codes, two per byte]``; a code
  is ``round(x * 7 / amax)`` in [-7, 7], stored as ``code + 8`` (low nibble first).
* ``int2`` (blockwise, gathered): ``[float32 scales][codes, four per byte]``; code ``c`` in 0..3
  stands for ``(c - 1.5) * scale`` with ``scale`` the block's RMS: levels at +-0.5 and +-1.5
  RMS, next to the Lloyd-Max quantizer of a Gaussian (+-0.45, +-1.51); larger values are
  clipped and error feedback carries the rest (an absmax scale would put a block's every
  value on one outlier's grid).
* ``int1`` (blockwise, gathered): ``[float32 scales][signs, eight per byte, LSB first]``; bit
  ``1`` stands for ``+scale`` (a value >= 0), ``0`` for ``-scale``, with ``scale`` the block's
  mean magnitude: the level that minimizes the block's squared error for a sign code. Every
  value moves every round by the block's mean step; error feedback carries what its sign
  alone could not.
* ``top1of<G>`` (gathered, G a power of two up to 256): the value of largest magnitude in each
  group of G values (1/G of them), as its position in the group (log2 G bits) and the same
  2-bit code against its chunk's two levels (chunks of ``block`` values, whole groups):
  ``[float32 (lo, hi) per chunk][positions, log2 G bits each, LSB first][codes, four per byte]``.
  Structured sparsity: at 1/4 it costs 1.02 bits per value (top-k at 1/16: 0.89).
* ``topk<K>`` (gathered): the ``K`` values of largest magnitude in each chunk of ``block``
  values (``min(K, r)`` in a last chunk of ``r``), each sent as a sign and one magnitude bit:
  ``[float32 (lo, hi) per chunk][indices][codes, four per byte]``. ``lo`` and ``hi`` are the
  mean magnitudes of the chunk's kept values below and at or above the midpoint of their
  range; indices are positions within the chunk, strictly increasing, packed 12 bits each
  (two per three bytes, padded to an even count) when ``block <= 4096``, else uint16; a code
  is ``2 * negative + high``.

Decoding a peer's payload checks what decoding relies on (the length, done by the caller; a
top-k payload's indices in range and increasing; a top-1 payload's last-group position) and
raises ValueError otherwise; any other bit pattern decodes to some values (e.g. an int4 nibble 0 to -8 scales, a negative scale), which the
checks above the codec judge like any contribution. A block or chunk holding NaN or Inf decodes
to non-finite values, so those checks see it.
"""

from __future__ import annotations

import re

import numpy as np

RING = ("int4",)  # summed hop by hop in the ring like int8
GATHERED = ("int2", "int1", "topk", "top1")  # every contribution sent whole to every rank (error feedback)
DEVICE_ENCODED = ("topk", "top1", "int1")  # families a node may encode on its devices (kernels.codecs_xla)
_TOPK = re.compile(r"^topk([1-9][0-9]{0,4})$")
_TOP1 = re.compile(r"^top1of(2|4|8|16|32|64|128|256)$")
_F32 = np.float32


def topk_of(mode: str) -> int | None:
    """K of a ``topk<K>`` mode (None for any other mode)."""
    m = _TOPK.match(mode)
    return int(m.group(1)) if m else None


def top1_of(mode: str) -> int | None:
    """The group size of a ``top1of<G>`` mode (None for any other mode)."""
    m = _TOP1.match(mode)
    return int(m.group(1)) if m else None


def family(mode: str) -> str | None:
    """"int4", "int2", "int1", "topk", "top1" or None (not a codec of this module)."""
    if mode in RING or mode in _LEVELS:
        return mode
    if top1_of(mode) is not None:
        return "top1"
    return "topk" if topk_of(mode) is not None else None


def gathered(mode: str) -> bool:
    """Whether ``mode`` is exchanged by an all-gather of whole contributions."""
    return family(mode) in GATHERED


def check(mode: str, block: int) -> None:
    """ValueError for a top-k K above its chunk, a top-1 chunk that is not whole groups, or a
    chunk too large to index."""
    k = topk_of(mode)
    if k is not None and not (k <= block <= 1 << 16):
        raise ValueError(f"{mode}: {k} values per chunk of {block} (need K <= chunk <= 65536)")
    g = top1_of(mode)
    if g is not None and (block % g or block > 1 << 16):
        raise ValueError(f"{mode}: chunks of {block} values must be whole groups of {g} (and <= 65536)")


# ---- blockwise int4 / int2 / int1 -----------------------------------------------------------
_LEVELS = {"int4": (7.0, 4), "int2": (1.5, 2), "int1": (1.0, 1)}  # max |code|, bits per code


def _nblocks(n: int, block: int) -> int:
    return -(-n // block)


def _packed(n: int, bits: int) -> int:
    return -(-n * bits // 8)


def _amax(x: np.ndarray, block: int) -> np.ndarray:
    n, nb = x.shape[0], _nblocks(x.shape[0], block)
    a = np.abs(x)
    full = (n // block) * block
    out = np.empty(nb, _F32)
    if full:
        np.max(a[:full].reshape(-1, block), axis=1, out=out[: full // block])
    if full < n:
        out[-1] = a[full:].max()
    return out


def _per_value(v: np.ndarray, n: int, block: int) -> np.ndarray:
    return np.repeat(v, block)[:n]


def _pack(codes: np.ndarray, bits: int, out: np.ndarray) -> None:
    if bits == 1:  # (the same LSB-first layout, in one pass)
        out[...] = 0
        packed = np.packbits(codes, bitorder="little")
        out[: packed.shape[0]] = packed
        return
    per = 8 // bits
    c = np.zeros(out.shape[0] * per, np.uint8)
    c[: codes.shape[0]] = codes
    c = c.reshape(-1, per)
    np.copyto(out, c[:, 0])
    for i in range(1, per):
        out |= c[:, i] << np.uint8(i * bits)


def _unpack(raw: np.ndarray, n: int, bits: int) -> np.ndarray:
    if bits == 1:
        return np.unpackbits(raw, count=n, bitorder="little")
    per, mask = 8 // bits, np.uint8((1 << bits) - 1)
    c = np.empty((raw.shape[0], per), np.uint8)
    for i in range(per):
        c[:, i] = (raw >> np.uint8(i * bits)) & mask
    return c.reshape(-1)[:n]


def _rms(x: np.ndarray, block: int) -> np.ndarray:
    """Per block ``amax * sqrt(mean((x / amax)^2))``: no overflow for any finite input (a
    division, not a product with ``1 / amax``, which overflows when ``amax`` is subnormal)."""
    n, amax = x.shape[0], _amax(x, block)
    per = _per_value(amax, n, block)
    full = (n // block) * block
    with np.errstate(invalid="ignore", over="ignore"):
        sq = np.zeros(n, _F32)
        np.divide(x, per, out=sq, where=per > 0)
        np.square(sq, out=sq)
        parts = [sq[:full].reshape(-1, block).mean(axis=1, dtype=_F32)] if full else []
        if full < n:
            parts.append(sq[full:].mean(dtype=_F32, keepdims=True))
        return (amax * np.sqrt(np.concatenate(parts))).astype(_F32)


def _mean_abs(x: np.ndarray, block: int) -> np.ndarray:
    """Per block the mean magnitude, summed in float64 (finite for any finite input: it is at
    most the block's largest; NaN or inf if the block holds one)."""
    n = x.shape[0]
    a = np.abs(x)
    full = (n // block) * block
    parts = [np.add.reduce(a[:full].reshape(-1, block), axis=1, dtype=np.float64) / block] if full else []
    if full < n:
        parts.append(np.add.reduce(a[full:], dtype=np.float64, keepdims=True) / (n - full))
    return np.concatenate(parts).astype(_F32)


def _block_encode(x: np.ndarray, mode: str, block: int, out: np.ndarray) -> None:
    qmax, bits = _LEVELS[mode]
    n, nb = x.shape[0], _nblocks(x.shape[0], block)
    scales = out[: 4 * nb].view(_F32)
    if mode == "int1":  # the sign against the block's mean magnitude (a NaN's block: a NaN scale)
        scales[...] = _mean_abs(x, block)
        _pack(np.greater_equal(x, 0), 1, out[4 * nb:])
        return
    with np.errstate(invalid="ignore", over="ignore"):
        if mode == "int4":
            np.divide(_amax(x, block), _F32(qmax), out=scales)
        else:
            scales[...] = _rms(x, block)
    per = _per_value(scales, n, block)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.zeros(n, _F32)  # x / scale (a product with 1 / scale overflows for a subnormal scale)
        np.divide(x, per, out=y, where=per > 0)
        if mode == "int4":  # nearest of -7..7, stored + 8
            codes = np.clip(np.rint(y), -7, 7) + 8
        else:  # nearest of (c - 1.5), c in 0..3 (clipped); ties away from zero on both sides
            codes = np.where(y >= 0, 2 + (y >= 1), 1 - (y <= -1))
        codes = np.nan_to_num(codes).astype(np.uint8)
    _pack(codes, bits, out[4 * nb:])


def _block_decode(raw: np.ndarray, n: int, mode: str, block: int, out: np.ndarray) -> np.ndarray:
    _, bits = _LEVELS[mode]
    nb = _nblocks(n, block)
    scales = raw[: 4 * nb].view(_F32)
    codes = _unpack(raw[4 * nb:], n, bits).astype(_F32)
    if mode == "int1":  # 0, 1 -> -1, +1
        codes *= _F32(2)
        codes -= _F32(1)
    else:
        codes -= _F32(8.0 if mode == "int4" else 1.5)
    with np.errstate(over="ignore", invalid="ignore"):  # a peer's scale may be anything
        np.multiply(codes, _per_value(scales, n, block), out=out)
    return out


# ---- top-k ------------------------------------------------------------------------------------
def _chunks(n: int, block: int, k: int) -> tuple[int, int, int]:
    """(full chunks, values in the last partial chunk, values kept in it)."""
    full, r = divmod(n, block)
    return full, r, min(k, r)


def _kept(n: int, block: int, k: int) -> int:
    full, _, kr = _chunks(n, block, k)
    return full * k + kr


def _index_nbytes(count: int, block: int) -> int:
    return 3 * (-(-count // 2)) if block <= 4096 else 2 * count


def _pack12(idx: np.ndarray, out: np.ndarray) -> None:
    v = np.zeros(-(-idx.shape[0] // 2) * 2, np.uint16)
    v[: idx.shape[0]] = idx
    a, b = v[0::2], v[1::2]
    o = out.reshape(-1, 3)
    o[:, 0] = a & 0xFF
    o[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    o[:, 2] = b >> 4


def _unpack12(raw: np.ndarray, count: int) -> np.ndarray:
    o = raw.reshape(-1, 3).astype(np.int64)
    v = np.empty(o.shape[0] * 2, np.int64)
    v[0::2] = o[:, 0] | ((o[:, 1] & 0xF) << 8)
    v[1::2] = (o[:, 1] >> 4) | (o[:, 2] << 4)
    return v[:count]


def _topk_rows(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: sorted indices of its k largest magnitudes, (lo, hi) levels, 2-bit codes."""
    a = np.abs(rows)
    c = rows.shape[1]
    idx = np.argpartition(a, c - k, axis=1)[:, c - k:] if k < c else np.broadcast_to(np.arange(c), a.shape)
    idx = np.sort(idx, axis=1)
    return (idx, *_two_levels(np.take_along_axis(rows, idx, axis=1)))


def _two_levels(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of kept values: (lo, hi) mean magnitudes below / at or above the midpoint of
    the row's range (NaN for a row with a non-finite value), and each value's 2-bit code."""
    m = np.abs(v)
    k = v.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        mid = m.min(axis=1, keepdims=True) * _F32(0.5) + m.max(axis=1, keepdims=True) * _F32(0.5)
        high = m >= mid
        nh = high.sum(axis=1)
        sh = np.where(high, m, _F32(0)).sum(axis=1, dtype=np.float64)  # no overflow for finite input
        sl = np.where(high, _F32(0), m).sum(axis=1, dtype=np.float64)
        hi = np.where(nh > 0, sh / np.maximum(nh, 1), 0.0).astype(_F32)
        lo = np.where(nh < k, sl / np.maximum(k - nh, 1), hi).astype(_F32)
        bad = ~np.isfinite(m).all(axis=1)  # keep a poisoned chunk visible
    lo[bad], hi[bad] = np.nan, np.nan
    codes = (v < 0).astype(np.uint8) * 2 + high.astype(np.uint8)
    return np.stack([lo, hi], axis=1).astype(_F32), codes


def topk_nbytes(n: int, block: int, k: int) -> int:
    full, r, _ = _chunks(n, block, k)
    kept = _kept(n, block, k)
    return 8 * (full + (r > 0)) + _index_nbytes(kept, block) + _packed(kept, 2)


def _topk_encode(x: np.ndarray, block: int, k: int, out: np.ndarray) -> None:
    n = x.shape[0]
    full, r, kr = _chunks(n, block, k)
    parts = [_topk_rows(x[: full * block].reshape(full, block), k)] if full else []
    if r:
        parts.append(_topk_rows(x[full * block:].reshape(1, r), kr))
    nc, kept = full + (r > 0), _kept(n, block, k)
    idx = np.concatenate([p[0].reshape(-1) for p in parts]) if parts else np.empty(0, np.int64)
    lv = np.concatenate([p[1] for p in parts]) if parts else np.empty((0, 2), _F32)
    codes = np.concatenate([p[2].reshape(-1) for p in parts]) if parts else np.empty(0, np.uint8)
    out[: 8 * nc].view(_F32)[:] = lv.reshape(-1)
    o = 8 * nc
    ib = _index_nbytes(kept, block)
    if block <= 4096:
        _pack12(idx, out[o: o + ib])
    else:
        out[o: o + ib].view(np.uint16)[:] = idx
    _pack(codes, 2, out[o + ib:])


def _topk_parts(raw: np.ndarray, n: int, block: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions in the piece, values) of a top-k payload, checked."""
    full, r, kr = _chunks(n, block, k)
    nc, kept = full + (r > 0), _kept(n, block, k)
    lv = raw[: 8 * nc].view(_F32).reshape(nc, 2)
    o, ib = 8 * nc, _index_nbytes(kept, block)
    idx = _unpack12(raw[o: o + ib], kept) if block <= 4096 else raw[o: o + ib].view(np.uint16).astype(np.int64)
    codes = _unpack(raw[o + ib:], kept, 2)
    if kept:
        if idx.max() >= block or (r and full * k < kept and idx[full * k:].max() >= r):
            raise ValueError(f"topk payload: an index beyond its chunk (chunks of {block} values, {n} in all)")
        rows = [idx[: full * k].reshape(full, k)] + ([idx[full * k:].reshape(1, kr)] if r else [])
        if any(x.shape[1] > 1 and (np.diff(x, axis=1) <= 0).any() for x in rows):
            raise ValueError("topk payload: a chunk's indices are not strictly increasing")
    chunk_of = np.concatenate([np.repeat(np.arange(full), k), np.full(kr if r else 0, full)]).astype(np.int64)
    pos = chunk_of * block + idx
    mag = lv[chunk_of, (codes & 1).astype(np.int64)]
    val = np.where(codes & 2, -mag, mag).astype(_F32)
    return pos, val


# ---- top-1 of every group ---------------------------------------------------------------------
def _pack_bits(v: np.ndarray, bits: int) -> np.ndarray:
    return np.packbits(((v[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1), bitorder="little")


def _unpack_bits(raw: np.ndarray, count: int, bits: int) -> np.ndarray:
    b = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits).astype(np.int64)
    return b @ (1 << np.arange(bits, dtype=np.int64))


def _top1_shape(n: int, block: int, g: int) -> tuple[int, int, int, int]:
    """(groups, groups per chunk, full chunks, chunks) of a top1of<g> piece of n values."""
    return -(-n // g), block // g, n // block, -(-n // block)


def top1_nbytes(n: int, block: int, g: int) -> int:
    groups, _, _, nc = _top1_shape(n, block, g)
    bits = g.bit_length() - 1
    return 8 * nc + _packed(groups, bits) + _packed(groups, 2)


def _top1_encode(x: np.ndarray, block: int, g: int, out: np.ndarray) -> None:
    n = x.shape[0]
    groups, per, full, nc = _top1_shape(n, block, g)
    xg = np.zeros(groups * g, _F32)
    xg[:n] = x
    xg = xg.reshape(groups, g)
    idx = np.argmax(np.abs(xg), axis=1)  # first of equals; NaN wins (and poisons its chunk)
    v = xg[np.arange(groups), idx]
    rows = [v[: full * per].reshape(full, per)] if full else []
    if nc > full:
        rows.append(v[full * per:].reshape(1, -1))
    parts = [_two_levels(r) for r in rows]
    out[: 8 * nc].view(_F32)[:] = np.concatenate([lv for lv, _ in parts]).reshape(-1)
    bits = g.bit_length() - 1
    ib = _packed(groups, bits)
    if 8 % bits == 0:  # 1, 2, 4, 8 bits: the codes' byte packing, the same layout
        _pack(idx.astype(np.uint8), bits, out[8 * nc: 8 * nc + ib])
    else:
        out[8 * nc: 8 * nc + ib] = _pack_bits(idx, bits)
    _pack(np.concatenate([c.reshape(-1) for _, c in parts]), 2, out[8 * nc + ib:])


def _top1_parts(raw: np.ndarray, n: int, block: int, g: int) -> tuple[np.ndarray, np.ndarray]:
    groups, per, full, nc = _top1_shape(n, block, g)
    bits = g.bit_length() - 1
    lv = raw[: 8 * nc].view(_F32).reshape(nc, 2)
    ib = _packed(groups, bits)
    pos_raw = raw[8 * nc: 8 * nc + ib]
    idx = (_unpack(pos_raw, groups, bits).astype(np.int64) if 8 % bits == 0 else
           _unpack_bits(pos_raw, groups, bits))
    codes = _unpack(raw[8 * nc + ib:], groups, 2)
    if groups and idx[-1] >= n - (groups - 1) * g:
        raise ValueError(f"top1of{g} payload: an index beyond the last group ({n} values)")
    pos = np.arange(groups, dtype=np.int64) * g + idx
    mag = lv[np.arange(groups) // per, (codes & 1).astype(np.int64)]
    return pos, np.where(codes & 2, -mag, mag).astype(_F32)


# ---- dispatch (quant.encode / decode call these) ---------------------------------------------
def _known(mode: str) -> None:
    if family(mode) is None:
        raise ValueError(f"unknown wire mode {mode!r}")


def nbytes(n: int, mode: str, block: int) -> int:
    _known(mode)
    k, g = topk_of(mode), top1_of(mode)
    if k is not None:
        return topk_nbytes(n, block, k)
    if g is not None:
        return top1_nbytes(n, block, g)
    _, bits = _LEVELS[mode]
    return 4 * _nblocks(n, block) + _packed(n, bits)


def encode(x: np.ndarray, mode: str, block: int, out: np.ndarray) -> np.ndarray:
    """Encode flat float32 ``x`` into ``out`` (uint8, exactly :func:`nbytes` long)."""
    _known(mode)
    k, g = topk_of(mode), top1_of(mode)
    if x.shape[0]:
        if k is not None:
            _topk_encode(x, block, k, out)
        elif g is not None:
            _top1_encode(x, block, g, out)
        else:
            _block_encode(x, mode, block, out)
    return out


def decode(raw: np.ndarray, n: int, mode: str, block: int, out: np.ndarray) -> np.ndarray:
    """Decode ``n`` values (length already checked) into ``out``."""
    _known(mode)
    if family(mode) not in ("topk", "top1"):
        return _block_decode(raw, n, mode, block, out)
    out[...] = 0
    pos, val = _sparse_parts(raw, n, mode, block)
    out[pos] = val
    return out


def _sparse_parts(raw: np.ndarray, n: int, mode: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    check(mode, block)
    k = topk_of(mode)
    return _topk_parts(raw, n, block, k) if k is not None else _top1_parts(raw, n, block, top1_of(mode) or 0)


def decode_add(raw: np.ndarray, n: int, mode: str, block: int, acc: np.ndarray, scratch: np.ndarray) -> None:
    """``acc += decode(raw)`` (top-k, top-1: only at their positions; ``scratch``: n float32 for
    the blockwise codecs)."""
    _known(mode)
    if family(mode) not in ("topk", "top1"):
        np.add(acc, _block_decode(raw, n, mode, block, scratch[:n]), out=acc)
        return
    pos, val = _sparse_parts(raw, n, mode, block)
    acc[pos] += val  # positions are distinct within one payload
