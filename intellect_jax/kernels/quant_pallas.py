"""Blockwise int8 quantization on the accelerator (Pallas), matching ``net.quant`` bit for bit.

Quantizing on the device before the host copy moves 1 + 4/block bytes per value over
PCIe instead of 4. The result is the exact wire format of
:func:`intellect_jax.net.quant.encode` (``mode="int8"``): same scales, same codes.

Three steps:

1. Pallas kernel: per-block ``amax = max(|x|)`` (exact); only ``amax`` goes to the host.
2. numpy (:func:`~intellect_jax.net.quant.scales_from_amax`, the very code of the CPU path):
   ``scale = amax / 127`` and ``inv = 127 / amax``, so scales are bit-identical (compilers
   turn ``/ 127`` into ``* (1/127)`` and Triton's f32 division is approximate).
3. Pallas kernel: ``codes = round_half_even(x * inv)`` built from ``floor`` (Pallas/Triton
   has no round lowering), cast to int8.

Codes equal the numpy codes except, possibly, by one where ``x * inv`` lies within an ulp
of a rounding tie (a compiler may fuse the multiply into the rounding add). That never
breaks the ring's bit-identity, which only needs everybody to decode the same bytes.
On a CPU backend :func:`quantize_int8_device` falls back to numpy; ``interpret=True``
runs the Pallas kernels in the interpreter (used by the CPU tests).
"""

from __future__ import annotations

import functools

import numpy as np

from intellect_jax.net import quant

ROWS = 64  # blocks per kernel tile


def gpu_available() -> bool:
    """True if jax sees a GPU (the Pallas Triton path can run)."""
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:  # noqa: BLE001 - no backend at all counts as no GPU
        return False


def _amax_kernel(x_ref, amax_ref):  # noqa: ANN001 - Pallas refs
    import jax.numpy as jnp

    amax_ref[...] = jnp.max(jnp.abs(x_ref[...]), axis=1, keepdims=True)


def _codes_kernel(x_ref, inv_ref, q_ref):  # noqa: ANN001 - Pallas refs
    import jax.numpy as jnp

    y = x_ref[...] * inv_ref[...]
    r = jnp.floor(y + jnp.float32(0.5))  # exact for |y| <= 127.5; ties go up ...
    odd = r - jnp.float32(2.0) * jnp.floor(r * jnp.float32(0.5))
    r = jnp.where((r - y == jnp.float32(0.5)) & (odd == jnp.float32(1.0)), r - jnp.float32(1.0), r)  # ... to even
    q_ref[...] = r.astype(jnp.int8)


@functools.lru_cache(maxsize=32)
def _build(nbp: int, block: int, interpret: bool):  # noqa: ANN202 - returns two jitted kernels
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    grid = (nbp // ROWS,)
    tile = pl.BlockSpec((ROWS, block), lambda i: (i, 0))
    col = pl.BlockSpec((ROWS, 1), lambda i: (i, 0))
    amax_call = pl.pallas_call(_amax_kernel, grid=grid, in_specs=[tile], out_specs=col,
                               out_shape=jax.ShapeDtypeStruct((nbp, 1), jnp.float32), interpret=interpret)
    codes_call = pl.pallas_call(_codes_kernel, grid=grid, in_specs=[tile, col], out_specs=tile,
                                out_shape=jax.ShapeDtypeStruct((nbp, block), jnp.int8), interpret=interpret)
    return jax.jit(amax_call), jax.jit(codes_call)


def quantize_int8_pallas(x, block: int, *, interpret: bool = False) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """Pallas quantization of a flat float32 array (jax or numpy); returns host ``(scales, codes)``."""
    import jax.numpy as jnp

    if block & (block - 1):
        raise ValueError(f"the Pallas kernel needs a power-of-two block size, got {block}")
    x = jnp.asarray(x, jnp.float32).reshape(-1)
    n = x.shape[0]
    nb = quant.num_blocks(n, block)
    if n == 0:
        return np.empty(0, np.float32), np.empty(0, np.int8)
    nbp = -(-nb // ROWS) * ROWS
    x2 = jnp.pad(x, (0, nbp * block - n)).reshape(nbp, block)  # zero padding leaves amax unchanged
    amax_call, codes_call = _build(nbp, block, interpret)
    amax = np.asarray(amax_call(x2))[:, 0]
    scale = np.empty(nbp, np.float32)
    inv = quant.scales_from_amax(amax, 1, scale)
    codes = codes_call(x2, jnp.asarray(inv[:, None]))
    return scale[:nb], np.asarray(codes).reshape(-1)[:n]


def quantize_int8_device(x, block: int, *, interpret: bool | None = None) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """Quantize on the GPU when there is one (only codes and scales cross to the host);
    otherwise the numpy implementation. ``interpret=True`` forces the Pallas interpreter."""
    if interpret or (interpret is None and gpu_available() and not block & (block - 1)):
        return quantize_int8_pallas(x, block, interpret=bool(interpret))
    return quant.quantize_int8(np.asarray(x, np.float32).reshape(-1), block)


def encode_int8_device(x, block: int, *, interpret: bool | None = None) -> np.ndarray:  # noqa: ANN001
    """Wire bytes identical to ``net.quant.encode(x, "int8", block)``."""
    scale, codes = quantize_int8_device(x, block, interpret=interpret)
    return np.concatenate([scale.view(np.uint8), codes.view(np.uint8)])
