"""The gathered wire codecs (``top1of<G>``, ``topk<K>``, ``int1``) as XLA programs: encoding on
the devices.

:mod:`intellect_jax.net.codecs` defines the wire layouts and encodes on the host in numpy; this
module computes the same payload sections from a batch of rows (chunks) with jax.numpy, so a
GPU node's contribution leaves the device as the codec's bytes (top-1 of 4: 0.13 bytes per
value, against 4 for fp32 and 1.06 for the int8 pieces of the plain device path) and the host
only concatenates them into pieces. Per row (one chunk of ``C`` values, or a bucket's last
partial chunk):

* ``levels``: float32 ``(lo, hi)``, the mean magnitudes of the kept values below / at or above
  the midpoint of their range (NaN for a chunk holding any non-finite value);
* ``positions``: the kept values' positions (in the group for top-1, in the chunk for top-k,
  increasing), as one LSB-first bit stream of ``log2 G``, 12 or 16 bits each;
* ``codes``: ``2 * negative + high`` per kept value, 2 bits each, the same kind of stream.

``int1`` is a row per block: ``levels`` is its one float32 scale (the mean magnitude), no
positions, and ``codes`` one bit per value (``value >= 0``).

Positions and codes equal the host codec's bit for bit (maxima, comparisons against an exactly
computed midpoint), except that among top-k candidates of equal magnitude XLA's ``top_k`` keeps
the first and numpy's ``argpartition`` any (top-1 takes the first of equals on both); the levels
(and int1's scales) are float32 means where the host sums in float64, so they may
differ from the host's in the last bits; and where the device flushes subnormals to zero (XLA on
CPU) a subnormal's sign bit and a subnormal block's scale differ from the host's. That is
harmless: every rank decodes the bytes that
were sent, so the mean stays bit-identical on every rank, and the encoding node computes what
its encoding dropped from the same decoded values (:func:`decode_rows`).

A stream of every row's bits is byte-aligned per row when rows hold whole bytes of it
(:func:`aligned`): then a piece's payload is its rows' sections laid end to end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from intellect_jax.net import codecs

__all__ = ["aligned", "encode_rows", "decode_rows", "bitpack", "index_bits", "level_count"]


def level_count(mode: str) -> int:
    """float32 levels per row: int1's one scale, or (lo, hi)."""
    return 1 if mode == "int1" else 2


def index_bits(mode: str, chunk: int) -> int:
    """Bits per kept value's position: log2 G (top-1), 12 (top-k, chunks <= 4096), 16, or 0
    (int1 keeps every value)."""
    if mode == "int1":
        return 0
    g = codecs.top1_of(mode)
    if g is not None:
        return g.bit_length() - 1
    return 12 if chunk <= 4096 else 16


def kept(mode: str, n: int) -> int:
    """Values kept of a row of ``n`` (top-1: one per group, the last one zero-padded; int1: all)."""
    if mode == "int1":
        return n
    g = codecs.top1_of(mode)
    return -(-n // g) if g is not None else min(codecs.topk_of(mode) or 0, n)


def aligned(mode: str, chunk: int) -> bool:
    """Whether a full chunk's position and code streams are whole bytes (and top-k's position
    pairs whole): the condition for laying rows end to end."""
    if codecs.family(mode) not in codecs.DEVICE_ENCODED:
        return False
    if mode == "int1":
        return chunk % 8 == 0
    k = kept(mode, chunk)
    if codecs.topk_of(mode) is not None and chunk <= 4096 and k % 2:
        return False
    return (k * index_bits(mode, chunk)) % 8 == 0 and (k * 2) % 8 == 0


def bitpack(v: jax.Array, bits: int, pad_to: int = 8) -> jax.Array:
    """Rows of unsigned values (< 2**bits) -> rows of uint8: an LSB-first bit stream, zero-padded
    to a multiple of ``pad_to`` bits (the host's ``_pack``, ``_pack_bits`` and 12-bit pairs)."""
    r, n = v.shape
    b = (v[..., None].astype(jnp.uint32) >> jnp.arange(bits, dtype=jnp.uint32)) & 1
    b = b.reshape(r, n * bits)
    total = -(-(n * bits) // pad_to) * pad_to
    b = jnp.pad(b, ((0, 0), (0, total - n * bits))).reshape(r, total // 8, 8)
    return jnp.sum(b << jnp.arange(8, dtype=jnp.uint32), axis=-1).astype(jnp.uint8)


def _two_levels(v: jax.Array, bad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of kept values: (lo, hi) float32 and each value's 2-bit code (the host's
    ``_two_levels``; ``bad``: rows to poison)."""
    m = jnp.abs(v)
    k = v.shape[1]
    mid = jnp.min(m, axis=1, keepdims=True) * jnp.float32(0.5) + jnp.max(m, axis=1, keepdims=True) * jnp.float32(0.5)
    high = m >= mid
    nh = jnp.sum(high, axis=1)
    sh = jnp.sum(jnp.where(high, m, 0.0), axis=1)
    sl = jnp.sum(jnp.where(high, 0.0, m), axis=1)
    # (a float32 sum of huge values overflows where the host's float64 one does not: each mean is
    # at most the largest of its values, so it is clamped there)
    hi = jnp.where(nh > 0, jnp.minimum(sh / jnp.maximum(nh, 1).astype(jnp.float32), jnp.max(m, axis=1)), 0.0)
    lo = jnp.where(nh < k, jnp.minimum(sl / jnp.maximum(k - nh, 1).astype(jnp.float32), mid[:, 0]), hi)
    levels = jnp.where(bad[:, None], jnp.nan, jnp.stack([lo, hi], axis=1)).astype(jnp.float32)
    codes = (v < 0).astype(jnp.uint32) * 2 + high.astype(jnp.uint32)
    return levels, codes


def _select(x: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """Per row: the kept values' positions (as sent) and values."""
    r, n = x.shape
    g = codecs.top1_of(mode)
    if g is not None:
        groups = -(-n // g)
        xg = jnp.pad(x, ((0, 0), (0, groups * g - n))).reshape(r, groups, g)
        idx = jnp.argmax(jnp.abs(xg), axis=-1)  # the first of equal maxima, as numpy's
        return idx, jnp.take_along_axis(xg, idx[..., None], axis=-1)[..., 0]
    k = kept(mode, n)
    _, idx = jax.lax.top_k(jnp.abs(x), k)
    idx = jnp.sort(idx, axis=-1)
    return idx, jnp.take_along_axis(x, idx, axis=-1)


def encode_rows(x: jax.Array, mode: str, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array,
                                                             tuple[jax.Array, jax.Array]]:
    """Rows of float32 ``x`` (chunks of ``chunk`` values, or one shorter last one) -> (levels
    ``[R, 2]`` float32, positions ``[R, ·]`` uint8, codes ``[R, ·]`` uint8, (positions, codes)
    unpacked for :func:`decode_rows`); int1: (scales ``[R, 1]``, no positions, sign bits)."""
    if mode == "int1":  # (a row holding NaN or inf gets a non-finite scale, as on the host)
        a = jnp.abs(x)  # the mean of a / n rounded up may pass float32's range: at most the largest
        scale = jnp.minimum(jnp.sum(a / jnp.float32(x.shape[1]), axis=1, keepdims=True), jnp.max(a, axis=1, keepdims=True))
        signs = (x >= 0).astype(jnp.uint32)
        return scale, jnp.zeros((x.shape[0], 0), jnp.uint8), bitpack(signs, 1), (None, signs)
    idx, v = _select(x, mode)
    levels, codes = _two_levels(v, ~jnp.all(jnp.isfinite(x), axis=1))
    bits = index_bits(mode, chunk)
    pad = 24 if bits == 12 else 8  # top-k's 12-bit positions go in pairs (three bytes)
    return levels, bitpack(idx, bits, pad), bitpack(codes, 2), (idx, codes)


def decode_rows(levels: jax.Array, idx: jax.Array, codes: jax.Array, mode: str, n: int) -> jax.Array:
    """Rows of ``n`` values that :func:`encode_rows`'s output decodes to (as the host decodes
    the bytes)."""
    if mode == "int1":
        return jnp.where(codes[:, :n] == 1, levels, -levels)
    r = levels.shape[0]
    mag = jnp.take_along_axis(levels, (codes & 1).astype(jnp.int32), axis=1)
    val = jnp.where(codes & 2, -mag, mag)
    g = codecs.top1_of(mode)
    if g is not None:
        dense = jnp.where(jnp.arange(g) == idx[..., None], val[..., None], jnp.float32(0))
        return dense.reshape(r, -1)[:, :n]
    rows = jnp.arange(r)[:, None]
    return jnp.zeros((r, n), jnp.float32).at[rows, idx].set(val)
