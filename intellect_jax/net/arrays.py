"""Lists of numpy arrays over one connection: a JSON header, then one blob per array.

The header is a :func:`~.transport.send_msg` object, the caller's own fields plus
``"arrays": [[dtype, [dim, ...]], ...]`` with dtype names from :data:`DTYPES` (``bfloat16``
included, via ml_dtypes, which numpy cannot name by itself). Each array then goes as one blob
(:mod:`.blob`) of its raw bytes and is received straight into its final buffer.
A receiver parses the header as an :class:`ArrayHeader` (or the caller's subclass of it, with
the caller's own fields: :mod:`.schema`) and checks the count, the dtypes, the total size, or
the exact list it expects, before it allocates anything, so a peer cannot make it reserve memory.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Annotated, Any, TypeVar

import ml_dtypes
import numpy as np
from pydantic import AfterValidator, Field

from intellect_jax.net.blob import recv_blob, send_blob
from intellect_jax.net.errors import ConfigMismatch, FrameError
from intellect_jax.net.schema import JsonTuple, Nat, Wire, recv_model
from intellect_jax.net.transport import Connection, send_msg

DTYPES: dict[str, np.dtype] = {  # native byte order (every supported host is little-endian)
    np.dtype(t).name: np.dtype(t)
    for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
              np.float16, ml_dtypes.bfloat16, np.float32, np.float64)
}
MAX_ARRAYS = 1 << 16  # arrays in one header (a receiver may allow fewer)
MAX_HEADER = 16 << 20  # bytes of one header
MAX_NDIM = 32
# elements of one array, its zero dimensions counted as one: a zero would hide huge others from
# the byte count, and numpy refuses such a shape (ValueError) even though it holds nothing
MAX_ELEMENTS = 1 << 40
Spec = tuple[np.dtype, tuple[int, ...]]  # (dtype, shape)


def spec(x: Any) -> Spec:
    """The spec of an array or of anything with ``dtype`` and ``shape`` (``ShapeDtypeStruct``)."""
    return np.dtype(x.dtype), tuple(int(n) for n in x.shape)


def _raw(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat uint8 view (bfloat16 has no buffer format)."""
    return a.reshape(-1).view(np.uint8)


def send_arrays(conn: Connection, arrays: Sequence[Any], meta: dict[str, Any] | None = None, *,
                deadline: float | None = None, chunk_bytes: int = 8 << 20) -> int:
    """Send ``meta`` and ``arrays`` (numpy, or anything ``np.asarray`` takes); returns the bytes
    of array data sent."""
    if meta is not None and "arrays" in meta:
        raise ValueError("'arrays' is the header's own field")
    wire = []
    for a in map(np.asarray, arrays):
        if a.dtype.name not in DTYPES:
            raise ValueError(f"cannot send an array of dtype {a.dtype}; supported: {sorted(DTYPES)}")
        wire.append(np.asarray(a, DTYPES[a.dtype.name], order="C"))  # a copy only if strided or big-endian
    send_msg(conn, {**(meta or {}), "arrays": [[a.dtype.name, list(a.shape)] for a in wire]}, deadline)
    return sum(send_blob(conn, _raw(a), chunk_bytes=chunk_bytes, deadline=deadline) for a in wire)


def _known(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} refused")
    return name


def _countable(shape: list[int]) -> list[int]:
    if math.prod(max(n, 1) for n in shape) > MAX_ELEMENTS:
        raise ValueError(f"more than {MAX_ELEMENTS} elements (zero dimensions counted as one)")
    return shape


DType = Annotated[str, Field(max_length=32), AfterValidator(_known)]
Shape = Annotated[list[Nat], Field(max_length=MAX_NDIM), AfterValidator(_countable)]


class ArrayHeader(Wire):
    """The header of an array list: ``arrays``, one ``[dtype, shape]`` per array. A caller that
    sends fields of its own receives with a subclass that declares them."""

    arrays: Annotated[list[Annotated[tuple[DType, Shape], JsonTuple]], Field(max_length=MAX_ARRAYS)]

    def specs(self) -> list[Spec]:
        return [(DTYPES[d], tuple(shape)) for d, shape in self.arrays]


H = TypeVar("H", bound=ArrayHeader)


def recv_array_head(conn: Connection, model: type[H] = ArrayHeader, *,  # type: ignore[assignment]
                    max_bytes: int | None = None, like: Sequence[Spec] | None = None,
                    dtypes: Collection[str] | None = None, max_count: int = MAX_ARRAYS, max_len: int = MAX_HEADER,
                    deadline: float | None = None, what: str = "array header") -> tuple[H, list[Spec]]:
    """Receive a header as ``model`` (:class:`ArrayHeader` or a subclass with the sender's own
    fields): ``(the header, the specs of the arrays that follow)``.

    Limits: at most ``max_count`` arrays of ``dtypes`` (default: all of :data:`DTYPES`) and
    ``max_bytes`` in all, else :class:`FrameError`; or exactly the specs ``like``, else
    :class:`ConfigMismatch` (the peer is well-formed but holds something else). A header that
    does not parse as ``model`` raises :class:`FrameError` either way.
    """
    if (max_bytes is None) == (like is None):
        raise TypeError("give max_bytes or like")
    head = recv_model(conn, model, what, deadline, max_len)
    specs = head.specs()
    if like is not None:
        if len(specs) != len(like):
            raise ConfigMismatch(f"{conn.peer}: sent {len(specs)} arrays, expected {len(like)}")
        for i, (got, want) in enumerate(zip(specs, like)):
            if got != (np.dtype(want[0]), tuple(want[1])):
                raise ConfigMismatch(f"{conn.peer}: array {i} is {got[0].name}{list(got[1])}, "
                                     f"expected {np.dtype(want[0]).name}{list(want[1])}")
        return head, specs
    if len(specs) > max_count:
        raise FrameError(f"{conn.peer}: {len(specs)} arrays announced, more than {max_count}")
    assert max_bytes is not None
    total = 0
    for dt, shape in specs:
        if dtypes is not None and dt.name not in dtypes:
            raise FrameError(f"{conn.peer}: array of dtype {dt.name!r} refused")
        total += math.prod(shape) * dt.itemsize
    if total > max_bytes:
        raise FrameError(f"{conn.peer}: sent more than the {max_bytes} bytes expected ({total})")
    return head, specs


def recv_array_data(conn: Connection, specs: Sequence[Spec], *, deadline: float | None = None) -> list[np.ndarray]:
    """Receive the arrays a header announced, each straight into a new array of its spec."""
    out = []
    for dt, shape in specs:
        a = np.empty(shape, dt)
        recv_blob(conn, into=_raw(a), max_bytes=a.nbytes, deadline=deadline)
        out.append(a)
    return out


def recv_arrays(conn: Connection, *, deadline: float | None = None,
                **limits: Any) -> tuple[ArrayHeader, list[np.ndarray]]:
    """:func:`recv_array_head` (with its ``limits``), then :func:`recv_array_data`."""
    head, specs = recv_array_head(conn, deadline=deadline, **limits)
    return head, recv_array_data(conn, specs, deadline=deadline)
