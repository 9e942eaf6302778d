"""grain pipeline: windows, train/val split, node x process sharding, mixture, batches, state.

Per source, the token stream (documents as ``[BOS] doc [EOS]``, concatenated) is cut into
non-overlapping windows of ``seq_len + 1`` tokens. The last ``ceil(val_fraction * n)``
windows are the validation split; the rest are training windows, dealt round-robin to
``node_count`` node shards (DiLoCo nodes never share a training window). Each shard is
shuffled with a per-epoch seed and repeated forever; sources are mixed by weight
(:mod:`.mixture`) and batched into node batches of ``batch_size``; host ``process_index``
of a node reads rows ``[i*h, (i+1)*h)`` (``h = batch_size // process_count``), so the
node's batches do not depend on how many hosts it spans.

Everything before batching is a random-access grain ``MapDataset``, so the iterator state
is just the number of batches consumed: restoring it resumes with exactly the batch an
uninterrupted run would have produced, whatever the number of worker processes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from .cache import TokenStream, source_stream, tokenize_file
from .config import DataConfig
from .errors import DataError
from .mixture import mix, mixture_counts
from .tokenizer import Tok

STATE_VERSION = 1
VAL_SEED = 0x5EED
"""Validation order is fixed (independent of ``DataConfig.seed``) so runs compare."""


@dataclass(frozen=True)
class SourceSplit:
    """A tokenized source and its window split."""

    path: str
    field: str
    weight: float
    stream: TokenStream
    n_windows: int
    n_train: int
    n_val: int


def prepare_sources(cfg: DataConfig, tok: Tok) -> list[SourceSplit]:
    """Tokenize (or load from cache) every source and compute its train/val split."""
    mixture_counts([s.weight for s in cfg.sources], [s.path for s in cfg.sources])
    window = cfg.seq_len + 1
    out = []
    for src in cfg.sources:
        stream = source_stream(src.path, src.field, tok, cfg.add_bos, cfg.cache_path)
        n = len(stream) // window
        n_val = max(1, math.ceil(n * cfg.val_fraction))
        if n - n_val < 1:
            raise DataError(
                f"corpus too short: source {src.path!r} has {len(stream)} tokens = {n} window(s) "
                f"of seq_len+1={window}, need >= 1 training window after the validation split "
                f"(val_fraction={cfg.val_fraction})"
            )
        out.append(SourceSplit(src.path, src.field, src.weight, stream, n, n - n_val, n_val))
    return out


class _Tag:
    """Window index -> ``(source, window)`` record."""

    def __init__(self, source: int):
        self.source = source

    def __call__(self, window) -> tuple[int, int]:
        return self.source, int(window)


class _ReadWindows:
    """Node-batch records ``(sources[B], windows[B])`` -> this host's rows
    ``{"tokens": int32[h, window]}`` (rows ``[lo, lo + h)``; all rows by default)."""

    def __init__(self, streams: Sequence[TokenStream], window: int, lo: int = 0,
                 rows: int | None = None):
        self.streams, self.window, self.lo, self.rows = list(streams), window, lo, rows

    def __call__(self, records) -> dict:
        src, win = records
        hi = len(src) if self.rows is None else self.lo + self.rows
        return {
            "tokens": np.stack(
                [
                    self.streams[int(s)].read(int(w) * self.window, self.window)
                    for s, w in zip(src[self.lo : hi], win[self.lo : hi])
                ]
            )
        }


def train_records(
    splits: Sequence[SourceSplit], *, seed: int, shard_index: int = 0, shard_count: int = 1
) -> grain.MapDataset:
    """Infinite ``MapDataset`` of ``(source, window)`` training records of one shard."""
    parts = []
    for s, sp in enumerate(splits):
        ds = grain.MapDataset.range(sp.n_train)[shard_index::shard_count]
        if len(ds) == 0:
            raise DataError(
                f"source {sp.path!r} has {sp.n_train} training windows, fewer than "
                f"the {shard_count} node x process shards"
            )
        parts.append(ds.shuffle(seed=(seed + 1_000_003 * s) % 2**32).repeat().map(_Tag(s)))
    return mix(parts, [sp.weight for sp in splits], seed, [sp.path for sp in splits])


def val_records(splits: Sequence[SourceSplit]) -> grain.MapDataset:
    """Infinite ``MapDataset`` of validation records: each source's held-out windows
    (in order, cycled) mixed by the same weights with a fixed seed."""
    parts = [
        grain.MapDataset.range(sp.n_train, sp.n_windows).repeat().map(_Tag(s))
        for s, sp in enumerate(splits)
    ]
    return mix(parts, [sp.weight for sp in splits], VAL_SEED, [sp.path for sp in splits])


def _check_layout(
    batch_size: int, node_rank: int, node_count: int, process_index: int, process_count: int
) -> int:
    if not (node_count >= 1 and 0 <= node_rank < node_count):
        raise DataError(f"node_rank {node_rank} out of range for node_count {node_count}")
    if not (process_count >= 1 and 0 <= process_index < process_count):
        raise DataError(
            f"process_index {process_index} out of range for process_count {process_count}"
        )
    if batch_size % process_count:
        raise DataError(
            f"batch_size {batch_size} is not divisible by process_count {process_count}"
        )
    return batch_size // process_count


class DataIterator:
    """Infinite iterator of training batches ``{"tokens": int32[host_batch, seq_len+1]}``.

    ``get_state()`` is a small JSON-serializable dict; ``set_state()`` on an iterator built
    from the same config/data/layout resumes exactly (DataError if they differ).

    With data leases (``lease``) it yields the batches of the stream it was told, in order, and
    no others: a DiLoCo node whose coordinator hands out each round's data (the node's stream is
    then the whole stream, shard 0 of 1; ``stream`` names it, whatever the process layout).
    """

    def __init__(self, batches: grain.MapDataset, fingerprint: str, info: dict, num_workers: int,
                 stream: str = ""):
        self._batches, self.fingerprint, self.info = batches, fingerprint, info
        self.stream = stream
        self._num_workers = num_workers
        self._step = 0
        self._plan: list[list[int]] | None = None  # leased [a, b) ranges of batches; _step counts within
        self._it = None

    def lease(self, ranges: list[tuple[int, int]]) -> None:
        """From now on the stream's batches ``ranges`` (``[a, b)``, in order), then nothing."""
        if not ranges or any(not 0 <= a < b for a, b in ranges):
            raise DataError(f"a lease must be non-empty [a, b) ranges of batches, not {list(ranges)[:4]}")
        self.close()
        self._plan, self._step = [[int(a), int(b)] for a, b in ranges], 0

    def _open(self):
        if self._plan is None:
            ds = self._batches[self._step :]
        else:
            ds = grain.MapDataset.concatenate([self._batches[a:b] for a, b in self._plan])[self._step :]
        # a leased iterator reopens every round: it reads with threads (``num_workers`` of them),
        # since a pool of worker processes would be spawned again for each lease (seconds each)
        threads = 2 if self._plan is None else max(2, self._num_workers)
        ds = ds.to_iter_dataset(
            grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4)
        )
        if self._num_workers > 0 and self._plan is None:
            from absl import flags

            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=self._num_workers, per_worker_buffer_size=2
                )
            )
        return iter(ds)

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict:
        if self._it is None:
            self._it = self._open()
        try:
            batch = next(self._it)
        except StopIteration:
            raise DataError(f"the leased batches {self._plan} are used up: the coordinator's lease of "
                            "the next round must come first") from None
        self._step += 1
        return batch

    @property
    def step(self) -> int:
        """Batches consumed so far."""
        return self._step

    def get_state(self) -> dict:
        state = {"version": STATE_VERSION, "step": self._step, "fingerprint": self.fingerprint}
        return state if self._plan is None else {**state, "plan": [list(r) for r in self._plan]}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(f"unsupported data iterator state: {str(state)[:80]}")
        if state.get("fingerprint") != self.fingerprint:
            raise DataError(
                "data iterator state is from a different data pipeline (sources, "
                "tokenizer, seq_len, batch, seed or node/process layout changed)"
            )
        plan = state.get("plan")
        if plan is not None and not (isinstance(plan, list | tuple) and all(
                isinstance(r, list | tuple) and len(r) == 2 and all(type(v) is int for v in r) and 0 <= r[0] < r[1]
                for r in plan) and plan):
            raise DataError(f"data iterator state: plan is not [a, b) ranges of batches: {str(plan)[:80]}")
        self.close()
        self._step, self._plan = int(state["step"]), None if plan is None else [list(r) for r in plan]

    def close(self) -> None:
        """Stop prefetch threads / worker processes (the iterator reopens on next())."""
        if self._it is not None:
            close = getattr(self._it, "close", None)
            if close is not None:
                close()
            self._it = None


def _source_info(sp: SourceSplit) -> dict:
    return {
        "path": sp.path,
        "field": sp.field,
        "weight": sp.weight,
        "tokens": len(sp.stream),
        "windows": sp.n_windows,
        "train_windows": sp.n_train,
        "val_windows": sp.n_val,
    }


def make_train_iter(
    cfg: DataConfig,
    tok: Tok,
    *,
    node_rank: int = 0,
    node_count: int = 1,
    process_index: int = 0,
    process_count: int = 1,
) -> DataIterator:
    """Training batches for host ``process_index`` of node ``node_rank`` (infinite epochs)."""
    host_batch = _check_layout(cfg.batch_size, node_rank, node_count, process_index, process_count)
    splits = prepare_sources(cfg, tok)
    # the node's batch stream does not depend on how many hosts the node has: host i reads
    # rows [i*h, (i+1)*h) of every node batch, so 2 hosts x 4 devices = 1 host x 8 devices
    shard_index, shard_count = node_rank, node_count
    records = train_records(splits, seed=cfg.seed, shard_index=shard_index, shard_count=shard_count)
    batches = records.batch(cfg.batch_size, drop_remainder=True).map(
        _ReadWindows([sp.stream for sp in splits], cfg.seq_len + 1, process_index * host_batch,
                     host_batch)
    )
    info = {
        "sources": [_source_info(sp) for sp in splits],
        "shard_index": shard_index,
        "shard_count": shard_count,
        "process_index": process_index,
        "process_count": process_count,
        "host_batch": host_batch,
        "seq_len": cfg.seq_len,
    }
    # identifies the batch stream, not where the files/cache live (data may be moved)
    shard_tokens = [[sh.n_tokens for sh in sp.stream.shards] for sp in splits]
    sources = [{k: v for k, v in d.items() if k not in ("path", "field")} for d in info["sources"]]
    blob = json.dumps(
        {
            **info,
            "sources": sources,
            "shard_tokens": shard_tokens,
            "seed": cfg.seed,
            "tokenizer": tok.fingerprint,
            "add_bos": cfg.add_bos,
        },
        sort_keys=True,
    )
    whole = json.loads(blob)  # the stream itself, without this host's place in its node
    for k in ("process_index", "process_count", "host_batch"):
        whole.pop(k)
    stream = hashlib.sha256(json.dumps({**whole, "batch_size": cfg.batch_size}, sort_keys=True).encode())
    return DataIterator(
        batches, hashlib.sha256(blob.encode()).hexdigest()[:16], info, cfg.num_workers,
        stream.hexdigest()[:16],
    )


def make_val_batches(
    cfg: DataConfig,
    tok: Tok,
    *,
    max_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    node_rank: int = 0,
    node_count: int = 1,
) -> list[dict]:
    """Deterministic validation batches ``{"tokens": int32[host_batch, seq_len+1]}``.

    Every node gets the same batches (``node_rank``/``node_count`` are accepted and ignored,
    so validation losses compare across DiLoCo nodes); within a node, host
    ``process_index`` gets rows ``[i*h, (i+1)*h)`` of each node batch (``h = host_batch =
    batch_size // process_count``). Default ``max_batches``:
    ``max(1, total validation windows // batch_size)``.
    """
    host_batch = _check_layout(cfg.batch_size, node_rank, node_count, process_index, process_count)
    splits = prepare_sources(cfg, tok)
    n = (
        max_batches
        if max_batches is not None
        else max(1, sum(sp.n_val for sp in splits) // cfg.batch_size)
    )
    node_batches = val_records(splits).batch(cfg.batch_size, drop_remainder=True)
    read = _ReadWindows([sp.stream for sp in splits], cfg.seq_len + 1, process_index * host_batch,
                        host_batch)
    return [read(node_batches[b]) for b in range(n)]


def make_eval_batches(
    paths: str | Path | Sequence[str | Path],
    tok: Tok,
    seq_len: int,
    batch_size: int,
    field: str = "text",
    add_bos: bool = True,
    drop_remainder: bool = False,
) -> list[dict]:
    """Batches covering arbitrary file(s) in order, tokenized with ``tok`` (no cache).

    All windows of ``seq_len + 1`` tokens, in file order; the last batch is smaller unless
    ``drop_remainder``.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if seq_len <= 0 or batch_size <= 0:
        raise DataError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
    parts = [tokenize_file(p, tok, field, add_bos) for p in paths]
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    window = seq_len + 1
    n = len(tokens) // window
    if n == 0:
        raise DataError(
            f"corpus too short: {[str(p) for p in paths]} has {len(tokens)} tokens, "
            f"less than one sequence of seq_len+1={window}"
        )
    windows = tokens[: n * window].reshape(n, window).astype(np.int32)
    stop = n - n % batch_size if drop_remainder else n
    if stop == 0:
        raise DataError(
            f"{[str(p) for p in paths]}: {n} windows, fewer than batch_size {batch_size}"
        )
    return [{"tokens": windows[i : min(i + batch_size, stop)]} for i in range(0, stop, batch_size)]
