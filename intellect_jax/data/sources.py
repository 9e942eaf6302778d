"""Readers: documents from ``.txt[.gz]``, ``.jsonl[.gz]`` and ``.parquet`` files or directories.

* ``.txt`` / ``.txt.gz``: the whole file is one document.
* ``.jsonl`` / ``.jsonl.gz``: one JSON object per line, the document is ``obj[field]``
  (blank lines skipped, ``null`` values skipped, a line without the field is an error).
* ``.parquet``: the document is the string column ``field`` (read in record batches, so
  files larger than memory work; ``null`` values skipped). This is the local form of
  Hugging Face datasets such as FineWeb-Edu.

A directory is searched recursively; files are taken in sorted path order, hidden files
and files of other types (README.md, .gitattributes ...) are ignored.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

from .config import BUNDLED
from .errors import DataError

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
BUNDLED_FILES = ("shakespeare.jsonl.gz",)
"""The bundled corpus: 42 public-domain Shakespeare works, one JSON line each."""

KINDS = {
    ".txt": "txt",
    ".txt.gz": "txt",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".parquet": "parquet",
}
_SUFFIX_LIST = ", ".join(KINDS)
CONTENT_HASH_MAX_BYTES = 32 << 20
"""Files up to this size are identified by content hash, larger ones by path+size+mtime."""


def file_kind(path: str | Path) -> str | None:
    """``"txt"``, ``"jsonl"``, ``"parquet"`` or ``None`` (unsupported) from the file name."""
    name = Path(path).name.lower()
    for suffix in sorted(KINDS, key=len, reverse=True):
        if name.endswith(suffix):
            return KINDS[suffix]
    return None


def resolve_files(path: str | Path) -> list[Path]:
    """The data files a source path stands for (``"bundled"``, a file, or a directory)."""
    if str(path) == BUNDLED:
        return [CORPUS_DIR / name for name in BUNDLED_FILES]
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data path not found: {str(path)!r}")
    if p.is_file():
        if file_kind(p) is None:
            raise DataError(f"unknown file type for {str(p)!r}: expected one of {_SUFFIX_LIST}")
        return [p.absolute()]
    files = sorted(
        f.absolute()
        for f in p.rglob("*")
        if f.is_file()
        and file_kind(f) is not None
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        raise DataError(f"no data files ({_SUFFIX_LIST}) under directory {str(p)!r}")
    return files


def file_identity(path: Path) -> dict:
    """What the token cache key uses for a file: content hash if small, else path+size+mtime."""
    st = path.stat()
    if st.st_size <= CONTENT_HASH_MAX_BYTES:
        return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "size": st.st_size}
    return {"path": str(path.absolute()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    return open(path, encoding="utf-8", errors="replace", newline="")


def _iter_txt(path: Path) -> Iterator[str]:
    try:
        with _open_text(path) as fh:
            yield fh.read()
    except (OSError, EOFError) as e:  # e.g. truncated / not-really-gzip file
        raise DataError(f"cannot read {str(path)!r}: {e}") from None


def _iter_jsonl(path: Path, field: str) -> Iterator[str]:
    try:
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or field not in obj:
                    keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
                    raise DataError(f"{path}:{lineno}: missing field {field!r} (has: {keys})")
                value = obj[field]
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise DataError(
                        f"{path}:{lineno}: field {field!r} is "
                        f"{type(value).__name__}, expected a string"
                    )
                yield value
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {str(path)!r}: {e}") from None


def _iter_parquet(path: Path, field: str, batch_rows: int = 1024) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read parquet file {str(path)!r}: {e}") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise DataError(
            f"parquet file {str(path)!r} has no column {field!r} (columns: {names[:8]})"
        )
    col_type = pf.schema_arrow.field(field).type
    if not (
        pa.types.is_string(col_type)
        or pa.types.is_large_string(col_type)
        or pa.types.is_string_view(col_type)
    ):
        raise DataError(f"parquet column {field!r} in {str(path)!r} is {col_type}, expected string")
    for batch in pf.iter_batches(batch_size=batch_rows, columns=[field]):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value


def iter_file_documents(path: str | Path, field: str = "text") -> Iterator[str]:
    """Documents (strings) of one data file, in file order."""
    path = Path(path)
    kind = file_kind(path)
    if kind == "txt":
        return _iter_txt(path)
    if kind == "jsonl":
        return _iter_jsonl(path, field)
    if kind == "parquet":
        return _iter_parquet(path, field)
    raise DataError(f"unknown file type for {str(path)!r}: expected one of {_SUFFIX_LIST}")


def iter_documents(path: str | Path, field: str = "text") -> Iterator[str]:
    """Documents of a source path (``"bundled"``, a file, or a directory), in order."""
    for f in resolve_files(path):
        yield from iter_file_documents(f, field)
