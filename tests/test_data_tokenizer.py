"""Tokenizer: deterministic BPE, bundled cache, loading, vocab check, HF export, shard dtypes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_data_helpers import make_docs, shared_dir

from intellect_jax.data import (
    BOS_TOKEN,
    EOS_TOKEN,
    DataConfig,
    DataError,
    TokenStream,
    bundled_tokenizer,
    check_vocab,
    load_tokenizer,
    load_tokenizer_file,
    save_hf_tokenizer,
    token_dtype,
    train_bpe,
)
from intellect_jax.data.cache import read_shard, write_shard


@pytest.fixture(scope="module")
def small_tok_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(make_docs(200, 40), 320).save(str(path))
    return path


def test_bpe_training_is_deterministic():
    docs = make_docs(300, 50, seed=1) + make_docs(300, 50, seed=2, vocab="b")
    a = train_bpe(docs, 400).to_str()
    b = train_bpe(docs, 400).to_str()
    assert a == b
    vocab = json.loads(a)["model"]["vocab"]
    assert len(vocab) == 400 and vocab[BOS_TOKEN] == 0 and vocab[EOS_TOKEN] == 1


# sha256 of the bundled BPE's tokenizer.json (default vocab 4096), recorded with tokenizers
# 0.23.3 and identical with RAYON_NUM_THREADS=1, 2 and 4: the same bytes on every run.
GOLDEN_BUNDLED_4096 = ("0.23.3", "2b0a6497f7475e3c8acc3dfa83035a2c23d7ace771d2c8377b9a2153b639cd1e")


@pytest.mark.slow
def test_bundled_tokenizer_deterministic_and_cached(tmp_path_factory):
    import hashlib

    import tokenizers

    c1 = shared_dir(tmp_path_factory, "bundled_cache")  # also used by test_data_pipeline.py
    t1 = bundled_tokenizer(4096, c1)
    # retrained from scratch (no cache) in a fresh directory: the same bytes, on any version
    t2 = bundled_tokenizer(4096, tmp_path_factory.mktemp("bundled_fresh"))
    assert t2.json == t1.json
    if tokenizers.__version__ == GOLDEN_BUNDLED_4096[0]:
        assert hashlib.sha256(t1.json.encode()).hexdigest() == GOLDEN_BUNDLED_4096[1]
    cached = list((c1 / "tokenizers").glob("bpe4096-*.json"))
    assert len(cached) == 1 and cached[0].read_text() == t1.json
    mtime = cached[0].stat().st_mtime_ns
    t3 = load_tokenizer(DataConfig(cache_dir=str(c1)))
    assert t3.json == t1.json and cached[0].stat().st_mtime_ns == mtime
    assert (t1.bos_id, t1.eos_id, t1.vocab_size) == (0, 1, 4096)
    text = "To be, or not to be, that is the question."
    ids = t1.encode(text)
    assert t1.decode(ids) == text and t1.bos_id not in ids
    # encode(add_special_tokens=True) on the raw tokenizer prepends BOS, like Llama-3
    assert t1.tokenizer.encode(text).ids == [t1.bos_id] + ids


def test_special_token_text_is_not_special_in_data(small_tok_path):
    tok = load_tokenizer_file(small_tok_path)
    text = f"a {EOS_TOKEN} b"
    ids = tok.encode(text)
    assert tok.eos_id not in ids and tok.bos_id not in ids
    assert tok.decode(ids) == text  # encoded as plain text, not dropped


def test_load_tokenizer_file_and_dir(small_tok_path):
    a = load_tokenizer_file(small_tok_path)
    b = load_tokenizer(DataConfig(tokenizer=str(small_tok_path.parent)))
    assert a.fingerprint == b.fingerprint == load_tokenizer(str(small_tok_path)).fingerprint
    assert a.vocab_size == a.tokenizer.get_vocab_size() <= 320
    assert (a.bos_token, a.eos_token) == (BOS_TOKEN, EOS_TOKEN)


def test_tokenizer_specials_from_config_and_fallback(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<my_bos>", "<my_eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    gpt2 = load_tokenizer_file(tmp_path)  # GPT-2 style: <|endoftext|> is BOS and EOS
    assert gpt2.bos_id == gpt2.eos_id == tok.token_to_id("<|endoftext|>")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<my_bos>"}, "eos_token": "<my_eos>"})
    )
    custom = load_tokenizer_file(tmp_path)
    assert (custom.bos_token, custom.eos_token) == ("<my_bos>", "<my_eos>")


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="tokenizer not found: .*missing"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing")))
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(DataError, match="cannot load tokenizer") as e:
        load_tokenizer_file(tmp_path / "tokenizer.json")
    assert "\n" not in str(e.value)
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="no EOS token"):
        load_tokenizer_file(tmp_path)


def test_check_vocab(small_tok_path):
    check_vocab(4096, 4096)
    tok = load_tokenizer_file(small_tok_path)
    check_vocab(tok, tok.vocab_size)
    with pytest.raises(DataError) as e:
        check_vocab(128256, 4096)
    assert "128256" in str(e.value) and "4096" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match=str(tok.vocab_size)):
        check_vocab(tok, tok.vocab_size - 1)


def test_pickle_roundtrip(small_tok_path):
    import pickle

    tok = load_tokenizer_file(small_tok_path)
    tok2 = pickle.loads(pickle.dumps(tok))
    assert tok2.fingerprint == tok.fingerprint and tok2.encode("alpha beta") == tok.encode(
        "alpha beta"
    )
    assert (tok2.bos_id, tok2.eos_id, tok2.vocab_size) == (tok.bos_id, tok.eos_id, tok.vocab_size)


def test_hf_export_roundtrip(small_tok_path, tmp_path):
    tok = load_tokenizer_file(small_tok_path)
    out = save_hf_tokenizer(tok, tmp_path / "hf", model_max_length=512)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["bos_token"] == BOS_TOKEN and cfg["eos_token"] == EOS_TOKEN
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == EOS_TOKEN
    assert load_tokenizer_file(out).fingerprint == tok.fingerprint


def test_hf_autotokenizer_loads_export(small_tok_path, tmp_path):
    import transformers  # installed in CI: a broken install must fail, not skip

    tok = load_tokenizer_file(small_tok_path)
    out = save_hf_tokenizer(tok, tmp_path / "hf")
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf.bos_token_id == tok.bos_id and hf.eos_token_id == tok.eos_id
    assert len(hf) == tok.vocab_size
    for text in ["alpha beta gamma.", "  Odd   spacing\n\nand lines ", "ünïcödé and 123"]:
        assert hf(text)["input_ids"] == tok.tokenizer.encode(text).ids
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
        assert hf.decode(tok.encode(text)) == tok.decode(tok.encode(text))


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    "vocab, dtype",
    [
        (256, np.uint16),
        (4096, np.uint16),
        (65535, np.uint16),
        (65536, np.uint16),
        (65537, np.uint32),
        (128256, np.uint32),
    ],
)
def test_token_dtype(vocab, dtype):
    assert token_dtype(vocab) == np.dtype(dtype)


def test_uint32_shard_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    runs = [rng.integers(0, 128256, size=n) for n in (1000, 0, 777)]
    shard = write_shard(tmp_path / "s", iter(runs), token_dtype(128256), {"file": "synthetic"})
    assert shard.dtype == "uint32" and shard.n_tokens == 1777
    assert read_shard(tmp_path / "s") == shard
    arr = shard.array()
    assert isinstance(arr, np.memmap) and arr.dtype == np.uint32
    np.testing.assert_array_equal(arr, np.concatenate(runs))
    assert arr.max() > 65535
    with pytest.raises(DataError, match="out of range"):
        write_shard(tmp_path / "t", iter([np.array([70000])]), np.dtype(np.uint16), {"file": "f"})
    assert not (tmp_path / "t").exists()


def test_token_stream_reads_across_shards(tmp_path):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    sizes = [5, 0, 3, 11, 1]
    parts = [np.arange(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
    shards = [
        write_shard(tmp_path / f"s{i}", iter([p]), np.dtype(np.uint16), {})
        for i, p in enumerate(parts)
    ]
    stream = TokenStream(shards)
    assert len(stream) == sum(sizes)

    @settings(max_examples=30, deadline=None)
    @given(st.integers(0, sum(sizes)), st.integers(0, sum(sizes)))
    def check(start, length):
        if start + length > len(stream):
            with pytest.raises(IndexError):
                stream.read(start, length)
        else:
            got = stream.read(start, length)
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, np.arange(start, start + length))

    check()
