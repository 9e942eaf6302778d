"""Next-token cross-entropy with INTELLECT-1's max-z-loss auxiliary term: the one loss path.

The output projection is fused with the loss and never holds the [B, L, V] logits (a single
8192-token sequence with Llama-3's vocab is 4.2 GB of fp32 logits): the sequence is walked in
chunks (`_logit_stats` makes one chunk's logits and reduces them). `head_loss` is what the
train step runs: since the loss is the end of the graph, it computes the gradients w.r.t. the
features and the head weight inside the forward pass (a custom VJP), so each chunk's logits
are made, used and dropped while they are still in cache. `row_nll` is what evaluation runs:
the same chunks, summed per row, no gradients.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from intellect_jax.model.config import HEAD_CHUNK_LOGITS

CHUNK_ELEMS = HEAD_CHUNK_LOGITS["cpu"]  # default logits per chunk (4 MiB fp32): the CPU's


def chunk_len(B: int, L: int, V: int, elems: int = CHUNK_ELEMS) -> int:
    """Largest divisor of L whose [B, chunk, V] logits hold at most `elems` values (at least 1)."""
    best = 1
    for c in range(1, L + 1):
        if L % c == 0 and B * c * V <= elems:
            best = c
    return best


def head_loss(
    x_BxLxD: jax.Array, w_DxV: jax.Array, targets_BxL: jax.Array, z_weight: float = 0.0,
    chunk: int | None = None, elems: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy of ``x @ w`` against ``targets`` + ``z_weight`` x mean(max logit ** 2),
    returned as (total, {"ce": ..., "z": ...}), without materializing the logits.

    The matmul runs in x's dtype with fp32 accumulation and fp32 softmax, like `Llama.__call__`.
    Differentiable in x and w, through the total and through the aux values; the max-logit
    term's gradient goes to the first maximal logit (ties have measure zero). ``chunk``: tokens
    per chunk; else the most that keep a chunk's logits within ``elems`` (default CHUNK_ELEMS).
    """
    B, L, _ = x_BxLxD.shape
    c = chunk or chunk_len(B, L, w_DxV.shape[1], elems or CHUNK_ELEMS)
    if L % c:
        raise ValueError(f"head_loss: chunk {c} does not divide the sequence length {L}")
    total, ce, z = _head(x_BxLxD, w_DxV, targets_BxL, float(z_weight), c)
    return total, {"ce": ce, "z": z}


def _chunks(a: jax.Array, c: int) -> jax.Array:
    """[B, L, ...] -> [L/c, B, c, ...] (the batch axis, and its sharding, stay put)."""
    B, L = a.shape[:2]
    return a.reshape(B, L // c, c, *a.shape[2:]).swapaxes(0, 1)


def _unchunk(a: jax.Array) -> jax.Array:
    n, B, c = a.shape[:3]
    return a.swapaxes(0, 1).reshape(B, n * c, *a.shape[3:])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head(x, w, targets, z_weight, c):
    return _head_fwd(x, w, targets, z_weight, c)[0]


def _logit_stats(x_BxCxD, wc_DxV, t_BxC):
    """One chunk's logits (fp32) and what the loss needs of them: max, exp(logits - max), their
    sum, the one-hot of the targets and the target logits."""
    lg = jnp.einsum("bcd,dv->bcv", x_BxCxD, wc_DxV, preferred_element_type=jnp.float32)
    m = jnp.max(lg, axis=-1)
    e = jnp.exp(lg - m[..., None])
    s = jnp.sum(e, axis=-1)
    iota = jax.lax.broadcasted_iota(jnp.int32, lg.shape, 2)
    is_t = iota == t_BxC[..., None]
    tgt = jnp.sum(jnp.where(is_t, lg, 0.0), axis=-1)
    return lg, m, e, s, iota, is_t, tgt


def row_nll(x_BxLxD: jax.Array, w_DxV: jax.Array, targets_BxL: jax.Array, chunk: int | None = None,
            elems: int | None = None) -> jax.Array:
    """Summed next-token cross-entropy of each row, [B] float32, without the [B, L, V] logits."""
    B, L, _ = x_BxLxD.shape
    c = chunk or chunk_len(B, L, w_DxV.shape[1], elems or CHUNK_ELEMS)
    wc = w_DxV.astype(x_BxLxD.dtype)

    def body(acc_B, inp):
        _, m, _, s, _, _, tgt = _logit_stats(*inp[:1], wc, inp[1])
        return acc_B + jnp.sum(m + jnp.log(s) - tgt, axis=-1), None

    acc, _ = jax.lax.scan(body, jnp.zeros((B,), jnp.float32), (_chunks(x_BxLxD, c), _chunks(targets_BxL, c)))
    return acc


def _head_fwd(x, w, targets, z_weight, c):
    B, L, _ = x.shape
    n = B * L
    wc = w.astype(x.dtype)

    def body(carry, inp):
        dw, ce, z = carry
        x_BxCxD, t_BxC = inp
        lg, m, e, s, iota, is_t, tgt = _logit_stats(x_BxCxD, wc, t_BxC)
        am = jnp.argmax(lg, axis=-1)
        # d(total)/d(logits) = (softmax - onehot(target) + z_weight * 2m * onehot(argmax)) / n
        d = (e / s[..., None] - is_t + jnp.where(iota == am[..., None], (2 * z_weight) * m[..., None], 0.0)) / n
        d = d.astype(x.dtype)
        dx = jnp.einsum("bcv,dv->bcd", d, wc, preferred_element_type=jnp.float32).astype(x.dtype)
        dw = dw + jnp.einsum("bcd,bcv->dv", x_BxCxD, d, preferred_element_type=jnp.float32)
        return (dw, ce + jnp.sum(m + jnp.log(s) - tgt), z + jnp.sum(m * m)), (dx, m, am)

    init = (jnp.zeros(w.shape, jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (dw, ce, z), (dx, m, am) = jax.lax.scan(body, init, (_chunks(x, c), _chunks(targets, c)))
    ce, z = ce / n, z / n
    res = (_unchunk(dx), dw.astype(w.dtype), _unchunk(m), _unchunk(am), x, w)
    return (ce + z_weight * z, ce, z), res


def _head_bwd(z_weight, c, res, g):
    """total's gradient R = dCE + zw dZ came from the forward pass; dZ (one logit per row) is
    rebuilt here so cotangents on ce and z are exact: grad = (g_t + g_ce) R + (g_z - zw g_ce) dZ."""
    dx_t, dw_t, m_BxL, am_BxL, x, w = res
    g_t, g_ce, g_z = g
    n = m_BxL.size
    a, b = g_t + g_ce, g_z - z_weight * g_ce
    coef_BxL = (2.0 * b / n) * m_BxL  # dZ/dlogit at the argmax
    dx = a * dx_t.astype(jnp.float32) + coef_BxL[..., None] * jnp.take(w.T, am_BxL, axis=0).astype(jnp.float32)
    # dZ's weight gradient: each row's x added into its argmax column, in place (no [V, D] buffer)
    xs_DxN = (coef_BxL[..., None] * x.astype(jnp.float32)).reshape(-1, w.shape[0]).T
    dw = (a * dw_t.astype(jnp.float32)).at[:, am_BxL.reshape(-1)].add(xs_DxN)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_head.defvjp(_head_fwd, _head_bwd)
