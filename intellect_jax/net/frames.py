"""Frame format: a fixed 88-byte header followed by ``length`` payload bytes.

Header (little endian)::

    magic 4s | version B | type B | flags H | run 16s | seq Q | length Q | ptag 32s | htag 16s

* ``run``: first 16 bytes of sha256(run id); frames of another run are rejected.
* ``seq``: per connection and direction, 0, 1, 2, ...; a gap or replay is rejected.
* ``ptag``: payload integrity tag, crc32 (default) or sha256 (flags say which).
* ``htag``: sha256 of the 72 bytes before it, truncated to 16 bytes: a checksum. Frames travel
  inside mutual TLS 1.3 (see :mod:`.identity`), which encrypts and authenticates every byte; the
  tags catch a peer's own framing bugs, and the header is checked before the payload is read, so
  a bad header never makes the receiver allocate ``length`` bytes.

Because ``ptag`` is an unkeyed hash of the payload, a node that forwards a payload
verbatim can reuse the tag it verified instead of hashing again.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
import zlib
from typing import NamedTuple

from intellect_jax.net.errors import FrameError

MAGIC = b"IJNT"
VERSION = 1
_FIXED = struct.Struct("<4sBBH16sQQ32s")
TAG_LEN = 16
HEADER_LEN = _FIXED.size + TAG_LEN  # 88
INTEGRITY = {"sha256": 1, "crc32": 2}
_INTEGRITY_NAME = {v: k for k, v in INTEGRITY.items()}


class MsgType(enum.IntEnum):
    """Frame types."""

    HELLO = 1  # the channel a new connection is for (inside TLS)
    ACCEPT = 4
    REJECT = 5
    META = 10
    DATA = 11
    AUDIT = 12  # a butterfly call's audit frames, interleaved with its aggregates (net/audit_frames.py)
    POST = 13  # after a butterfly call's gather: DONE, ASK, RELAY, END (net/relay.py)
    BLOB_BEGIN = 20
    BLOB_DATA = 21
    BLOB_END = 22


_TYPES = {int(t): t for t in MsgType}


class Header(NamedTuple):
    """A parsed, authenticated frame header."""

    mtype: MsgType
    flags: int
    run: bytes
    seq: int
    length: int
    ptag: bytes


def run_hash(run_id: str) -> bytes:
    """16-byte run identifier carried in every header."""
    return hashlib.sha256(run_id.encode()).digest()[:16]


def payload_tag(payload: memoryview | bytes, integrity: str) -> bytes:
    """32-byte integrity tag of a payload (GIL released for large buffers)."""
    if integrity == "sha256":
        return hashlib.sha256(payload).digest()
    if integrity == "crc32":
        return zlib.crc32(payload).to_bytes(4, "little") + bytes(28)
    raise ValueError(f"unknown integrity algorithm {integrity!r}; expected one of {list(INTEGRITY)}")


def _htag(fixed: bytes) -> bytes:
    return hashlib.sha256(fixed).digest()[:TAG_LEN]


def pack_header(
    mtype: MsgType, run: bytes, seq: int, length: int, ptag: bytes, integrity: str
) -> bytes:
    """Serialize a header."""
    fixed = _FIXED.pack(MAGIC, VERSION, int(mtype), INTEGRITY[integrity], run, seq, length, ptag)
    return fixed + _htag(fixed)


def parse_header(
    raw: bytes | bytearray | memoryview,
    *,
    peer: str,
    run: bytes | None,
    max_len: int,
    integrity: str,
) -> Header:
    """Validate and parse a header; raise :class:`FrameError` naming ``peer`` on any defect.

    Checks, in order: size, magic, version, header tag, run id, type, length limit,
    integrity algorithm. Never allocates anything proportional to ``length``.
    """
    raw = bytes(raw)
    if len(raw) != HEADER_LEN:
        raise FrameError(f"{peer}: truncated frame header ({len(raw)} of {HEADER_LEN} bytes)")
    fixed, tag = raw[: _FIXED.size], raw[_FIXED.size :]
    magic, version, mtype, flags, frun, seq, length, ptag = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise FrameError(f"{peer}: bad frame magic {magic!r} (not an intellect_jax peer?)")
    if version != VERSION:
        raise FrameError(f"{peer}: protocol version {version}, this node speaks {VERSION}")
    if not hmac.compare_digest(tag, _htag(fixed)):
        raise FrameError(f"{peer}: header checksum mismatch")
    if run is not None and frun != run:
        raise FrameError(f"{peer}: frame belongs to another run id")
    mt = _TYPES.get(mtype)
    if mt is None:
        raise FrameError(f"{peer}: unknown frame type {mtype}")
    if length > max_len:
        raise FrameError(f"{peer}: frame announces {length} bytes, above the limit of {max_len}")
    if flags != INTEGRITY[integrity]:
        theirs = _INTEGRITY_NAME.get(flags, f"unknown ({flags})")
        raise FrameError(f"{peer}: peer uses {theirs} payload integrity, this node uses {integrity}")
    return Header(mt, flags, frun, seq, length, ptag)


def check_payload(payload: memoryview | bytes, hdr: Header, integrity: str, peer: str) -> None:
    """Raise :class:`FrameError` if the payload does not match the header's tag."""
    if not hmac.compare_digest(payload_tag(payload, integrity), hdr.ptag):
        raise FrameError(f"{peer}: payload {integrity} mismatch in {hdr.mtype.name} frame seq {hdr.seq}")
