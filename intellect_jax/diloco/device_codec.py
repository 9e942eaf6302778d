"""A node's contribution encoded on its devices, error feedback included (top-k, top-1, int1).

On the plain device path (:mod:`.device_pg`) a pseudo-gradient leaves the devices as int8
pieces and the host adds the error-feedback residual and encodes the result with the wire
codec: 1.06 bytes per value over PCIe, a host encoding pass (numpy: 0.13 s per 25M values for
top-1 of 4, about 53 s per outer step at 10B), and one int8 rounding that error feedback never
sees. With ``diloco.encode = "device"`` (the default on GPU nodes) a ``topk<K>``,
``top1of<G>`` or ``int1`` contribution is made where the pseudo-gradient lives:

1. per bucket of the ring (``net.tree.make_buckets``, the same leaves in the same order), one
   jitted program takes the leaves of ``d = anchor - params`` and of the residual ``e`` (kept on
   the devices, sharded like the params) and computes ``c = d + feedback * e`` (zeros for a
   node that sits the round out), the codec's sections of every chunk
   (:mod:`intellect_jax.kernels.codecs_xla`), what they decode to, and the next residual
   ``c - decode(encode(c))``, placed like the params;
2. only the sections leave the devices (top-1 of 4: 0.13 bytes per value); the host lays them
   end to end into the ring's pieces (:class:`~intellect_jax.net.gather.Encoded`), which the
   all-gather sends as they are.

The wire bytes are the host codec's layout (positions and codes bit for bit, the two float32
levels per chunk to the last bits), so nodes encoding on the host and on the devices share a
ring. Needs a chunk whose sections are whole bytes (``codecs_xla.aligned``: e.g. chunks of
4096, top-1 of G <= 256, top-k with K a multiple of 4, int1 blocks of a multiple of 8) and a
single-process node.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from intellect_jax.kernels import codecs_xla
from intellect_jax.net import codecs, quant, tree as treelib
from intellect_jax.net.gather import Encoded, gather_plan, shapes

__all__ = ["DeviceEncoder", "DeviceContribution", "supported"]


def supported(mode: str, chunk: int) -> str | None:
    """Why ``mode`` cannot be encoded on the devices (None: it can)."""
    if codecs.family(mode) not in codecs.DEVICE_ENCODED:
        return f"{mode} is encoded on the host (the devices encode topk<K>, top1of<G> and int1)"
    if not codecs_xla.aligned(mode, chunk):
        return f"{mode} in chunks of {chunk}: a chunk's positions or codes are not whole bytes"
    return None


def _spread(placed: tuple[Any, ...]) -> tuple[Any, Any]:
    """(a flat vector's, rows') sharding over every device of the leaves' mesh, or (None, None)
    off a mesh. Flattening a leaf sharded on another than its first axis would otherwise gather
    the whole leaf on every device; constrained, XLA moves it with all-to-alls."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    first = placed[0] if placed else None
    if not isinstance(first, NamedSharding) or first.mesh.size == 1:
        return None, None
    axes = tuple(first.mesh.axis_names)
    return NamedSharding(first.mesh, P(axes)), NamedSharding(first.mesh, P(axes, None))


def _on(x: jax.Array, where: Any) -> jax.Array:
    return x if where is None else jax.lax.with_sharding_constraint(x, where)


@functools.partial(jax.jit, static_argnames=("mode", "chunk", "placed"))
def _encode_bucket(d: list[jax.Array], e: list[jax.Array] | None, beta: jax.Array, mute: jax.Array, *,
                   mode: str, chunk: int, placed: tuple[Any, ...]) -> tuple[Any, ...]:
    """One bucket: (sections of its full chunks, of its last partial chunk, the next residual
    per leaf, placed as ``placed`` says: the leaves' shardings; whether that is finite)."""
    flat_on, rows_on = _spread(placed)
    flat = [_on(x.reshape(-1).astype(jnp.float32), flat_on) for x in d]
    if e is not None:
        flat = [x + beta * _on(r.reshape(-1).astype(jnp.float32), flat_on) for x, r in zip(flat, e, strict=True)]
    c = _on(jnp.concatenate(flat) if len(flat) > 1 else flat[0], flat_on)
    c = jnp.where(mute, jnp.float32(0), c)
    n = c.shape[0]
    full, rem = divmod(n, chunk)
    secs, dec = [], []
    for rows in ([_on(c[: full * chunk].reshape(full, chunk), rows_on)] if full else []) + \
            ([c[full * chunk:].reshape(1, rem)] if rem else []):
        lv, pos, codes, (idx, raw) = codecs_xla.encode_rows(rows, mode, chunk)
        secs.append((lv, pos, codes))
        dec.append(codecs_xla.decode_rows(lv, idx, raw, mode, rows.shape[1]).reshape(-1))
    resid = _on(c - (jnp.concatenate(dec) if len(dec) > 1 else dec[0]), flat_on)
    out, off = [], 0
    for x, where in zip(d, placed, strict=True):
        out.append(jax.lax.with_sharding_constraint(resid[off: off + x.size].reshape(x.shape), where))
        off += x.size
    return tuple(secs), out, jnp.all(jnp.isfinite(resid))


@jax.jit
def _sumsq(d: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Σ d² (float32) and whether every value is finite."""
    return (sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in d),
            jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in d])))


class DeviceEncoder:
    """Encodes a device tree for one ring's settings (mode, chunk, bucket and piece sizes)."""

    def __init__(self, mode: str, chunk: int, bucket_numel: int, piece_numel: int) -> None:
        why = supported(mode, chunk)
        if why:
            raise ValueError(why)
        self.mode, self.chunk, self.bucket_numel, self.piece_numel = mode, chunk, bucket_numel, piece_numel
        self.last_bytes = 0  # what crossed from the devices at the last encoding

    def norm(self, d: Any) -> float:
        """The L2 norm of ``d`` (inf if any value is not finite), for the node's own check."""
        return DeviceContribution(d, self).norm()

    def encode(self, d: Any, residual: Any, beta: float, mute: bool, like: Any = None) -> tuple[Encoded, Any, bool]:
        """(the contribution ``d + beta * residual`` encoded, or zeros if ``mute``; the next
        residual on the devices, sharded like ``d``; whether it is finite). ``residual``: None
        (zeros), host arrays (a restored checkpoint: placed like ``d``) or device arrays.
        ``like``: the tree the ring reduces (the outer params: its structure signs the
        all-reduce, as a host node's tree does; default ``d``'s)."""
        return self.dispatch(d, residual, beta, mute, like)()

    def dispatch(self, d: Any, residual: Any, beta: float, mute: bool, like: Any = None) -> Callable[[], Any]:
        """:meth:`encode`'s device programs, launched now; the returned function waits for them
        and pulls the sections (only transfers: no device program of its own)."""
        leaves, treedef = jax.tree.flatten(d)
        like = d if like is None else like
        if [np.shape(x) for x in jax.tree.leaves(like)] != [x.shape for x in leaves]:
            raise ValueError("the pseudo-gradient on the devices does not match the outer params' shapes")
        res = None
        if residual is not None:
            res = jax.tree.leaves(residual)
            if len(res) != len(leaves) or any(np.shape(r) != x.shape for r, x in zip(res, leaves)):
                raise ValueError("the error-feedback residual does not match the pseudo-gradient's shapes")
            res = [r if isinstance(r, jax.Array) and r.sharding.is_equivalent_to(x.sharding, x.ndim) else
                   jax.device_put(r, x.sharding)
                   for r, x in zip(res, leaves)]
        beta_, mute_ = jnp.float32(beta), jnp.bool_(mute)
        runs, nxt = [], []
        for idx in treelib.make_buckets([x.size for x in leaves], self.bucket_numel):
            n = sum(leaves[i].size for i in idx)
            if n == 0:  # nothing to send (the ring skips an empty bucket too)
                runs.append(((), None, 0))
                nxt.extend(jnp.zeros_like(leaves[i], jnp.float32) for i in idx)
                continue
            secs, out, ok = _encode_bucket([leaves[i] for i in idx], None if res is None else [res[i] for i in idx],
                                           beta_, mute_, mode=self.mode, chunk=self.chunk,
                                           placed=tuple(leaves[i].sharding for i in idx))
            runs.append((secs, ok, n))
            nxt.extend(out)
        oks = [ok for _, ok, _ in runs if ok is not None]

        def collect() -> tuple[Encoded, Any, bool]:
            payloads, pulled = [], 0
            for secs, _, n in runs:  # only the codec's sections leave the devices
                host = [tuple(np.asarray(a) for a in sec) for sec in secs]
                pulled += sum(a.nbytes for sec in host for a in sec)
                payloads.append(self._pieces(host, n) if n else ())
            self.last_bytes = pulled
            enc = Encoded(shapes(like), tuple(payloads), self.mode, self.chunk, self.bucket_numel, self.piece_numel)
            return enc, jax.tree.unflatten(treedef, nxt), all(bool(ok) for ok in oks)

        return collect

    def zeros(self, like: Any) -> Encoded:
        """A contribution of zeros for ``like``'s shapes, made on the host without a pass over
        any values (a node sitting a round out; no device program): every chunk of zeros
        encodes to the same sections, so a piece is those repeated, and a last partial chunk
        is encoded as it is."""
        C, mode = self.chunk, self.mode
        one = _sections(np.zeros(C, np.float32), mode, C)
        payloads, sizes = [], [int(np.prod(np.shape(x))) for x in jax.tree.leaves(like)]
        for idx in treelib.make_buckets(sizes, self.bucket_numel):
            n = sum(sizes[i] for i in idx)
            p, pieces = gather_plan(n, C, self.piece_numel), []
            for j in range(p.pieces if n else 0):
                a, b = p.piece(0, j)
                full, r = (b - a) // C, (b - a) % C
                tail = _sections(np.zeros(r, np.float32), mode, C) if r else (b"", b"", b"")
                pieces.append(np.frombuffer(b"".join(one[m] * full + tail[m] for m in range(3)), np.uint8).copy())
            payloads.append(tuple(pieces))
        self.last_bytes = 0
        return Encoded(shapes(like), tuple(payloads), mode, C, self.bucket_numel, self.piece_numel)

    def _pieces(self, secs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], n: int) -> tuple[np.ndarray, ...]:
        """The ring's pieces of one bucket from its rows' sections (full chunks, then the tail)."""
        C = self.chunk
        full = n // C
        p = gather_plan(n, C, self.piece_numel)
        out = []
        for j in range(p.pieces):
            a, b = p.piece(0, j)
            r0, r1 = a // C, -(-b // C)
            parts: list[list[np.ndarray]] = [[], [], []]
            for k, sec in enumerate(secs):
                lo, hi = (r0, min(r1, full)) if k == 0 and full else (max(r0, full) - full, r1 - full)
                if hi > lo:
                    for m in range(3):
                        parts[m].append(np.ascontiguousarray(sec[m][lo:hi]).view(np.uint8).reshape(-1))
            out.append(np.concatenate([x for m in range(3) for x in parts[m]]))
        return tuple(out)


def _sections(x: np.ndarray, mode: str, chunk: int) -> tuple[bytes, bytes, bytes]:
    """(levels, positions, codes) bytes of one chunk (or a shorter last one), by the host codec."""
    wire = quant.encode(x, mode, chunk)
    nl = 4 * codecs_xla.level_count(mode) * -(-x.size // chunk)
    kept = codecs_xla.kept(mode, x.size)
    npos = -(-kept // 2) * 3 if codecs_xla.index_bits(mode, chunk) == 12 else \
        -(-kept * codecs_xla.index_bits(mode, chunk) // 8)
    return wire[:nl].tobytes(), wire[nl: nl + npos].tobytes(), wire[nl + npos:].tobytes()


@dataclass
class DeviceContribution:
    """A round's pseudo-gradient held on the devices, to be encoded there (what the trainer hands
    the outer loop instead of a host tree when its node encodes on the devices).

    :meth:`start` launches the norm and the encoding at once: an overlapped node calls it at
    the window, before the next round's steps are launched, so that programs with collectives
    (these, the train step) reach every device in one order (two host threads launching
    multi-device programs with collectives can interleave them differently per GPU and hang);
    what runs beside training afterwards only waits and copies."""

    diff: Any  # anchor - params, float32, sharded like the params
    encoder: DeviceEncoder
    like: Any = None  # the outer params (host): the tree the ring reduces
    _norm: Any = None
    _started: tuple[Any, float, Callable[[], Any]] | None = None

    def start(self, residual: Any, beta: float) -> None:
        self._norm = _sumsq(jax.tree.leaves(self.diff))
        self._started = (residual, beta, self.encoder.dispatch(self.diff, residual, beta, False, self.like))

    def norm(self) -> float:
        ss, ok = self._norm if self._norm is not None else _sumsq(jax.tree.leaves(self.diff))
        return float(f"{math.sqrt(float(ss)):.6g}") if bool(ok) else math.inf

    def encode(self, residual: Any, beta: float, mute: bool) -> tuple[Encoded, Any, bool]:
        """As :meth:`DeviceEncoder.encode` (zeros made on the host when ``mute``; the started
        encoding when it was started with these arguments)."""
        if mute:
            return self.encoder.zeros(self.like if self.like is not None else self.diff), None, True
        st, self._started = self._started, None
        if st is not None and st[0] is residual and st[1] == beta:
            return st[2]()
        return self.encoder.encode(self.diff, residual, beta, False, self.like)
