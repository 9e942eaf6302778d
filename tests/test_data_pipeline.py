"""grain pipeline: batches, epochs, exact resume, mixture, node/process shards, validation."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from test_data_helpers import WIN, make_cfg, make_src, take, tiny_tokenizer, windows_of

from intellect_jax.data import (
    DataError,
    MixtureMap,
    make_train_iter,
    make_val_batches,
    mixture_counts,
    prepare_sources,
    train_records,
    val_records,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory)


# ----------------------------------------------------------------------------- batches


def test_batches_shape_dtype_and_doc_markers(tmp_path, tok):
    cfg = make_cfg(tmp_path, [make_src(tmp_path, "a", 50)])
    it = make_train_iter(cfg, tok)
    batches = take(it, 20)
    assert all(b.shape == (4, WIN) and b.dtype == np.int32 for b in batches)
    flat = np.concatenate(batches).ravel()
    assert flat.max() < tok.vocab_size and tok.bos_id in flat and tok.eos_id in flat
    stream = prepare_sources(cfg, tok)[0].stream.read(0, 300)
    assert stream[0] == tok.bos_id and tok.decode(stream[1:12]).startswith("doc0x0:")
    eos_at = int(np.flatnonzero(stream == tok.eos_id)[0])
    assert stream[eos_at + 1] == tok.bos_id  # documents joined as [BOS] doc [EOS] [BOS] doc ...
    no_bos = prepare_sources(make_cfg(tmp_path, [make_src(tmp_path, "a", 50)], add_bos=False), tok)
    arr = no_bos[0].stream.read(0, len(no_bos[0].stream))
    assert tok.bos_id not in arr and tok.eos_id in arr


def test_deterministic_and_seeded(tmp_path, tok):
    src = [make_src(tmp_path, "a", 60)]
    a = take(make_train_iter(make_cfg(tmp_path, src), tok), 8)
    b = take(make_train_iter(make_cfg(tmp_path, src), tok), 8)
    c = take(make_train_iter(make_cfg(tmp_path, src, seed=1), tok), 8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_epochs_are_reshuffled_permutations(tmp_path, tok):
    splits = prepare_sources(make_cfg(tmp_path, [make_src(tmp_path, "a", 40)]), tok)
    n = splits[0].n_train
    recs = train_records(splits, seed=0)
    e0 = [recs[i][1] for i in range(n)]
    e1 = [recs[i][1] for i in range(n, 2 * n)]
    assert sorted(e0) == sorted(e1) == list(range(n)) and e0 != e1


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize(
    "n_docs, k, m, n_sources",
    [
        (6, 3, 14, 1),  # ~23 train windows, batch 4: epoch boundaries inside k and m
        (60, 5, 6, 1),
        (30, 3, 9, 3),  # mixture of three sources
    ],
)
def test_exact_resume(tmp_path, tok, n_docs, k, m, n_sources):
    srcs = [
        make_src(tmp_path, f"s{i}", n_docs * (i + 1), "abc"[i], i, weight=(0.5, 0.3, 0.2)[i])
        for i in range(n_sources)
    ]
    cfg = make_cfg(tmp_path, srcs)
    full = take(make_train_iter(cfg, tok), k + m)
    if n_docs == 6:
        n_train = prepare_sources(cfg, tok)[0].n_train
        assert k * cfg.batch_size < n_train < (k + m) * cfg.batch_size / 2  # crosses epochs
    it = make_train_iter(cfg, tok)
    take(it, k)
    state = json.loads(json.dumps(it.get_state()))
    assert state["step"] == k
    rest = take(it, m)
    fresh = make_train_iter(cfg, tok)
    fresh.set_state(state)
    again = take(fresh, m)
    for want, a, b in zip(full[k:], rest, again):
        np.testing.assert_array_equal(want, a)
        np.testing.assert_array_equal(want, b)
    it.set_state(state)  # rewinding an iterator that is already running also works
    np.testing.assert_array_equal(next(it)["tokens"], full[k])


def test_resume_refuses_other_pipeline(tmp_path, tok):
    src = [make_src(tmp_path, "a", 40)]
    state = make_train_iter(make_cfg(tmp_path, src), tok).get_state()
    for other in (make_cfg(tmp_path, src, seq_len=8), make_cfg(tmp_path, src, seed=3)):
        with pytest.raises(DataError, match="different data pipeline"):
            make_train_iter(other, tok).set_state(state)
    with pytest.raises(DataError, match="different data pipeline"):
        make_train_iter(make_cfg(tmp_path, src), tok, node_rank=1, node_count=2).set_state(state)
    with pytest.raises(DataError, match="unsupported"):
        make_train_iter(make_cfg(tmp_path, src), tok).set_state({"step": 3})


# ----------------------------------------------------------------------------- mixture


def test_mixture_weights_honoured(tmp_path, tok):
    weights = (0.55, 0.3, 0.15)
    srcs = [make_src(tmp_path, f"m{i}", (20, 60, 40)[i], "abc"[i], i, weights[i]) for i in range(3)]
    cfg = make_cfg(tmp_path, srcs)
    splits = prepare_sources(cfg, tok)
    sel = MixtureMap(mixture_counts(weights), seed=7)
    n = 20_000
    counts = np.bincount([sel[i][0] for i in range(n)], minlength=3)
    for s, w in enumerate(weights):
        sigma = math.sqrt(n * w * (1 - w))
        assert abs(counts[s] - n * w) < 4 * sigma, (s, counts)
    for q in (0, 7):  # every period of ~1000 windows holds exactly the weighted counts
        part = np.bincount([sel[i][0] for i in range(q * sel.period, (q + 1) * sel.period)])
        assert sel.period == 1000 and part.tolist() == [550, 300, 150]
    recs = train_records(splits, seed=7)
    picks = [recs[i] for i in range(1500)]
    assert [s for s, _ in picks] == [sel[i][0] for i in range(1500)]
    for s, sp in enumerate(splits):  # each source walks through whole epochs of its windows
        seq = [w for src, w in picks if src == s][: sp.n_train]
        assert sorted(seq) == list(range(sp.n_train))
    # the batches hold exactly those records' windows
    it = make_train_iter(cfg.model_copy(update={"seed": 7}), tok)
    for b in range(3):
        batch = next(it)["tokens"]
        for row, (s, w) in zip(batch, picks[b * 4 : (b + 1) * 4]):
            np.testing.assert_array_equal(row, splits[s].stream.read(w * WIN, WIN))


# ----------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("node_count, process_count", [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_node_and_process_shards_disjoint(tmp_path, tok, node_count, process_count):
    cfg = make_cfg(tmp_path, [make_src(tmp_path, "a", 80)], batch_size=2 * process_count)
    splits = prepare_sources(cfg, tok)
    n_train = splits[0].n_train
    seen = []
    for shard in range(node_count):
        size = len(range(shard, n_train, node_count))
        recs = train_records(splits, seed=0, shard_index=shard, shard_count=node_count)
        first_epoch = {recs[i][1] for i in range(size)}
        assert (
            len(first_epoch) == size and {recs[i][1] for i in range(size, 3 * size)} == first_epoch
        )
        seen.append(first_epoch)
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(seen, 2))
    assert set().union(*seen) == set(range(n_train))
    # token level, through the public iterator: within an epoch no window appears on two hosts
    stream = splits[0].stream
    all_windows = {tuple(stream.read(w * WIN, WIN)) for w in range(splits[0].n_windows)}
    assert len(all_windows) == splits[0].n_windows  # windows are distinct, so the check bites
    n_batches = (n_train // node_count) // cfg.batch_size  # batches in one node epoch
    per_host = []
    for node in range(node_count):
        whole = take(make_train_iter(cfg, tok, node_rank=node, node_count=node_count), n_batches)
        rows = []
        for proc in range(process_count):
            it = make_train_iter(cfg, tok, node_rank=node, node_count=node_count,
                                 process_index=proc, process_count=process_count)
            assert it.info["host_batch"] == 2
            got = take(it, n_batches)
            per_host.append(set(windows_of(got)))
            rows.append(got)
        # the hosts' rows put side by side are the node batch a single host would read
        for b in range(n_batches):
            np.testing.assert_array_equal(np.concatenate([r[b] for r in rows]), whole[b])
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(per_host, 2))


def test_mixture_shards_disjoint(tmp_path, tok):
    srcs = [make_src(tmp_path, "a", 40, "a", 0, 2.0), make_src(tmp_path, "b", 60, "b", 1, 1.0)]
    splits = prepare_sources(make_cfg(tmp_path, srcs), tok)
    sets = [
        {train_records(splits, seed=0, shard_index=i, shard_count=3)[j] for j in range(250)}
        for i in range(3)
    ]
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(sets, 2))


# ----------------------------------------------------------------------------- validation


def test_validation_split_disjoint_from_training(tmp_path, tok):
    srcs = [make_src(tmp_path, "a", 60, "a", 0, 0.7), make_src(tmp_path, "b", 40, "b", 1, 0.3)]
    cfg = make_cfg(tmp_path, srcs)
    splits = prepare_sources(cfg, tok)
    for sp in splits:
        assert sp.n_val == math.ceil(0.1 * sp.n_windows) and sp.n_train + sp.n_val == sp.n_windows
    train_ds, val_ds = train_records(splits, seed=0), val_records(splits)
    train = {train_ds[i] for i in range(1500)}
    val = {val_ds[i] for i in range(300)}
    assert val == {(s, w) for s, sp in enumerate(splits) for w in range(sp.n_train, sp.n_windows)}
    assert train == {(s, w) for s, sp in enumerate(splits) for w in range(sp.n_train)}
    assert train.isdisjoint(val)
    val_windows = set(windows_of(b["tokens"] for b in make_val_batches(cfg, tok)))
    train_windows = set(windows_of(take(make_train_iter(cfg, tok), 100)))
    assert val_windows and val_windows.isdisjoint(train_windows)


def test_val_batches_deterministic_and_split_over_processes(tmp_path, tok):
    cfg = make_cfg(tmp_path, [make_src(tmp_path, "a", 100)], batch_size=4)
    v = make_val_batches(cfg, tok)
    n_val = prepare_sources(cfg, tok)[0].n_val
    assert len(v) == max(1, n_val // 4) and all(b["tokens"].shape == (4, WIN) for b in v)
    again = make_val_batches(cfg, tok, node_rank=1, node_count=2)  # same on every node
    assert len(again) == len(v)
    assert all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(v, again))
    halves = [
        make_val_batches(cfg, tok, max_batches=3, process_index=p, process_count=2)
        for p in range(2)
    ]
    for b in range(3):
        np.testing.assert_array_equal(
            np.concatenate([halves[0][b]["tokens"], halves[1][b]["tokens"]]), v[b]["tokens"]
        )
    assert len(make_val_batches(cfg, tok, max_batches=7)) == 7


def test_resume_survives_moving_data_and_cache(tmp_path, tok):
    import shutil

    src = make_src(tmp_path, "a", 40)
    it = make_train_iter(make_cfg(tmp_path, [src]), tok)
    take(it, 3)
    state, want = it.get_state(), next(it)["tokens"]
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(src["path"], moved / "renamed.jsonl")
    cfg2 = make_cfg(moved, [{"path": str(moved / "renamed.jsonl")}])  # new cache dir too
    it2 = make_train_iter(cfg2, tok)
    it2.set_state(state)
    np.testing.assert_array_equal(next(it2)["tokens"], want)


def test_a_leased_iterator_yields_exactly_the_stream_s_batches_it_was_told(tmp_path, tok):
    """Data leases: the node's stream is the whole stream; a lease of [a, b) ranges yields those
    global batches in order and then refuses (the next round's lease comes first); its state
    resumes inside the lease; every process layout names the same stream."""
    srcs = [make_src(tmp_path, "s0", 30, "a", 0, weight=0.6), make_src(tmp_path, "s1", 20, "b", 1, weight=0.4)]
    cfg = make_cfg(tmp_path, srcs)
    stream = take(make_train_iter(cfg, tok), 12)  # global batches 0..11
    it = make_train_iter(cfg, tok)
    it.lease([(6, 8), (2, 3)])
    got = take(it, 2)
    state = json.loads(json.dumps(it.get_state()))
    got += take(it, 1)
    for g, want in zip(got, [6, 7, 2]):
        np.testing.assert_array_equal(g, stream[want])
    with pytest.raises(DataError, match="the leased batches .* are used up"):
        next(it)
    fresh = make_train_iter(cfg, tok)
    fresh.set_state(state)  # resumed inside the lease: batch 2 is next
    np.testing.assert_array_equal(next(fresh)["tokens"], stream[2])
    it.lease([(11, 12)])
    np.testing.assert_array_equal(next(it)["tokens"], stream[11])
    with pytest.raises(DataError, match="non-empty"):
        it.lease([(3, 3)])
    bad = {**state, "plan": [[2, 1]]}
    with pytest.raises(DataError, match="plan is not"):
        fresh.set_state(bad)
    halves = [make_train_iter(cfg, tok, process_index=i, process_count=2) for i in range(2)]
    assert halves[0].stream == halves[1].stream == it.stream and halves[0].fingerprint != it.fingerprint
    for i, half in enumerate(halves):  # each process of a 2-process node: its rows of the leased batches
        half.lease(((6, 8),))  # (as the lead's command carries them: tuples)
        h = len(stream[6]) // 2
        for g, want in zip(take(half, 2), [6, 7]):
            np.testing.assert_array_equal(g, stream[want][i * h:(i + 1) * h])
        half.set_state(json.loads(json.dumps(half.get_state())) | {"plan": ((6, 8),)})
    other = make_train_iter(make_cfg(tmp_path, srcs, seed=cfg.seed + 1), tok)
    assert other.stream != it.stream


def test_a_leased_iterator_reads_with_threads_not_a_pool_spawned_per_round(tmp_path, tok):
    """num_workers > 0: a pool of worker processes would be spawned again at every round's
    lease (2.3 s each on the debug data, measured): leased rounds read with threads."""
    import multiprocessing

    srcs = [make_src(tmp_path, "s0", 30, "a", 0)]
    cfg = make_cfg(tmp_path, srcs, num_workers=2)
    want = take(make_train_iter(make_cfg(tmp_path, srcs), tok), 4)
    it = make_train_iter(cfg, tok)
    try:
        for r in range(2):
            it.lease([(2 * r, 2 * r + 2)])
            for b in (2 * r, 2 * r + 1):
                np.testing.assert_array_equal(next(it)["tokens"], want[b])
            assert not multiprocessing.active_children()
    finally:
        it.close()
