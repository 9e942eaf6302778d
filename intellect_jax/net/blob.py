"""Stream a large blob (e.g. a checkpoint) over one authenticated connection.

``BLOB_BEGIN`` (json: name, size, chunk: :class:`BlobHeader`) -> ``BLOB_DATA`` x ceil(size/chunk) -> ``BLOB_END``
(sha256 over the chunk tags, which checks order and completeness; every chunk is checked
by its own frame tag). Memory stays at one chunk for files; in-memory blobs are received
with ``recv_into`` straight into the result. Run it in a background thread over a
connection from :meth:`NetNode.connect` / :meth:`NetNode.accept` on its own channel.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Annotated, BinaryIO

import numpy as np
from pydantic import Field

from intellect_jax.net.errors import FrameError
from intellect_jax.net.frames import MsgType
from intellect_jax.net.schema import Nat, Wire, parse
from intellect_jax.net.transport import Buffer, Connection


def send_blob(conn: Connection, data: Buffer | BinaryIO | str | os.PathLike[str], *, name: str = "",
              chunk_bytes: int = 8 << 20, deadline: float | None = None) -> int:
    """Send bytes, an array, a binary file object or a file path; returns the size sent."""
    chunk_bytes = min(chunk_bytes, conn.cfg.max_frame_bytes)
    if isinstance(data, (str, os.PathLike)):
        with open(data, "rb") as f:
            return send_blob(conn, f, name=name or os.path.basename(data), chunk_bytes=chunk_bytes,
                             deadline=deadline)
    if hasattr(data, "readinto"):
        f: BinaryIO = data  # type: ignore[assignment]
        size = os.fstat(f.fileno()).st_size - f.tell()
        views = _file_chunks(f, size, chunk_bytes)
    else:
        mv = memoryview(data).cast("B")  # type: ignore[arg-type]
        size = mv.nbytes
        views = (mv[i : i + chunk_bytes] for i in range(0, size, chunk_bytes))
    meta = json.dumps({"name": name, "size": size, "chunk": chunk_bytes}).encode()
    conn.send(MsgType.BLOB_BEGIN, meta, deadline=deadline)
    tags = hashlib.sha256()
    sent = 0
    for view in views:
        tags.update(conn.send(MsgType.BLOB_DATA, view, deadline=deadline))
        sent += view.nbytes
    if sent != size:
        raise FrameError(f"blob {name!r} changed while sending ({sent} of {size} bytes)")
    conn.send(MsgType.BLOB_END, tags.digest(), deadline=deadline)
    return size


def _file_chunks(f: BinaryIO, size: int, chunk_bytes: int):  # noqa: ANN202 - generator of memoryviews
    buf = memoryview(bytearray(min(chunk_bytes, max(size, 1))))
    left = size
    while left > 0:
        n = f.readinto(buf[: min(chunk_bytes, left)])
        if not n:
            return
        yield buf[:n]
        left -= n


class BlobHeader(Wire):
    """``BLOB_BEGIN``'s JSON: the blob's name (for messages), size and chunk size in bytes."""

    name: Annotated[str, Field(max_length=256)]
    size: Nat
    chunk: Annotated[int, Field(ge=1, le=1 << 40)]


def recv_blob(conn: Connection, out: BinaryIO | None = None, *, max_bytes: int,
              deadline: float | None = None, into: Buffer | None = None) -> tuple[BlobHeader, bytearray | int]:
    """Receive one blob: ``(header, data)`` (``data`` = bytearray, or bytes written to ``out``, or
    the size received straight into ``into``, which must be exactly the blob's size)."""
    _, raw = conn.recv(MsgType.BLOB_BEGIN, deadline=deadline, max_len=1 << 16)
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON; nesting too deep
        raise FrameError(f"{conn.peer}: malformed blob header ({e})") from None
    meta = parse(BlobHeader, msg, conn.peer, "blob header")
    size, chunk = meta.size, meta.chunk
    if size > max_bytes:
        raise FrameError(f"{conn.peer}: blob of {size} bytes refused (limit {max_bytes})")
    target = memoryview(into).cast("B") if into is not None else None  # type: ignore[arg-type]
    if target is not None and target.nbytes != size:
        raise FrameError(f"{conn.peer}: blob {meta.name[:40]!r} is {size} bytes, expected {target.nbytes}")
    data = (target if target is not None else bytearray(size)) if out is None else None
    scratch = np.empty(min(chunk, size), np.uint8) if out is not None else None
    tags = hashlib.sha256()
    got = 0
    while got < size:
        n = min(chunk, size - got)
        hdr = conn.recv_header(MsgType.BLOB_DATA, deadline=deadline, length=n)
        if data is not None:
            conn.recv_payload_into(hdr, memoryview(data)[got : got + n], deadline=deadline)
        else:
            assert scratch is not None and out is not None
            conn.recv_payload_into(hdr, scratch[:n], deadline=deadline)
            out.write(memoryview(scratch[:n]))
        tags.update(hdr.ptag)
        got += n
    _, digest = conn.recv(MsgType.BLOB_END, deadline=deadline, max_len=64)
    if not hmac.compare_digest(digest, tags.digest()):
        raise FrameError(f"{conn.peer}: blob {meta.name[:40]!r} failed its end-to-end check")
    return meta, (size if data is None or target is not None else data)
