"""HF interop: transformers <-> ours logits, sharded files and models, tokenizer, errors."""

import json
import os
import struct

import jax
import numpy as np
import pytest
import torch  # installed in CI: a broken install must fail, not skip
import transformers
from flax import nnx
from safetensors.numpy import save_file

from intellect_jax.model import hf, sharding
from intellect_jax.model.config import ModelConfig
from intellect_jax.model.hf import HFFormatError, export_hf, import_hf
from intellect_jax.model.llama import Llama, build

V, D, F, LAYERS, HEADS = 256, 64, 128, 2, 4
TOK = np.random.default_rng(0).integers(0, V, size=(2, 24))
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, hidden_size=D, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=2,
                ffn_size=F, rope_theta=1e4, max_seq_len=64, compute_dtype="float32", init_std=0.1)
    return ModelConfig.create(**{**base, **kw})


def _randomize(model: Llama, seed: int = 1) -> Llama:
    """Every param random, norms included (init leaves them at 1), so a swapped name shows."""
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    new = [(1.0 if x.ndim == 1 else 0.0) + 0.1 * rng.standard_normal(x.shape).astype(np.float32)
           for x in leaves]
    nnx.update(model, jax.tree.unflatten(tree, new))
    return model


def _ours(model: Llama) -> np.ndarray:
    return np.asarray(model(TOK))


def _theirs(path, **kw) -> tuple[np.ndarray, dict]:
    m, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, dtype=torch.float32, **kw)
    m.eval()
    with torch.no_grad():
        return m(torch.tensor(TOK)).logits.numpy(), info


def _hf_model(tmp_path, *, tied, kv, head_dim=None, rope=None, bf16=False):
    torch.manual_seed(0)
    c = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=kv, head_dim=head_dim,
        max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.1,
        tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 5e5, **(rope or {})})
    m = transformers.LlamaForCausalLM(c).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    if bf16:
        m = m.to(torch.bfloat16)
    d = tmp_path / "hf"
    m.save_pretrained(d)
    return d


@pytest.mark.parametrize(
    "tied,kv,head_dim,rope,bf16",
    [
        (True, 2, None, {"rope_type": "llama3", **LLAMA3}, False),  # GQA + Llama-3.1 rope, tied
        (False, 4, 32, None, True),  # MHA, head_dim != D/N, untied, bf16 weights
    ],
)
def test_hf_checkpoint_imports_with_equal_logits(tmp_path, tied, kv, head_dim, rope, bf16):
    d = _hf_model(tmp_path, tied=tied, kv=kv, head_dim=head_dim, rope=rope, bf16=bf16)
    model, cfg = import_hf(d, overrides={"compute_dtype": "float32"})
    assert cfg.tie_embeddings is tied and cfg.num_kv_heads == kv
    assert (cfg.rope_scaling is not None) == (rope is not None)
    want, _ = _theirs(d)
    np.testing.assert_allclose(_ours(model), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "tied,kv,rope,shard_bytes",
    [
        (True, 2, LLAMA3, 5 * 2**30),  # GQA + rope scaling, tied, single file
        (False, 2, None, 40_000),  # untied, several shards + index
        (False, 4, None, 5 * 2**30),  # MHA, untied
    ],
)
def test_export_loads_in_transformers(tmp_path, tied, kv, rope, shard_bytes):
    cfg = _cfg(tie_embeddings=tied, num_kv_heads=kv, rope_scaling=rope)
    model = _randomize(build(cfg))
    out = export_hf(model, cfg, tmp_path / "out", max_shard_bytes=shard_bytes, bos_id=0, eos_id=1)
    files = sorted(os.listdir(out))
    if shard_bytes < 2**20:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) > 2 and hf.INDEX in files and hf.SINGLE not in files
        index = json.loads((out / hf.INDEX).read_text())
        assert set(index["weight_map"].values()) == set(shards)
        assert index["metadata"]["total_size"] == 4 * cfg.num_params()
    else:
        assert hf.SINGLE in files and hf.INDEX not in files
    assert ("lm_head.weight" in dict(hf.hf_tensors(out))) is not tied
    want, info = _theirs(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(_ours(model), want, atol=1e-4, rtol=0)
    back, cfg2 = import_hf(out, overrides={"compute_dtype": "float32"})
    assert cfg2 == cfg
    np.testing.assert_array_equal(_ours(back), _ours(model))


def test_bf16_export(tmp_path):
    cfg = _cfg()
    model = _randomize(build(cfg))
    out = export_hf(model, cfg, tmp_path / "out", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(a.dtype == np.dtype("bfloat16") for _, a in hf.hf_tensors(out))
    back, _ = import_hf(out)
    q = np.asarray(model.layers.attn.wq_DxNxH[1])
    np.testing.assert_array_equal(np.asarray(back.layers.attn.wq_DxNxH[1]),
                                  q.astype("bfloat16").astype(np.float32))
    theirs, info = _theirs(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # the same bf16-rounded weights, both computed in fp32: equal logits
    back32, _ = import_hf(out, overrides={"compute_dtype": "float32"})
    np.testing.assert_allclose(_ours(back32), theirs, atol=1e-4, rtol=0)
    # against the fp32 original (and our bf16 compute): within bf16 rounding (~1% of the logit scale)
    tol = 0.03 * float(np.abs(theirs).max())
    np.testing.assert_allclose(_ours(model), theirs, atol=tol, rtol=0)
    np.testing.assert_allclose(_ours(back), theirs, atol=tol, rtol=0)


def test_sharded_model_export_import(tmp_path):
    cfg = _cfg(num_kv_heads=2)
    mesh = sharding.make_mesh(fsdp=4, tp=2)
    model = sharding.init_sharded(lambda: Llama(cfg, rngs=nnx.Rngs(params=0)), mesh)
    out = export_hf(model, cfg, tmp_path / "out", max_shard_bytes=60_000)
    back, _ = import_hf(out, overrides={"compute_dtype": "float32"}, mesh=mesh)
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                              nnx.to_flat_state(nnx.state(back, nnx.Param)), strict=True):
        assert b.get_value().sharding == a.get_value().sharding, p
        np.testing.assert_array_equal(np.asarray(b.get_value()), np.asarray(a.get_value()))
    fwd = nnx.jit(lambda m, t: m(t))
    with jax.set_mesh(mesh):
        np.testing.assert_array_equal(np.asarray(fwd(back, TOK)), np.asarray(fwd(model, TOK)))


def test_tokenizer_export(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    lines = ["the quick brown fox jumps over the lazy dog", "DiLoCo trains Llama in JAX",
             "hello world, hello tokens!"] * 4
    tk.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=[bos, eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tk.token_to_id(bos))])
    src = tmp_path / "tok"
    src.mkdir()
    tk.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}))
    (src / "special_tokens_map.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    cfg = _cfg(vocab_size=320)
    out = export_hf(build(cfg), cfg, tmp_path / "out", tokenizer_dir=src)
    conf = json.loads((out / "config.json").read_text())
    assert (conf["bos_token_id"], conf["eos_token_id"]) == (tk.token_to_id(bos), tk.token_to_id(eos))
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["the lazy fox says hello", "unseen wörds ✓ 123", ""]:
        assert auto(text)["input_ids"] == tk.encode(text).ids
    assert auto.bos_token == bos and auto.eos_token == eos


# ---- errors --------------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path):
    cfg = _cfg()
    return export_hf(build(cfg), cfg, tmp_path / "ckpt"), cfg


def _rewrite(path, drop=(), add=None, reshape=None):
    tensors = dict(hf.hf_tensors(path.parent))
    for k in drop:
        tensors.pop(k)
    tensors.update(add or {})
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def _corrupt(path):
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + b"{not json" + raw[17:])


def _no_header(path):
    path.write_bytes(struct.pack("<Q", 10**9) + b"{}")


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda d: (d / "config.json").unlink(), "config.json: missing"),
        (lambda d: (d / hf.SINGLE).unlink(), "no model.safetensors"),
        (lambda d: _corrupt(d / hf.SINGLE), "model.safetensors: corrupt"),
        (lambda d: _no_header(d / hf.SINGLE), "model.safetensors: truncated or corrupt"),
        (lambda d: (d / hf.SINGLE).write_bytes((d / hf.SINGLE).read_bytes()[:-100]),
         "model.safetensors: truncated"),
        (lambda d: (d / hf.SINGLE).write_bytes(b"abc"), "model.safetensors: truncated"),
        (lambda d: _rewrite(d / hf.SINGLE, drop=["model.layers.1.mlp.up_proj.weight"]),
         "missing tensor model.layers.1.mlp.up_proj.weight"),
        (lambda d: _rewrite(d / hf.SINGLE, add={"model.layers.0.extra.bias": np.zeros(3, np.float32)}),
         "unexpected tensor model.layers.0.extra.bias"),
        (lambda d: _rewrite(d / hf.SINGLE, reshape="model.layers.0.self_attn.k_proj.weight"),
         r"model.layers.0.self_attn.k_proj.weight has shape \(31, 64\), expected \(32, 64\)"),
        (lambda d: _set_conf(d, intermediate_size=96), r"mlp.gate_proj.weight has shape"),
        (lambda d: _set_conf(d, hidden_size=None), "config.json: missing key 'hidden_size'"),
    ],
)
def test_import_errors(ckpt, damage, match):
    d, _ = ckpt
    damage(d)
    with pytest.raises(HFFormatError, match=match):
        import_hf(d)


def _set_conf(d, **kw):
    conf = json.loads((d / "config.json").read_text())
    for k, v in kw.items():
        conf.pop(k) if v is None else conf.__setitem__(k, v)
    (d / "config.json").write_text(json.dumps(conf))


def test_import_errors_dir_and_shards(tmp_path):
    with pytest.raises(HFFormatError, match="nope: not a directory"):
        import_hf(tmp_path / "nope")
    cfg = _cfg()
    out = export_hf(build(cfg), cfg, tmp_path / "out", max_shard_bytes=60_000)
    shard = sorted(f for f in os.listdir(out) if f.startswith("model-"))[1]
    (out / shard).unlink()
    with pytest.raises(HFFormatError, match=f"{shard}: safetensors file missing"):
        import_hf(out)


def test_tied_lm_head_must_equal_embed(ckpt):
    d, _ = ckpt
    tied = _cfg(tie_embeddings=True)
    out = export_hf(build(tied), tied, d.parent / "tied")
    emb = dict(hf.hf_tensors(out))["model.embed_tokens.weight"]
    fp32 = {"compute_dtype": "float32"}
    ref = _ours(build(tied))
    np.testing.assert_array_equal(_ours(import_hf(out, overrides=fp32)[0]), ref)
    _rewrite(out / hf.SINGLE, add={"lm_head.weight": emb.copy()})
    back, cfg = import_hf(out, overrides=fp32)  # an equal copy is accepted ...
    assert cfg.tie_embeddings  # ... as the tied model it is, with the same outputs
    np.testing.assert_array_equal(_ours(back), ref)
    _rewrite(out / hf.SINGLE, add={"lm_head.weight": emb + 1})
    with pytest.raises(HFFormatError, match="lm_head.weight differs"):
        import_hf(out)


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    cfg = _cfg()
    model = build(cfg)
    calls = []

    def boom(x, n_in):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("disk full")
        return real(x, n_in)

    real = hf._to_hf
    monkeypatch.setattr(hf, "_to_hf", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        export_hf(model, cfg, tmp_path / "out")
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(hf, "_to_hf", real)
    out = export_hf(model, cfg, tmp_path / "out")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(model, cfg, out)
    before = (out / hf.SINGLE).read_bytes()
    calls.clear()
    monkeypatch.setattr(hf, "_to_hf", boom)
    with pytest.raises(RuntimeError):
        export_hf(_randomize(build(cfg)), cfg, out, overwrite=True)
    assert os.listdir(tmp_path) == ["out"] and (out / hf.SINGLE).read_bytes() == before
    monkeypatch.setattr(hf, "_to_hf", real)
    export_hf(_randomize(build(cfg)), cfg, out, overwrite=True)
    assert os.listdir(tmp_path) == ["out"] and (out / hf.SINGLE).read_bytes() != before


def test_export_accepts_state_and_pure_dict(tmp_path):
    cfg = _cfg()
    model = _randomize(build(cfg))
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    host = jax.tree.map(np.asarray, pure)  # as restored to host memory
    ref = export_hf(model, cfg, tmp_path / "m")
    for i, params in enumerate([state, pure, host]):
        out = export_hf(params, cfg, tmp_path / f"p{i}")
        assert (out / hf.SINGLE).read_bytes() == (ref / hf.SINGLE).read_bytes()


def test_export_checks_params_match_cfg(tmp_path):
    with pytest.raises(ValueError, match="head_DxV"):
        export_hf(build(_cfg(tie_embeddings=True)), _cfg(), tmp_path / "out")
    assert not (tmp_path / "out").exists()
