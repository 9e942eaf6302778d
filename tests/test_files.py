"""intellect_jax.files: a file is replaced whole, durably, or not at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from intellect_jax import files
from intellect_jax.files import atomic_write


def test_writes_replaces_and_creates_parents(tmp_path: Path) -> None:
    p = tmp_path / "a" / "b" / "record.json"
    atomic_write(p, "héllo")
    assert p.read_text(encoding="utf-8") == "héllo"
    atomic_write(p, b"\x00\x01")
    atomic_write(str(p), bytearray(b"new"))
    assert p.read_bytes() == b"new"
    assert sorted(x.name for x in p.parent.iterdir()) == ["record.json"]  # no temporary file left
    with pytest.raises(TypeError, match="bytes or str"):
        atomic_write(p, 3)  # type: ignore[arg-type]
    assert p.read_bytes() == b"new"


def test_fsyncs_the_file_and_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[bool] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    atomic_write(tmp_path / "x", "1")
    assert synced == [False, True]  # the data before the rename, the directory after it


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_failure_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        step: str) -> None:
    p = tmp_path / "config.json"
    p.write_text("old")

    def boom(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, step, boom)
    with pytest.raises(OSError, match="No space"):
        atomic_write(p, "new")
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["config.json"]


@pytest.mark.parametrize("err,raises", [(5, True), (22, False), (95, False)])  # EIO; EINVAL, ENOTSUP: cannot
def test_a_directory_fsync_fails_loudly_only_for_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          err: int, raises: bool) -> None:
    """A filesystem that cannot fsync a directory is no error; a disk that fails to is: the new
    file is in place, but its rename may not survive a crash."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(err, os.strerror(err))
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    p = tmp_path / "journal"
    if raises:
        with pytest.raises(OSError, match=os.strerror(err)):
            atomic_write(p, "new")
    else:
        atomic_write(p, "new")
    assert p.read_text() == "new" and [x.name for x in tmp_path.iterdir()] == ["journal"]
