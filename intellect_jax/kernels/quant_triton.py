"""Blockwise int8 quantization on the GPU: one Triton kernel, called from JAX through jax-triton.

The output is the host codec's (:func:`intellect_jax.net.quant.quantize_int8`) bit for bit for
finite input: scales ``amax / 127`` and codes ``round_half_even(x * (127 / amax))`` (0 for an
all-zero block). So a pseudo-gradient leaves the GPU as int8 codes + one float32 scale per
block (1 + 4/block bytes per value instead of 4) and the host decodes exactly what it would
have encoded itself. How each step stays exact:

* ``amax`` is a max of absolute values: exact in any order.
* the scale and its inverse use ``div_rn`` (IEEE round-to-nearest division), as numpy does;
  Triton's plain ``/`` is an approximate division on NVIDIA GPUs.
* ``y = x * inv`` is rounded once, as numpy's multiply: the kernel is compiled with
  ``enable_fp_fusion=False``, so ``y + c`` is never contracted into an FMA.
* round-half-even without a library call (the interpreter has none): for ``|y| < 2**22``,
  ``y + 1.5 * 2**23`` lands in ``[2**23, 2**24)`` where the float32 spacing is 1, so the
  addition itself rounds ``y`` to the nearest integer, ties to even; the integer is read from
  the sum's low mantissa bits (``bits - 0x4B400000``), no subtraction left to simplify away.
  ``|y| <= 127`` always holds here.
* A block holding a NaN or an Inf gets a NaN scale and zero codes (the host codec gives it a
  non-finite scale too): either way the block decodes to non-finite values, which the DiLoCo
  guard rejects before anything is sent.

``import triton`` needs the ``triton`` package (the ``[gpu]`` extra's jax-triton brings it;
the ``[test]`` extra installs it to run this kernel in Triton's CPU interpreter on torch CPU
tensors: ``TRITON_INTERPRET=1``, which the tests set). :func:`quantize` needs jax-triton and a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

ROWS = 16  # blocks per program
# constexpr globals: a compiled (not interpreted) kernel may read no other kind of global
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
_MAGIC_BITS = tl.constexpr(0x4B400000)  # its float32 bit pattern


def _quantize(x_ptr, n, scale_ptr, q_ptr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """x [n] float32 -> scale [ceil(n / BLOCK)] float32, q [n] int8; program i: blocks i*ROWS..."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)  # zero padding never raises a block's max
    a = tl.abs(x)
    bad = tl.max(((x != x) | (a == float("inf"))).to(tl.int32), axis=1) > 0  # noqa: PLR0124 - NaN test
    amax = tl.max(a, axis=1)
    scale = tl.where(bad, float("nan"), tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)))
    ok = (amax > 0) & (~bad)
    inv = tl.where(ok, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.where(ok, amax, 1.0)), 0.0)
    y = x * inv[:, None]
    code = (y + _MAGIC).to(tl.int32, bitcast=True) - _MAGIC_BITS
    code = tl.where(bad[:, None], 0, code)
    tl.store(q_ptr + offs, code.to(tl.int8), mask=inside)
    nb = (n + BLOCK - 1) // BLOCK
    tl.store(scale_ptr + rows, scale, mask=rows < nb)


quantize_kernel = triton.jit(_quantize)  # interpreted when TRITON_INTERPRET=1 is set before import


def compile_for(capability: int = 90, block: int = 64, fp_fusion: bool = False) -> Any:
    """The kernel compiled ahead of time by Triton's own compiler for an NVIDIA GPU of compute
    capability ``capability`` (90: Hopper, which Triton targets as sm_90a): Triton's front end
    and passes, PTX, then ptxas (shipped in Triton's wheel) to a cubin. No GPU is needed, and
    it compiles the source whatever ``TRITON_INTERPRET`` says. ``fp_fusion``: as the kernel is
    never run (True lets ptxas contract ``x * inv + c`` into an FMA, which breaks exactness). Returns Triton's compiled kernel:
    ``.asm`` holds ``ptx`` and ``cubin``, ``.metadata`` its name, warps and shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    sig = {"x_ptr": "*fp32", "n": "i32", "scale_ptr": "*fp32", "q_ptr": "*i8", "BLOCK": "constexpr", "ROWS": "constexpr"}
    src = ASTSource(fn=JITFunction(_quantize), signature=sig, constexprs={"BLOCK": block, "ROWS": ROWS})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"enable_fp_fusion": fp_fusion})


def compiled_report(capability: int = 90, block: int = 64, fp_fusion: bool = False) -> dict[str, Any]:
    """What :func:`compile_for` made, and the PTX facts the kernel's exactness rests on: IEEE
    divisions (``div.rn.f32``) and no fused multiply-add (``fma``) anywhere."""
    k = compile_for(capability, block, fp_fusion)
    ptx = k.asm["ptx"]
    target = next(line.split()[1] for line in ptx.splitlines() if line.startswith(".target"))
    return {"target": target, "cubin_bytes": len(k.asm["cubin"]), "num_warps": k.metadata.num_warps,
            "shared_bytes": k.metadata.shared, "ieee_divisions": ptx.count("div.rn.f32"),
            "fused_multiply_adds": ptx.count("fma.")}


def report_in_subprocess(capability: int, block: int = 64, fp_fusion: bool = False,
                         timeout: float = 300) -> dict[str, Any]:
    """:func:`compiled_report` in a fresh interpreter: Triton's CPU interpreter, once switched on
    in a process (``TRITON_INTERPRET=1``, as the tests do), cannot compile there."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", __name__, str(capability), str(block), str(int(fp_fusion))], env=env, capture_output=True,
                       text=True, timeout=timeout, check=False)
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"compiling the quantize kernel for compute capability {capability} failed: {last}")
    lines = p.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"compiling the quantize kernel for compute capability {capability} printed nothing")
    return json.loads(lines[-1])


@functools.lru_cache(maxsize=64)
def _call(n: int, block: int):
    import jax
    import jax.numpy as jnp
    import jax_triton as jt

    nb = -(-n // block)

    @jax.jit
    def run(x):
        return jt.triton_call(
            x, n, kernel=quantize_kernel,
            out_shape=(jax.ShapeDtypeStruct((nb,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int8)),
            grid=(triton.cdiv(nb, ROWS),), BLOCK=block, ROWS=ROWS, enable_fp_fusion=False)

    return run


def quantize(x, block: int):
    """(scales [nb] float32, codes [n] int8) of a flat float32 array on ONE GPU, left on it."""
    if block & (block - 1) or block < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two block size >= 16, got {block}")
    return _call(int(x.shape[0]), block)(x)


if __name__ == "__main__":  # python -m intellect_jax.kernels.quant_triton [capability] [block]: one JSON line
    import json
    import sys

    cc, blk, fusion = (int(a) for a in (sys.argv[1:4] + ["90", "64", "0"][len(sys.argv) - 1:]))
    print(json.dumps(compiled_report(cc, blk, bool(fusion))))
