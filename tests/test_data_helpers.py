"""Shared helpers (no tests) for tests/test_data*.py: tiny synthetic corpora."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SEQ = 16
WIN = SEQ + 1

WORDS = {
    "a": "alpha beta gamma delta epsilon zeta eta theta iota kappa".split(),
    "b": "red green blue cyan magenta yellow black white orange purple".split(),
    "c": "one two three four five six seven eight nine ten".split(),
}


def make_docs(n_docs: int, words_per_doc: int, seed: int = 0, vocab: str = "a") -> list[str]:
    """Random 'sentences' from a word list; each doc starts with a unique numbered tag."""
    rng = np.random.default_rng(seed)
    words = WORDS[vocab]
    return [
        f"doc{seed}x{i}: " + " ".join(rng.choice(words, words_per_doc)) + "." for i in range(n_docs)
    ]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_txts(directory: Path, docs: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (directory / f"doc{i:04d}.txt").write_text(d)
    return directory


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory shared by all test modules of one pytest session (e.g. a bundled-BPE cache)."""
    d = tmp_path_factory.getbasetemp() / name
    d.mkdir(exist_ok=True)
    return d


def tiny_tokenizer(tmp_path_factory):
    """A ~300-token byte-level BPE trained on synthetic docs (fast), as a loaded ``Tok``."""
    from intellect_jax.data import load_tokenizer_file, train_bpe

    path = shared_dir(tmp_path_factory, "tiny_tok") / "tokenizer.json"
    if not path.exists():
        docs = make_docs(200, 40) + make_docs(200, 40, 1, "b") + make_docs(200, 40, 2, "c")
        train_bpe(docs, 320).save(str(path))
    return load_tokenizer_file(path)


def make_cfg(tmp_path, sources, **kw):
    from intellect_jax.data import DataConfig, SourceConfig

    kw = {
        "seq_len": SEQ,
        "batch_size": 4,
        "val_fraction": 0.1,
        "cache_dir": str(tmp_path / "cache"),
        **kw,
    }
    return DataConfig(
        sources=[SourceConfig(**s) if isinstance(s, dict) else s for s in sources], **kw
    )


def make_src(tmp_path, name, n_docs, vocab="a", seed=0, weight=1.0):
    path = write_jsonl(tmp_path / f"{name}.jsonl", make_docs(n_docs, 30, seed, vocab))
    return {"path": str(path), "weight": weight}


def take(it, n):
    return [next(it)["tokens"] for _ in range(n)]


def windows_of(batches) -> list[tuple]:
    return [tuple(row) for b in batches for row in np.asarray(b)]
