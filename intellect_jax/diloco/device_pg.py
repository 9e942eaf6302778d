"""Pseudo-gradients made on the accelerator: outer − inner there, int8-quantized shard by shard.

The host path pulls the inner params to the host in fp32 (4 bytes per value over PCIe) and
subtracts them from the host outer params. This path keeps ``anchor``, a device copy of the
params taken when the outer params were placed (at a boundary the inner params *are* the
outer params, cast to the param dtype), and at the next boundary:

1. ``d = anchor − params`` per leaf on the devices (one jitted op, sharded like the params);
2. every shard of ``d`` this process holds (first replica only) is quantized where it lives
   by the Triton kernel (:mod:`intellect_jax.kernels.quant_triton`): only int8 codes and one
   fp32 scale per block leave the device, 1 + 4/block bytes per value;
3. :func:`assemble` decodes the pieces into the host pseudo-gradient, which then goes into the
   int8 ring like any other. The pieces of a multi-process node travel to the process that
   speaks for it in this same form.

The decoded values are exactly what the host codec would give for the same shard (the kernel
equals it bit for bit), so a node's contribution carries one int8 rounding more than on the
host path: each value moves by at most half a step of its block's scale.

:func:`pg_path` is the one place that decides, from the ``[diloco]`` settings and the node's
shape, whether a node takes this path or the host's, with which quantizer, and whether its
rounds overlap (overlapped rounds keep their anchor on the devices, so they need this path).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from intellect_jax.diloco.config import DilocoConfig
from intellect_jax.diloco.parts import DilocoError
from intellect_jax.net import quant

Quantize = Callable[[jax.Array, int], tuple[Any, Any]]  # flat float32 on one device -> (scales, codes)


Bounds = tuple[tuple[int, int], ...]  # (start, stop) per dimension of a leaf


@dataclass(frozen=True)
class Piece:
    """One shard of one leaf of the pseudo-gradient, quantized: ``index`` is its place in the leaf."""

    leaf: int
    index: Bounds
    scale: np.ndarray  # float32 [blocks]
    codes: np.ndarray  # int8 [elements]

    @property
    def nbytes(self) -> int:
        return self.scale.nbytes + self.codes.nbytes


def host_quantize(x: jax.Array, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The host codec on a device shard (CPU devices, where there is no kernel): the same bytes."""
    return quant.quantize_int8(np.asarray(x, np.float32).reshape(-1), block)


def kernel_available() -> bool:
    """A GPU is visible and jax-triton imports (the ``[gpu]`` extra)."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        return False
    try:
        import jax_triton  # noqa: F401

        from intellect_jax.kernels import quant_triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_quantize() -> Quantize:
    """The Triton kernel (imported only when asked for: the ``[gpu]`` extra)."""
    from intellect_jax.kernels.quant_triton import quantize

    return quantize


def default_quantize() -> Quantize:
    """The Triton kernel on a GPU node, the host codec elsewhere."""
    return kernel_quantize() if kernel_available() else host_quantize


@jax.jit
def _diff(a: jax.Array, p: jax.Array) -> jax.Array:
    """One leaf at a time: the device holds one leaf's difference at most."""
    return a.astype(jnp.float32) - p.astype(jnp.float32)


def shard_bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's place in its array, as (start, stop) per dimension (hashable, JSON-able)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


@jax.jit
def _merge(o: jax.Array, p: jax.Array, a: jax.Array) -> jax.Array:
    return (o.astype(jnp.float32) + (p.astype(jnp.float32) - a.astype(jnp.float32))).astype(p.dtype)


def pieces_of(diff: Any, block: int, quantize: Quantize) -> list[Piece]:
    """This process's quantized pieces of a device tree (first replica of each shard)."""
    out: list[Piece] = []
    for i, d in enumerate(jax.tree.leaves(diff)):
        for sh in d.addressable_shards:
            if sh.replica_id != 0 or sh.data.size == 0:
                continue
            scale, codes = quantize(sh.data.reshape(-1), block)
            out.append(Piece(i, shard_bounds(sh.index, d.shape), np.asarray(scale), np.asarray(codes)))
    return out


class Slots:
    """The host arrays that pieces of a tree fill (one per leaf of ``like``, ``dtype`` or the
    leaf's), checked piece by piece: the leaf exists, the bounds have its rank, no two pieces of
    a leaf overlap; :meth:`done` checks that they cover every element."""

    def __init__(self, like: Any, what: str, label: str = "leaf", dtype: Any = None) -> None:
        leaves, self.treedef = jax.tree.flatten(like)
        self.out = [np.empty(np.shape(x), dtype or x.dtype) for x in leaves]
        self.boxes: list[list[Bounds]] = [[] for _ in self.out]
        self.what, self.label = what, label  # e.g. "shard", "leaf": for the errors

    def slot(self, leaf: int, bounds: Bounds) -> np.ndarray:
        out = self.out
        if not 0 <= leaf < len(out) or len(bounds) != out[leaf].ndim:
            raise ValueError(f"{self.what} of leaf {leaf} at {bounds}: the tree has {len(out)} leaves"
                             + (f", that one of {out[leaf].ndim} dimensions" if 0 <= leaf < len(out) else ""))
        for b in self.boxes[leaf]:  # (a few pieces per leaf: one per device at most)
            if all(s < e2 and s2 < e for (s, e), (s2, e2) in zip(bounds, b)) and bounds and b:
                raise ValueError(f"{self.what} of leaf {leaf} at {bounds} overlaps the one at {b}")
        self.boxes[leaf].append(bounds)
        return out[leaf][tuple(slice(s, e) for s, e in bounds) or ...]  # a 0-d leaf: its whole view

    def done(self) -> Any:
        for i, (o, boxes) in enumerate(zip(self.out, self.boxes, strict=True)):
            n = sum(math.prod(e - s for s, e in b) for b in boxes)
            if n != o.size:
                raise ValueError(f"{self.label} {i} of shape {o.shape}: {self.what.split()[-1]}s cover {n} of "
                                 f"{o.size} elements")
        return jax.tree.unflatten(self.treedef, self.out)


def assemble(pieces: list[Piece], like: Any, block: int) -> Any:
    """The host fp32 tree (structure and shapes of ``like``) the pieces decode to; every element
    must be covered exactly once (else ValueError naming the leaf)."""
    slots = Slots(like, "pseudo-gradient piece", "pseudo-gradient leaf", np.float32)
    for p in pieces:
        view = slots.slot(p.leaf, p.index)
        if p.codes.size != view.size or p.scale.size != quant.num_blocks(view.size, block):
            raise ValueError(f"pseudo-gradient piece of leaf {p.leaf} at {p.index}: {p.codes.size} codes and "
                             f"{p.scale.size} scales for {view.size} elements")
        view[...] = quant.dequantize_int8(p.scale, p.codes, block).reshape(view.shape)
    return slots.done()


class DevicePseudoGradient:
    """The anchor and the pieces of one node process (see the module docstring)."""

    def __init__(self, block: int, quantize: Quantize | None = None) -> None:
        self.block = block
        self.quantize = quantize or default_quantize()
        self.anchor: Any = None
        self.last_bytes = 0  # what crossed from the devices at the last boundary

    def mark(self, params: Any, *, copy: bool = True) -> None:
        """Remember the params just placed (the outer params) on the devices (a copy: the
        trainer donates its params to the next step)."""
        self.anchor = jax.tree.map(jnp.copy, params) if copy else params

    def pieces(self, params: Any) -> list[Piece]:
        """This process's quantized pieces of ``anchor − params``."""
        return self.pieces_of(self.diff(params))

    def pieces_of(self, diff: Any) -> list[Piece]:
        pieces = pieces_of(diff, self.block, self.quantize)
        self.last_bytes = sum(p.nbytes for p in pieces)
        return pieces

    def diff(self, params: Any) -> Any:
        """``anchor − params`` on the devices (fp32, sharded like the params), kept for later."""
        if self.anchor is None:
            raise RuntimeError("device pseudo-gradient: no anchor (the outer params were never placed)")
        return jax.tree.map(_diff, self.anchor, params)

    def pull(self, diff: Any, like: Any) -> Any:
        """The host tree of a kept ``diff`` (quantized per shard, like :meth:`__call__`)."""
        return assemble(self.pieces_of(diff), like, self.block)

    def merged(self, outer: Any, params: Any) -> Any:
        """``outer + (params − anchor)`` on the devices (``outer`` placed like the params)."""
        return jax.tree.map(_merge, outer, params, self.anchor)

    def __call__(self, params: Any, like: Any) -> Any:
        """The host pseudo-gradient of a single-process node."""
        return self.pull(self.diff(params), like)


@dataclass(frozen=True)
class PgPath:
    """How a node makes its pseudo-gradient and runs its rounds (decided by :func:`pg_path`)."""

    device: bool  # made on the devices, int8 per shard (else fp32 params pulled to the host)
    kernel: bool  # quantized by the Triton kernel (else the host codec on each shard); device only
    overlap: bool  # overlapped rounds (diloco.overlap); device only
    encode: bool = False  # a sparse codec's contribution encoded on the devices (.device_codec); device only

    def encoder(self, mode: str, chunk: int, bucket_numel: int, piece_numel: int) -> Any:
        """The node's :class:`~.device_codec.DeviceEncoder` (None: contributions are encoded on the host)."""
        if not self.encode:
            return None
        from intellect_jax.diloco.device_codec import DeviceEncoder

        return DeviceEncoder(mode, chunk, bucket_numel, piece_numel)

    def build(self, block: int) -> DevicePseudoGradient | None:
        """The node's device pseudo-gradient (None: the host path)."""
        if not self.device:
            return None
        return DevicePseudoGradient(block, kernel_quantize() if self.kernel else host_quantize)

    def describe(self, tau: int | None) -> str:
        """One log line; ``tau``: diloco.overlap_delay."""
        made = (f"on the devices, quantized by {'the Triton kernel' if self.kernel else 'the host codec'}"
                if self.device else "on the host")
        if self.encode:
            made = "and encoded on the devices (XLA), error feedback there too"
        when = f"{tau} inner steps into the next round" if tau else "when ready"
        return f"pseudo-gradient made {made}; " + (f"overlapped rounds: each average merged {when}"
                                                    if self.overlap else "synchronous rounds")


def pg_path(d: DilocoConfig, processes: int, kernel: bool, gpu: bool | None = None) -> PgPath:
    """The pseudo-gradient path of a node of ``processes`` processes; ``kernel``: the Triton
    kernel runs here (:func:`kernel_available`); ``gpu``: the node's devices are GPUs (default:
    ``kernel``).

    A node of several processes gathers its shards' pieces at the lead: the device path, never
    overlapped (not available yet). A single-process node overlaps its rounds unless told not to
    (``diloco.overlap`` unset: with a wire format no finer than int8 and a pseudo_gradient
    other than "host"), which takes the device path; else "device" and "host" are obeyed and "auto" takes
    the device path where the kernel runs. The kernel needs power-of-two blocks.

    A top-k, top-1 or int1 contribution is encoded on the devices (``diloco.encode``; "auto": on GPU
    nodes, with or without the kernel: it is XLA) by a single-process node whose chunks hold whole bytes of
    the codec's sections (:func:`~.device_codec.supported`); this takes the device path too."""
    multi = processes > 1
    if multi and d.pseudo_gradient == "host":
        raise DilocoError("diloco.pseudo_gradient = \"host\" needs a single-process node; a node of several "
                          "processes makes it per shard (\"device\" or \"auto\")")
    if multi and d.overlap:
        raise DilocoError("diloco.overlap is not available on a node of several processes yet (leave it unset "
                          "or false)")
    lossy = d.mode not in ("fp32", "bf16")  # codes no finer than the device path's int8
    overlap = (not multi and d.pseudo_gradient != "host" and lossy) if d.overlap is None else d.overlap
    on_gpu, kernel = kernel if gpu is None else gpu, kernel and d.pow2_block
    encode = d.pseudo_gradient != "host" and (d.encode == "device" or (d.encode == "auto" and on_gpu))
    if encode:
        from intellect_jax.diloco.device_codec import supported

        why = "it needs a single-process node" if multi else supported(d.wire_mode, d.wire_block)
        if why and d.encode == "device":
            raise DilocoError(f"diloco.encode = \"device\": {why}")
        encode = not why
    device = multi or overlap or encode or d.pseudo_gradient == "device" or (d.pseudo_gradient == "auto" and kernel)
    return PgPath(device=device, kernel=device and kernel, overlap=overlap, encode=encode)
