"""Model: sharded == unsharded, causality, counts, presets, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ref_loss

from intellect_jax.model import sharding as S
from intellect_jax.model.config import ConfigError, ModelConfig
from intellect_jax.model.llama import Llama, build, rope_inv_freq
from intellect_jax.trainer.loss import head_loss

CFG = ModelConfig.preset("debug", compute_dtype="float32")


def _loss_and_grads(model, tokens):
    def f(m):
        return ref_loss(m(tokens[:, :-1]), tokens[:, 1:], z_weight=1e-4)[0]

    return nnx.value_and_grad(f)(model)


def _fused_loss_and_grads(model, tokens):
    """The train step's path: features + the chunked, fused head loss (chunks of 8 tokens)."""
    def f(m):
        x, w = m.features(tokens[:, :-1])
        return head_loss(x, w, tokens[:, 1:], z_weight=1e-4, chunk=8)[0]

    return nnx.value_and_grad(f)(model)


def _tokens(cfg, B=8, L=33, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, L), 0, cfg.vocab_size, jnp.int32)


@pytest.mark.parametrize("fsdp,tp,fused", [(8, 1, False), *(pytest.param(*a, marks=pytest.mark.slow) for a in (
    (8, 1, True), (4, 2, False), (4, 2, True)))], ids=["8-1-logits", "8-1-fused-head", "4-2-logits", "4-2-fused-head"])
def test_sharded_equals_unsharded(fsdp, tp, fused):
    model = build(CFG, seed=1)
    tokens = _tokens(CFG)
    ref_loss, ref_grads = nnx.jit(_loss_and_grads)(model, tokens)

    mesh = S.make_mesh(fsdp=fsdp, tp=tp)
    graphdef, state = nnx.split(model)
    shardings = S.state_shardings(state, mesh)
    state = jax.device_put(state, shardings)
    sharded = nnx.merge(graphdef, state)
    tok = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.P("fsdp")))
    with jax.set_mesh(mesh):
        loss, grads = nnx.jit(_fused_loss_and_grads if fused else _loss_and_grads)(sharded, tok)
    # parameters really are distributed: the q projection is split over both mesh axes
    q = sharded.layers.attn.wq_DxNxH[...]  # [layers, D, N, H], the layers stacked
    want = jax.sharding.NamedSharding(mesh, jax.P(None, "fsdp", "tp" if tp > 1 else None, None))
    assert q.sharding.is_equivalent_to(want, q.ndim), q.sharding.spec
    assert q.addressable_shards[0].data.shape[:2] == (CFG.num_layers, CFG.hidden_size // fsdp)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    flat_ref = jax.tree.leaves(ref_grads)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref)
    for g, r in zip(flat, flat_ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)


def test_init_sharded_places_every_param():
    mesh = S.make_mesh(fsdp=4, tp=2)
    model = S.init_sharded(lambda: Llama(CFG, rngs=nnx.Rngs(params=0)), mesh)
    ref = dict(nnx.to_flat_state(nnx.state(build(CFG, seed=0), nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert got.keys() == ref.keys()
    for path, v in got.items():
        x = v[...]
        assert isinstance(x.sharding, jax.sharding.NamedSharding), path
        if path[-1] != "scale":  # every matrix (stacked or not) really is split, not replicated
            assert x.addressable_shards[0].data.size < x.size, (path, x.sharding.spec)
        if path[-1] in ("gate_DxF", "up_DxF"):
            assert x.addressable_shards[0].data.shape == (CFG.num_layers, CFG.hidden_size // 4, CFG.ffn_size // 2)
        # born sharded, with the same values as an unsharded init
        np.testing.assert_allclose(np.asarray(x), np.asarray(ref[path][...]), atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("tied", [False, True])
def test_causality(tied):
    cfg = CFG.model_copy(update={"tie_embeddings": tied})
    model = build(cfg, seed=2)
    a = _tokens(cfg, B=2, L=24, seed=3)
    t = 11
    b = a.at[:, t + 1 :].set(_tokens(cfg, B=2, L=24, seed=4)[:, t + 1 :])
    la, lb = model(a), model(b)
    np.testing.assert_allclose(la[:, : t + 1], lb[:, : t + 1], atol=1e-5)
    assert np.abs(np.asarray(la[:, t + 1 :] - lb[:, t + 1 :])).max() > 1e-3


def test_bf16_compute_close_to_fp32():
    model = build(CFG, seed=0)
    tok = _tokens(CFG, B=2, L=16)
    fp32 = model(tok)
    model.cfg = CFG.model_copy(update={"compute_dtype": "bfloat16"})
    bf16 = model(tok)
    assert bf16.dtype == jnp.float32
    diff = np.abs(np.asarray(bf16 - fp32)).max()
    assert diff < 0.1
    assert diff > 1e-4, "bf16 logits equal the fp32 ones: compute_dtype was ignored"


def _grad_jaxpr(model, tokens) -> str:
    graphdef, state = nnx.split(model)

    def f(state, tokens):
        return _loss_and_grads(nnx.merge(graphdef, state), tokens)

    return str(jax.make_jaxpr(f)(state, tokens))


def test_remat_same_grads():
    tok = _tokens(CFG, B=2, L=16)
    plain, remat = build(CFG, seed=0), build(CFG.model_copy(update={"remat": True}), seed=0)
    _, g0 = nnx.jit(_loss_and_grads)(plain, tok)
    _, g1 = nnx.jit(_loss_and_grads)(remat, tok)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        # recomputation may reorder float32 sums: tolerance scaled to the leaf's magnitude
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))
    # remat is really applied: the gradient program recomputes blocks under a checkpoint
    jaxprs = [_grad_jaxpr(m, tok) for m in (remat, plain)]
    has_remat = [any(p in j for p in ("checkpoint[", "remat")) for j in jaxprs]
    assert has_remat == [True, False], "expected a checkpoint/remat primitive in the remat model's gradient only"


@pytest.mark.parametrize("name", ["debug", "150m", "1b", "llama3-8b", "intellect-1-10b"])
def test_num_params_matches_model(name):
    cfg = ModelConfig.preset(name)
    _, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    assert sum(int(np.prod(v.shape)) for v in jax.tree.leaves(state)) == cfg.num_params()


def test_intellect_1_report_without_allocating():
    cfg = ModelConfig.preset("intellect-1-10b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (42, 4096, 32, 8)
    assert (cfg.ffn_size, cfg.vocab_size, cfg.rope_theta, cfg.max_seq_len) == (14336, 128256, 5e5, 8192)
    assert not cfg.tie_embeddings
    rep = S.memory_report(lambda: Llama(cfg, rngs=nnx.Rngs(0)), {"fsdp": 8, "tp": 1})
    assert rep["num_params"] == cfg.num_params()
    assert 10.1e9 < rep["num_params"] < 10.3e9
    # fp32 params + two fp32 AdamW moments split 8 ways: 12 bytes x 10.2B / 8
    assert rep["total_bytes_per_device"] == pytest.approx(12 * rep["num_params"] / 8, rel=1e-3)
    # 6N + attention term, N without the embedding table
    assert 6 * 9.6e9 < cfg.flops_per_token(8192) < 6 * 9.8e9 + 12 * 42 * 4096 * 8192


def test_rope_llama31_scaling_changes_only_low_frequencies():
    factor, low, high, orig = 32.0, 1.0, 4.0, 8192
    base = ModelConfig.preset("1b")
    scaled = ModelConfig.preset("1b", rope_scaling={"factor": factor, "low_freq_factor": low,
                                                    "high_freq_factor": high,
                                                    "original_max_position_embeddings": orig})
    a, b = rope_inv_freq(base), rope_inv_freq(scaled)
    assert a[0] == b[0]  # the highest frequency is untouched
    np.testing.assert_allclose(b[-1], a[-1] / 32.0, rtol=1e-6)
    # Llama-3.1 bands (as HF `llama3`), from an independent float64 computation
    H = base.dim_head
    inv = 1.0 / base.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    np.testing.assert_allclose(a, inv, rtol=1e-6)
    wavelen = 2 * np.pi / inv
    hi_band = wavelen < orig / high  # short wavelengths: unchanged
    lo_band = wavelen > orig / low  # long wavelengths: divided by the factor
    mid_band = ~hi_band & ~lo_band
    assert hi_band.sum() >= 2 and lo_band.sum() >= 2 and mid_band.sum() >= 2, (hi_band, lo_band)
    assert np.array_equal(b[hi_band], a[hi_band])
    np.testing.assert_allclose(b[lo_band], inv[lo_band] / factor, rtol=1e-6)
    smooth = (orig / wavelen[mid_band] - low) / (high - low)
    np.testing.assert_allclose(b[mid_band], ((1 - smooth) / factor + smooth) * inv[mid_band], rtol=1e-6)
    assert np.all((b[mid_band] < a[mid_band]) & (b[mid_band] > a[mid_band] / factor))


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 130}, "num_heads"),
        ({"hidden_size": -1}, "model.hidden_size"),
        ({"head_dim": 7, "hidden_size": 128}, "head_dim"),
        ({"param_dtype": "float8"}, "model.param_dtype"),
        ({"nonsense": 1}, "model.nonsense"),
    ],
)
def test_bad_config_names_field(kw, field):
    with pytest.raises(ConfigError, match=field) as e:
        ModelConfig.preset("debug", **kw)
    assert "\n" not in str(e.value)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="tiny"):
        ModelConfig.preset("tiny")


def test_mesh_errors():
    with pytest.raises(ValueError, match="fsdp x tp = 3 x 1"):
        S.make_mesh(fsdp=3, tp=1)
    assert dict(S.make_mesh(fsdp=-1, tp=2).shape) == {"fsdp": 4, "tp": 2}


@pytest.mark.slow
def test_layers_are_scanned_not_unrolled():
    """The program holds one layer's matmuls whatever the depth; unrolling changes nothing but speed."""
    def n_dots(cfg):
        m = build(cfg, seed=0)
        return jax.jit(lambda t: m(t)).lower(_tokens(cfg, B=2, L=8)).compile().as_text().count(" dot(")

    two, six = (CFG.model_copy(update={"num_layers": n}) for n in (2, 6))
    assert n_dots(two) == n_dots(six)
    assert n_dots(six.model_copy(update={"scan_unroll": 3})) > n_dots(six)
    tok = _tokens(six, B=2, L=16)
    np.testing.assert_allclose(build(six.model_copy(update={"scan_unroll": 6}), seed=3)(tok),
                               build(six, seed=3)(tok), rtol=1e-5, atol=1e-5)
