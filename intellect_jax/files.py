"""Files that are replaced whole or not at all (imports nothing of the package, so every layer,
the coordinator included, may use it)."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path


def atomic_write(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o666) -> None:
    """Replace ``path`` by ``data`` (``str`` is written as UTF-8) so that a crash, even a power
    loss, leaves the old file or the new one, never a mix or an empty file.

    The data goes to a temporary file in the same directory (the rename must stay within one
    filesystem to be atomic), is fsynced, renamed over ``path``, and the directory is fsynced so
    the rename itself is durable. Missing parent directories are created. ``mode`` (before the
    umask) applies from the file's creation on: a key written with 0o600 is never readable by
    others, not even as a temporary file. On failure ``path`` is untouched and no temporary file
    is left behind, except when only the directory's fsync fails (the disk): then ``path`` is
    the new file, and the error says its rename may not be durable.
    """
    if isinstance(data, str):
        data = data.encode()
    elif not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"atomic_write takes bytes or str, not {type(data).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
    """Make a rename in ``d`` durable. Some filesystems cannot fsync a directory (EINVAL,
    ENOTSUP, EBADF); there the rename is as durable as they make it. Any other failure (EIO: the
    disk) raises: the new file is in place but may not survive a crash."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)
