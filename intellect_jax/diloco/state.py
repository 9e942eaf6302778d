"""`DilocoState`: everything a DiLoCo node holds, as one pytree, and the outer step on it.

The same structure is what a checkpoint stores, what a donor streams to a joiner, and what
the state hash covers:

* ``outer_params`` and ``outer_opt_state`` (the Nesterov momentum): fp32 numpy on the host,
  bit-identical on every node; the state hash covers them and ``outer_step``;
* ``inner_opt_state``: this node's AdamW moments (host numpy in a snapshot, device arrays in a
  live trainer); a joiner takes its donor's;
* ``outer_step``, ``inner_step``: counters; ``data``: this node's data-iterator position (its
  own shard, so it is checkpointed but never transferred); ``norms``: the norms of recent
  averages, which the average check (:mod:`.guard`) compares against (shared, hashed);
  ``skipped``: whether the last average failed that check (shared, hashed); ``residual``:
  this node's error feedback (checkpointed, never transferred nor hashed).

At an outer boundary the inner params equal ``outer_params`` (cast to the param dtype), so
they are not stored separately.

The outer step runs as plain numpy elementwise ops (IEEE-exact per operation on any CPU)
rather than through XLA, whose CPU fusion may contract `a*b+c` into an FMA on some machines
only: every node must compute the same bits.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from intellect_jax.diloco.guard import tree_norm
from intellect_jax.net.evidence import seal

Tree = Any


class MomentumState(NamedTuple):
    momentum: Tree


class DilocoState(NamedTuple):
    """One node's DiLoCo state at outer boundary ``outer_step`` (the module docstring says which
    parts are shared, transferred and hashed)."""

    outer_params: Tree
    """θ_k: fp32 numpy on the host, the same bits on every node (hashed). The trainer's params
    equal them at the boundary (cast to the param dtype), so they are not stored apart."""
    outer_opt_state: MomentumState
    """The outer Nesterov momentum (:func:`nesterov_sgd`): fp32 numpy, the same bits on every node
    (hashed), so any node's copy continues the run."""
    inner_opt_state: Tree
    """This node's inner (AdamW) optimizer state: host numpy in a checkpoint or a transfer (a
    joiner takes its donor's), None in the state the loop holds (the live one stays in the
    trainer). Not hashed: each node's moments are its own."""
    outer_step: int
    """k: outer steps applied so far (hashed); the run's history names each state by it."""
    inner_step: int
    """Inner steps done at this boundary, ``outer_step`` x H: where the trainer's step counter
    and learning-rate schedule resume (a joiner's included)."""
    data: dict | None = None
    """This node's data-iterator position (its own shard): checkpointed so a restart does not
    repeat or skip tokens, never transferred (a joiner keeps its own) nor hashed; None: not taken."""
    norms: tuple[float, ...] = ()
    """Norms of the recent accepted averages, oldest first (at most ``GuardConfig.history``): what
    the check of the next average compares it with (:mod:`.guard`). Every node must judge alike,
    so they are part of the shared, hashed state."""
    residual: Tree | None = None
    """Error feedback (gathered codecs, ``diloco.feedback``): what the encoding of this node's last
    contribution lost, fp32 numpy like ``outer_params``, added to its next one. This node's own:
    checkpointed with it, never transferred (a joiner starts from zeros) nor hashed; None: zeros."""
    skipped: bool | None = None
    """Whether outer step ``outer_step``'s average was skipped (it failed its checks; every node
    judges it alike): shared, hashed, checkpointed and transferred like the norms; None: no
    average made this state (the initial state, or a checkpoint from before it was kept). Every
    holder of the state reports it at its first barrier (a process that restarted from its
    checkpoint, a joiner), so the coordinator's data leases know whether that step took its
    units even when nobody who saw the all-reduce is left; the hash holds it to the truth."""

    def arrays(self) -> dict[str, Tree]:
        """The array part, in the one leaf order used by checkpoints, transfers and hashes."""
        return {"outer_params": self.outer_params, "outer_opt_state": self.outer_opt_state,
                "inner_opt_state": self.inner_opt_state}

    def with_arrays(self, arrays: dict[str, Tree]) -> DilocoState:
        return self._replace(**{k: arrays[k] for k in ("outer_params", "outer_opt_state", "inner_opt_state")})


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


def host_copy(tree: Tree) -> Tree:
    """A numpy copy of a (device) tree that keeps each leaf's dtype."""
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


def init_state(params: Tree, tx: optax.GradientTransformation, inner_opt_state: Tree,
               inner_step: int = 0) -> DilocoState:
    """Outer step 0: outer params = the (fresh, identically seeded) inner params."""
    p = to_host(params)
    return DilocoState(p, tx.init(p), inner_opt_state, 0, inner_step)


def pseudo_gradient(outer_params: Tree, inner_params: Tree) -> Tree:
    """outer - inner on the host, leaf by leaf (device -> host one leaf at a time, in fp32)."""
    return jax.tree.map(lambda o, x: o - np.asarray(jax.device_get(x), dtype=np.float32), outer_params,
                        inner_params)


def outer_step(s: DilocoState, avg_pg: Tree, tx: optax.GradientTransformation, inner_step: int) -> DilocoState:
    """Apply the averaged pseudo-gradient (a descent direction, like a gradient)."""
    upd, opt = tx.update(avg_pg, s.outer_opt_state, s.outer_params)
    params = jax.tree.map(lambda p, u: (p + u).astype(np.float32), s.outer_params, upd)
    return s._replace(outer_params=params, outer_opt_state=opt, outer_step=s.outer_step + 1, inner_step=inner_step,
                      skipped=False)


def state_hash(s: DilocoState) -> str:
    """blake2b over the outer step, the recent average norms, whether the last average was
    skipped, the outer params and the outer optimizer state (leaf paths and bytes), sealed with
    the number of outer-param values and their norm: the part of the state every node holds bit
    for bit. Its :func:`hash_opening` lets a third party that knows the hash check that scale
    without the state (``net.evidence``)."""
    o = hash_opening(s)
    return seal(o["core"], o["numel"], o["scale"])


def hash_opening(s: DilocoState) -> dict[str, Any]:
    """What :func:`state_hash` seals: the digest of the rest (``core``), ``numel``, ``scale``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.int64(s.outer_step).tobytes())
    h.update(np.asarray(s.norms, np.float64).tobytes())
    if s.skipped is not None:  # (a state without a verdict hashes as before it was kept)
        h.update(b"skipped" if s.skipped else b"applied")
    for path, leaf in jax.tree_util.tree_leaves_with_path((s.outer_params, s.outer_opt_state)):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(leaf, dtype=np.float32).tobytes())
    # the scale to 3 significant digits: plenty for a threshold, and a float sum's last bits can
    # never split the nodes' hashes
    return {"core": h.hexdigest(), "numel": int(sum(np.size(x) for x in jax.tree.leaves(s.outer_params))),
            "scale": float(f"{tree_norm(s.outer_params):.3g}")}
