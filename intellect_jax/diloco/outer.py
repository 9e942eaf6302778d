"""DiLoCo outer state and outer optimizer, on the host, in numpy.

The outer step must give bit-identical results on every node (their hashes are compared), so
it runs as plain numpy elementwise ops (IEEE-exact per operation on any CPU) rather than
through XLA, whose CPU fusion may contract `a*b+c` into an FMA on some machines only.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

Tree = Any


class OuterState(NamedTuple):
    """fp32 outer parameters and the outer optimizer state (Nesterov momentum), host memory."""

    params: Tree
    opt_state: optax.OptState
    step: int  # outer steps completed


class MomentumState(NamedTuple):
    momentum: Tree


def nesterov_sgd(lr: float, momentum: float) -> optax.GradientTransformation:
    """optax-compatible SGD with Nesterov momentum, in numpy (matches `optax.sgd(lr, m, nesterov=True)`):
    m <- momentum * m + g;  update = -lr * (g + momentum * m)."""
    lr32, mu32 = np.float32(lr), np.float32(momentum)

    def init(params: Tree) -> MomentumState:
        return MomentumState(jax.tree.map(lambda p: np.zeros(np.shape(p), np.float32), params))

    def update(grads: Tree, state: MomentumState, params: Tree | None = None):
        del params
        m = jax.tree.map(lambda g, m: mu32 * m + g, grads, state.momentum)
        upd = jax.tree.map(lambda g, m: -lr32 * (g + mu32 * m), grads, m)
        return upd, MomentumState(m)

    return optax.GradientTransformation(init, update)


def to_host(tree: Tree) -> Tree:
    """A float32 numpy copy, pulled from the devices one leaf at a time (bounded host memory)."""
    return jax.tree.map(lambda x: np.array(jax.device_get(x), dtype=np.float32), tree)


def init_outer(params: Tree, tx: optax.GradientTransformation, step: int = 0) -> OuterState:
    p = to_host(params)
    return OuterState(p, tx.init(p), step)


def pseudo_gradient(outer: OuterState, inner_params: Tree) -> Tree:
    """outer - inner, leaf by leaf (device -> host one bucket at a time)."""
    return jax.tree.map(
        lambda o, x: o - np.asarray(jax.device_get(x), dtype=np.float32), outer.params, inner_params
    )


def outer_step(outer: OuterState, avg_pg: Tree, tx: optax.GradientTransformation) -> OuterState:
    """Apply the averaged pseudo-gradient (a descent direction, like a gradient)."""
    upd, opt_state = tx.update(avg_pg, outer.opt_state, outer.params)
    params = jax.tree.map(lambda p, u: (p + u).astype(np.float32), outer.params, upd)
    return OuterState(params, opt_state, outer.step + 1)


def state_hash(outer: OuterState) -> str:
    """blake2b over the outer step, parameters and momentum (leaf order and bytes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.int64(outer.step).tobytes())
    for path, leaf in jax.tree_util.tree_leaves_with_path((outer.params, outer.opt_state)):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(leaf, dtype=np.float32).tobytes())
    return h.hexdigest()
