"""Token cache (reuse, keys, interrupted writes), bad input, eval batches, worker
processes and the default run on the bundled corpus."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_data_helpers import (
    SEQ,
    WIN,
    make_cfg,
    make_docs,
    make_src,
    shared_dir,
    take,
    tiny_tokenizer,
    write_jsonl,
    write_txts,
)

from intellect_jax.data import (
    STATS,
    DataConfig,
    DataError,
    load_tokenizer,
    make_eval_batches,
    make_train_iter,
    make_val_batches,
    tokenize_file,
    train_bpe,
)
from intellect_jax.data.cache import read_shard, shard_key
from intellect_jax.data.sources import file_identity
from intellect_jax.data.tokenizer import BOS_TOKEN, EOS_TOKEN, _make_tok


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory)


# ----------------------------------------------------------------------------- cache


def _shard_dirs(cache):
    return sorted(p for p in (cache / "tokens").iterdir() if not p.name.startswith("."))


def test_cache_reused_and_keyed(tmp_path, tok):
    src_dir = write_txts(tmp_path / "txts", make_docs(30, 30))
    cfg = make_cfg(tmp_path, [{"path": str(src_dir)}])
    before = STATS["files_tokenized"]
    first = take(make_train_iter(cfg, tok), 3)
    assert STATS["files_tokenized"] - before == 30  # one shard per file
    dirs = _shard_dirs(tmp_path / "cache")
    mtimes = [(d / "tokens.bin").stat().st_mtime_ns for d in dirs]
    second = take(make_train_iter(cfg, tok), 3)
    assert STATS["files_tokenized"] - before == 30  # not retokenized
    assert [
        (d / "tokens.bin").stat().st_mtime_ns for d in _shard_dirs(tmp_path / "cache")
    ] == mtimes
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    # a different tokenizer -> different keys -> new shards
    other = train_bpe(make_docs(100, 30, 5, "b"), 300)
    other_tok = _make_tok(other, BOS_TOKEN, EOS_TOKEN, "other")
    make_train_iter(cfg, other_tok)
    assert STATS["files_tokenized"] - before == 60 and len(_shard_dirs(tmp_path / "cache")) == 60
    # an edited file is retokenized (only that one)
    (src_dir / "doc0003.txt").write_text("completely new text " * 20)
    make_train_iter(cfg, tok)
    assert STATS["files_tokenized"] - before == 61
    # field and add_bos are part of the key
    f = src_dir / "doc0000.txt"
    keys = {shard_key(file_identity(f), fld, tok, bos) for fld in ("text", "x") for bos in (0, 1)}
    assert len(keys) == 4


def test_interrupted_tokenization_leaves_no_trusted_cache(tmp_path, tok, monkeypatch):
    from intellect_jax.data import cache

    path = write_jsonl(tmp_path / "a.jsonl", make_docs(40, 30))
    cfg = make_cfg(tmp_path, [{"path": str(path)}])
    real = cache.tokenize_documents

    def dies(*args, **kw):
        gen = real(*args, **kw)
        yield next(gen)
        raise KeyboardInterrupt  # "killed" mid-write

    monkeypatch.setattr(cache, "tokenize_documents", dies)
    with pytest.raises(KeyboardInterrupt):
        make_train_iter(cfg, tok)
    assert not (tmp_path / "cache" / "tokens").exists() or not _shard_dirs(tmp_path / "cache")
    monkeypatch.setattr(cache, "tokenize_documents", real)
    it = make_train_iter(cfg, tok)
    (d,) = _shard_dirs(tmp_path / "cache")
    n = read_shard(d).n_tokens
    assert n == len(tokenize_file(path, tok))
    # a damaged entry (e.g. meta.json lost) is not trusted: it is rebuilt
    (d / "meta.json").unlink()
    before = STATS["files_tokenized"]
    make_train_iter(cfg, tok)
    assert STATS["files_tokenized"] == before + 1 and read_shard(d).n_tokens == n
    assert next(it)["tokens"].shape == (4, WIN)


# ----------------------------------------------------------------------------- bad input


def test_empty_corpus(tmp_path, tok):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "a.txt").write_text("")
    (d / "b.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(DataError, match="empty corpus") as e:
        make_train_iter(make_cfg(tmp_path, [{"path": str(d)}]), tok)
    assert str(d) in str(e.value) and "\n" not in str(e.value)


def test_corpus_too_short(tmp_path, tok):
    p = tmp_path / "short.txt"
    p.write_text("alpha beta " * 6)  # ~ one window
    with pytest.raises(DataError, match="too short") as e:
        make_train_iter(make_cfg(tmp_path, [{"path": str(p)}]), tok)
    assert "short.txt" in str(e.value) and "seq_len+1=17" in str(e.value)
    with pytest.raises(DataError, match="too short"):
        make_eval_batches(p, tok, seq_len=1000, batch_size=2)


def test_bad_layout(tmp_path, tok):
    cfg = make_cfg(tmp_path, [make_src(tmp_path, "a", 10)], batch_size=3)
    with pytest.raises(DataError, match="not divisible by process_count 2"):
        make_train_iter(cfg, tok, process_count=2)
    with pytest.raises(DataError, match="node_rank 2"):
        make_train_iter(cfg, tok, node_rank=2, node_count=2)
    with pytest.raises(DataError, match="fewer than the 1000"):
        make_train_iter(cfg, tok, node_rank=999, node_count=1000)


def test_missing_source_path(tmp_path, tok):
    with pytest.raises(DataError, match="data path not found: .*nowhere"):
        make_train_iter(make_cfg(tmp_path, [{"path": str(tmp_path / "nowhere")}]), tok)


# ----------------------------------------------------------------------------- eval, workers


def test_make_eval_batches(tmp_path, tok):
    docs = make_docs(20, 30, 9, "c")
    p = write_jsonl(tmp_path / "eval.jsonl", docs, field="body")
    toks = tokenize_file(p, tok, field="body")
    want = [i for d in docs for i in [tok.bos_id, *tok.encode(d), tok.eos_id]]
    assert toks.tolist() == want
    n = len(toks) // WIN
    batches = make_eval_batches(p, tok, SEQ, 4, field="body")
    got = np.concatenate([b["tokens"] for b in batches])
    np.testing.assert_array_equal(got, toks[: n * WIN].reshape(n, WIN))
    assert batches[-1]["tokens"].shape[0] == (n % 4 or 4)
    dropped = make_eval_batches([p], tok, SEQ, 4, field="body", drop_remainder=True)
    assert len(dropped) == n // 4 and all(b["tokens"].shape == (4, WIN) for b in dropped)


@pytest.mark.processes
def test_worker_processes_match_in_process(tmp_path, tok):
    srcs = [make_src(tmp_path, "a", 40, "a", 0, 0.6), make_src(tmp_path, "b", 40, "b", 1, 0.4)]
    ref = take(make_train_iter(make_cfg(tmp_path, srcs), tok), 6)
    it = make_train_iter(make_cfg(tmp_path, srcs, num_workers=1), tok)
    try:
        got = take(it, 1)
        saved = it.get_state()
        ahead = take(it, 3)  # read past the saved position ...
        it.set_state(saved)  # ... and rewind to it
        resumed = take(it, 5)
    finally:
        it.close()
    assert len(got) == 1 and len(ahead) == 3 and len(resumed) == 5
    assert all(np.array_equal(a, b) for a, b in zip(ref[:4], got + ahead))
    assert all(np.array_equal(a, b) for a, b in zip(ref[1:], resumed)), "set_state did not restore the position"
    assert not np.array_equal(ref[1], ref[4])  # rewinding is observable


@pytest.mark.slow
def test_default_bundled_run(tmp_path_factory):
    cache = shared_dir(tmp_path_factory, "bundled_cache")
    cfg = DataConfig(cache_dir=str(cache), seq_len=64, batch_size=4)  # default corpus + BPE
    tok = load_tokenizer(cfg)
    it = make_train_iter(cfg, tok, process_index=1, process_count=2)
    batch = next(it)["tokens"]
    assert batch.shape == (2, 65) and batch.max() < 4096
    src = it.info["sources"][0]
    assert src["path"] == "bundled" and src["tokens"] > 1_000_000
    assert src["val_windows"] == math.ceil(0.02 * src["windows"])
    assert len(tok.decode(batch[0])) > 100
    assert make_val_batches(cfg, tok, max_batches=2)[1]["tokens"].shape == (4, 65)
