"""Readers (.txt/.txt.gz/.jsonl/.jsonl.gz/.parquet, directories, bundled) and config validation."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pytest

from intellect_jax.data import (
    DataConfig,
    DataError,
    SourceConfig,
    iter_documents,
    mixture_counts,
    resolve_files,
)
from intellect_jax.data.sources import file_identity, file_kind


def test_txt_and_gz_text(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\nsecond line\n")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as fh:
        fh.write("gzipped doc é\n")
    assert list(iter_documents(tmp_path / "a.txt")) == ["hello world\nsecond line\n"]
    assert list(iter_documents(tmp_path / "b.txt.gz")) == ["gzipped doc é\n"]


def test_jsonl_field_and_gz(tmp_path):
    rows = [{"body": "first", "text": "x"}, {"body": "second"}, {"body": None}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(iter_documents(tmp_path / "d.jsonl", field="body")) == ["first", "second"]
    with gzip.open(tmp_path / "e.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"content": "zipped"}) + "\n")
    assert list(iter_documents(tmp_path / "e.jsonl.gz", field="content")) == ["zipped"]


def test_parquet_column(tmp_path):
    table = pa.table({"id": [1, 2, 3], "content": ["p one", None, "p three"]})
    pq.write_table(table, tmp_path / "f.parquet", row_group_size=2)
    assert list(iter_documents(tmp_path / "f.parquet", field="content")) == ["p one", "p three"]


def test_directory_recursive_sorted_and_filtered(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b.txt").write_text("B")
    (tmp_path / "sub" / "a.jsonl").write_text(json.dumps({"text": "A"}) + "\n")
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / ".hidden" / "c.txt").write_text("hidden")
    pq.write_table(pa.table({"text": ["C"]}), tmp_path / "c.parquet")
    files = resolve_files(tmp_path)
    assert [f.name for f in files] == ["b.txt", "c.parquet", "a.jsonl"]
    assert list(iter_documents(tmp_path)) == ["B", "C", "A"]


def test_bundled_corpus():
    files = resolve_files("bundled")
    assert len(files) == 1 and files[0].stat().st_size < 4 << 20
    docs = list(iter_documents("bundled"))
    assert len(docs) == 42
    assert sum(map(len, docs)) > 4_000_000
    assert any(d.startswith("HAMLET") for d in docs)
    assert (files[0].parent / "README.md").read_text().count("public domain") >= 1


def test_file_kind_and_identity(tmp_path):
    assert file_kind("x.TXT") == "txt" and file_kind("x.jsonl.gz") == "jsonl"
    assert file_kind("x.parquet") == "parquet" and file_kind("x.csv") is None
    p = tmp_path / "a.txt"
    p.write_text("abc")
    q = tmp_path / "b.txt"
    q.write_text("abc")
    assert file_identity(p) == file_identity(q)  # small files: content hash
    q.write_text("abd")
    assert file_identity(p) != file_identity(q)


# ----------------------------------------------------------------------------- bad input


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_path(tmp_path):
    with pytest.raises(DataError) as e:
        resolve_files(tmp_path / "nope")
    assert "not found" in _one_line(e) and "nope" in str(e.value)


def test_unknown_file_type(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError) as e:
        list(iter_documents(tmp_path / "data.csv"))
    assert "unknown file type" in _one_line(e) and "data.csv" in str(e.value)


def test_empty_directory(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(DataError) as e:
        resolve_files(tmp_path)
    msg = _one_line(e)
    assert msg.startswith("no data files (") and ".jsonl" in msg, msg
    assert msg.endswith(f") under directory {str(tmp_path)!r}"), msg


def test_jsonl_missing_field(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(DataError) as e:
        list(iter_documents(p))
    msg = _one_line(e)
    assert "d.jsonl:2" in msg and "'text'" in msg and "missing field" in msg


def test_jsonl_invalid_and_non_string(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("{not json}\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: invalid JSON"):
        list(iter_documents(p))
    p.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(DataError, match="expected a string"):
        list(iter_documents(p))


def test_parquet_missing_column(tmp_path):
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "f.parquet")
    with pytest.raises(DataError) as e:
        list(iter_documents(tmp_path / "f.parquet", field="text"))
    msg = _one_line(e)
    assert "f.parquet" in msg and "'text'" in msg and "content" in msg


def test_parquet_non_string_column(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match="expected string"):
        list(iter_documents(tmp_path / "n.parquet"))


def test_corrupt_gzip(tmp_path):
    (tmp_path / "x.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError) as e:
        list(iter_documents(tmp_path / "x.txt.gz"))
    msg = _one_line(e)
    assert msg.startswith(f"cannot read {str(tmp_path / 'x.txt.gz')!r}: Not a gzipped file"), msg


def test_mixture_weights_non_positive():
    with pytest.raises(DataError) as e:
        mixture_counts([0.5, 0.0], ["web", "code"])
    assert "'code'" in _one_line(e) and "> 0" in str(e.value)
    with pytest.raises(DataError, match="'web'"):
        mixture_counts([-1.0, 1.0], ["web", "code"])
    # the config refuses it up front too, naming the field
    with pytest.raises(pydantic.ValidationError, match="weight"):
        SourceConfig(path="x", weight=0)


# ----------------------------------------------------------------------------- config


def test_config_defaults_and_frozen():
    cfg = DataConfig(cache_dir="/tmp/x")
    assert cfg.sources == [SourceConfig(path="bundled", field="text", weight=1.0)]
    assert cfg.tokenizer == "bundled" and cfg.add_bos and cfg.num_workers == 0
    with pytest.raises(pydantic.ValidationError):
        cfg.seq_len = 3  # frozen
    assert DataConfig.model_validate_json(cfg.model_dump_json()) == cfg


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seq_len": 0}, "seq_len"),
        ({"batch_size": -2}, "batch_size"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"bpe_vocab_size": 100}, "bpe_vocab_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"seed": -1}, "seed"),
        ({"sources": []}, "sources"),
        ({"bogus": 1}, "bogus"),
        ({"sources": [{"path": "x", "weight": -1}]}, "weight"),
        ({"sources": [{"path": "x", "colum": "t"}]}, "colum"),
    ],
)
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(pydantic.ValidationError) as e:
        DataConfig(**kwargs)
    assert field in str(e.value)
