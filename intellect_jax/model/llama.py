"""Llama-3 in Flax NNX.

Shapes are suffixed: B batch, L sequence, D hidden, N query heads, K kv heads, H head dim,
F ffn, V vocab. Every parameter carries logical axis names (`axes` metadata) that
`model.sharding.RULES` maps onto the mesh. RoPE uses HF's rotate-half layout (first half of
the head dim pairs with the second half), so HF q/k weights import with no permutation.
The blocks are stored stacked (a leading `layers` axis on each block parameter) and run by a
`lax.scan`, remat applied per layer inside it: compile time and activation memory stay those
of one layer whatever the depth (the 10B train step: 3 s to compile, not 28 s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from intellect_jax.model.config import ModelConfig
from intellect_jax.model.sharding import constrain


def _mm(x_BxLxD: jax.Array, w: jax.Array, out: tuple[int, ...]) -> jax.Array:
    """x [B, L, D] times a weight whose leading axes are the contracted ones ([D, ...] or
    [N, H, D] with x [B, L, N, H]), as ONE 2-D matmul [B*L, in] x [in, out] -> [B, L, *out].
    XLA:CPU runs a 3-D einsum's weight gradient (contracting over both B and L) on a slow path
    with transposes; the 2-D form is a plain GEMM both ways."""
    B, L = x_BxLxD.shape[:2]
    x_NxI = x_BxLxD.reshape(B * L, -1)
    y = x_NxI @ w.astype(x_BxLxD.dtype).reshape(x_NxI.shape[1], -1)
    return y.reshape(B, L, *out)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float, dtype) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [H/2], with Llama-3.1 scaling when configured (as HF `llama3`)."""
    H = cfg.dim_head
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
    s = cfg.rope_scaling
    if s is None:
        return inv.astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_mid, mid, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, pos_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) of shape [B, L, 1, H] in float32."""
    ang_BxLxh = pos_BxL[..., None].astype(jnp.float32) * jnp.asarray(rope_inv_freq(cfg))
    ang_BxLxH = jnp.concatenate([ang_BxLxh, ang_BxLxh], axis=-1)[:, :, None, :]
    return jnp.sin(ang_BxLxH), jnp.cos(ang_BxLxH)


def apply_rope(x_BxLxNxH: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return (x_BxLxNxH.astype(jnp.float32) * cos + rot * sin).astype(x_BxLxNxH.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=("norm",))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x = x_BxLxD.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x_BxLxD.dtype) * y.astype(x_BxLxD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.dim_head
        pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
        self.cfg = cfg
        self.wq_DxNxH = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), std, pd)
        self.wk_DxKxH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wv_DxKxH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wo_NxHxD = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), std, pd)

    def __call__(self, x_BxLxD: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
        c = self.cfg
        N, K, H = c.num_heads, c.num_kv_heads, c.dim_head
        q = _mm(x_BxLxD, self.wq_DxNxH[...], (N, H))
        k = _mm(x_BxLxD, self.wk_DxKxH[...], (K, H))
        v = _mm(x_BxLxD, self.wv_DxKxH[...], (K, H))
        q = constrain(apply_rope(q, sin, cos), ("batch", "seq", "heads", "head_dim"))
        k = constrain(apply_rope(k, sin, cos), ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        impl = "xla" if c.attention_impl == "auto" else c.attention_impl  # a node resolves "auto" (on_platform)
        o_BxLxNxH = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return _mm(o_BxLxNxH, self.wo_NxHxD[...], (c.hidden_size,))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.ffn_size
        pd, std = jnp.dtype(cfg.param_dtype), cfg.init_std
        self.gate_DxF = _param(rngs, (D, F), ("embed", "mlp"), std, pd)
        self.up_DxF = _param(rngs, (D, F), ("embed", "mlp"), std, pd)
        self.down_FxD = _param(rngs, (F, D), ("mlp", "embed"), std, pd)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        F, D = self.down_FxD.shape
        g = _mm(x_BxLxD, self.gate_DxF[...], (F,))
        u = _mm(x_BxLxD, self.up_DxF[...], (F,))
        h_BxLxF = constrain(jax.nn.silu(g) * u, ("batch", "seq", "mlp"))
        return _mm(h_BxLxF, self.down_FxD[...], (D,))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, pd)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, pd)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxLxD: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
        x = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), sin, cos)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "seq", "act_embed"))


def _stack(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """`cfg.num_layers` blocks as ONE Block whose parameters carry a leading `layers` axis: the
    forward pass scans it, so XLA compiles one layer (not 42) and keeps one layer's temporaries."""
    graphdef = nnx.split(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(params=0))))[0]
    keys = jax.random.split(rngs.params(), cfg.num_layers)
    state = jax.vmap(lambda k: nnx.state(Block(cfg, nnx.Rngs(params=k))))(keys)
    state = jax.tree.map(lambda v: v.replace(axes=("layers", *v.get_metadata()["axes"])), state,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


class Llama(nnx.Module):
    """Decoder-only Llama-3: tokens [B, L] int -> logits [B, L, V] float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, V = cfg.hidden_size, cfg.vocab_size
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed_VxD = _param(rngs, (V, D), ("vocab", "embed"), cfg.init_std, pd)
        self.layers = _stack(cfg, rngs)
        self.final_norm = RMSNorm(D, cfg.norm_eps, pd)
        if not cfg.tie_embeddings:
            self.head_DxV = _param(rngs, (D, V), ("embed", "vocab"), cfg.init_std, pd)

    def __call__(self, tokens_BxL: jax.Array, pos_BxL: jax.Array | None = None) -> jax.Array:
        x_BxLxD, w_DxV = self.features(tokens_BxL, pos_BxL)
        logits = jnp.einsum("bld,dv->blv", x_BxLxD, w_DxV, preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "vocab"))

    def features(self, tokens_BxL: jax.Array, pos_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(final-normed hidden states [B, L, D], output weight [D, V]) in the compute dtype:
        logits = x @ w. The train step hands both to the fused `head_loss`."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.compute_dtype)
        B, L = tokens_BxL.shape
        if pos_BxL is None:
            pos_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        sin, cos = rope_tables(cfg, pos_BxL)
        x = jnp.take(self.embed_VxD[...], tokens_BxL, axis=0).astype(dt)
        x = constrain(x, ("batch", "seq", "act_embed"))
        graphdef, stacked = nnx.split(self.layers)

        def layer(x_BxLxD: jax.Array, params: nnx.State) -> tuple[jax.Array, None]:
            return nnx.merge(graphdef, params)(x_BxLxD, sin, cos), None

        x, _ = jax.lax.scan(jax.checkpoint(layer) if cfg.remat else layer, x, stacked,
                            unroll=min(cfg.scan_unroll, cfg.num_layers))
        w_DxV = self.embed_VxD[...].T if cfg.tie_embeddings else self.head_DxV[...]
        return self.final_norm(x), w_DxV.astype(dt)


def build(cfg: ModelConfig, seed: int = 0) -> Llama:
    """An unsharded model (tests, tools). Training uses `sharding.init_sharded`."""
    return Llama(cfg, rngs=nnx.Rngs(params=seed))


def abstract(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of the model: what restores, imports and shardings start from."""
    from intellect_jax.model.sharding import abstract as abstract_of

    return abstract_of(lambda: Llama(cfg, rngs=nnx.Rngs(params=0)))
