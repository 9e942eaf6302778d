"""Pydantic configuration of the data pipeline (sources, tokenizer, windows, split, cache).

Field validation errors are pydantic ``ValidationError`` (a ``ValueError``) and name the
field; problems only visible when the data is read raise :class:`DataError`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

BUNDLED = "bundled"
"""Special value for ``SourceConfig.path`` / ``DataConfig.tokenizer``: the corpus shipped
with the package (``intellect_jax/data/corpus``) / a BPE trained on it."""

CACHE_ENV = "INTELLECT_JAX_CACHE"


def default_cache_dir() -> str:
    """``$INTELLECT_JAX_CACHE`` if set, else ``~/.cache/intellect_jax``."""
    return os.environ.get(CACHE_ENV, "~/.cache/intellect_jax")


class SourceConfig(BaseModel):
    """One data source: a file or a directory of ``.txt[.gz]``/``.jsonl[.gz]``/``.parquet``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = BUNDLED
    """File or directory; ``"bundled"`` = the bundled Shakespeare corpus."""
    field: str = "text"
    """JSON field (``.jsonl``) or column (``.parquet``) holding the document text."""
    weight: float = 1.0
    """Relative mixture weight (normalised over all sources); must be > 0."""

    @field_validator("path", "field")
    @classmethod
    def _non_empty(cls, v: str, info) -> str:
        if not v.strip():
            raise ValueError(f"{info.field_name} must be a non-empty string")
        return v

    @field_validator("weight")
    @classmethod
    def _positive_weight(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"weight must be a finite number > 0, got {v}")
        return v


class DataConfig(BaseModel):
    """Everything the trainer needs to build train / validation batches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig()], min_length=1)
    """Mixture components (INTELLECT-1 used five, weighted 55/20/10/10/5)."""
    tokenizer: str = BUNDLED
    """``"bundled"`` (byte-level BPE trained on the bundled corpus, cached) or a path to a
    Hugging Face ``tokenizer.json`` (or a directory containing one)."""
    bpe_vocab_size: int = 4096
    """Vocabulary size of the bundled BPE (ignored for a tokenizer path)."""
    seq_len: int = 512
    """Model context; windows are ``seq_len + 1`` tokens (inputs + shifted targets)."""
    batch_size: int = 8
    """Sequences per node per step, summed over the node's host processes."""
    seed: int = 0
    """Shuffle / mixture seed (0 <= seed < 2**31)."""
    val_fraction: float = 0.02
    """Fraction of each source's windows (its last ones) held out for validation."""
    cache_dir: str = Field(default_factory=default_cache_dir)
    """Where token shards and the trained tokenizer are cached."""
    num_workers: int = 0
    """grain worker processes (0 = load in the training process)."""
    add_bos: bool = True
    """Prepend BOS to every document (EOS is always appended)."""

    @field_validator("bpe_vocab_size")
    @classmethod
    def _vocab(cls, v: int) -> int:
        if v < 260:
            raise ValueError(f"bpe_vocab_size must be >= 260 (256 bytes + specials), got {v}")
        return v

    @field_validator("seq_len", "batch_size")
    @classmethod
    def _positive(cls, v: int, info) -> int:
        if v <= 0:
            raise ValueError(f"{info.field_name} must be a positive integer, got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        if not 0 <= v < 2**31:
            raise ValueError(f"seed must be in [0, 2**31), got {v}")
        return v

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"num_workers must be >= 0, got {v}")
        return v

    @field_validator("val_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 < v < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {v}")
        return v

    @field_validator("cache_dir")
    @classmethod
    def _cache(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("cache_dir must be a non-empty path")
        return v

    @property
    def cache_path(self) -> Path:
        """``cache_dir`` with ``~`` expanded, as an absolute path."""
        return Path(self.cache_dir).expanduser().absolute()
