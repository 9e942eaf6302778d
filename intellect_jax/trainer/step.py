"""The pure inner step: `train_step(state, batch) -> (state, metrics)`, jitted once with explicit
shardings and the state donated. DiLoCo drives it H steps at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from intellect_jax.model import sharding as S
from intellect_jax.model.config import ModelConfig
from intellect_jax.model.llama import Llama, abstract
from intellect_jax.trainer.loss import head_loss, row_nll

Params = dict[str, Any]  # nnx "pure dict" of parameter arrays


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: Params
    opt_state: optax.OptState


def apply_model(graphdef: nnx.GraphDef, params: Params, tokens_BxL: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, params)(tokens_BxL)


def _like_params(tree: Any, params_def: Any, params_sh: Any, replicated: NamedSharding) -> Any:
    """Shardings for an optimizer state: subtrees shaped like params get the params' shardings."""
    return jax.tree.map(
        lambda x: params_sh if jax.tree.structure(x) == params_def else replicated,
        tree,
        is_leaf=lambda x: jax.tree.structure(x) == params_def,
    )


def state_shardings(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh) -> tuple[nnx.GraphDef, Any, TrainState]:
    """(graphdef, abstract TrainState carrying its shardings, TrainState of NamedShardings):
    nothing is allocated; the abstract state is what orbax restores into."""
    graphdef, abs_vars = abstract(cfg)
    params_sh = nnx.to_pure_dict(S.state_shardings(abs_vars, mesh))
    abs_params = nnx.to_pure_dict(abs_vars)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    rep = NamedSharding(mesh, PartitionSpec())
    opt_sh = _like_params(abs_opt, jax.tree.structure(abs_params), params_sh, rep)
    abs_state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abs_params, abs_opt)
    shardings = TrainState(rep, params_sh, opt_sh)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, shardings)
    return graphdef, placed, shardings


def init_state(
    cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, seed: int, shardings: TrainState,
    params: Params | None = None,
) -> TrainState:
    """State born sharded on `mesh` (jitted init with out_shardings): fresh random parameters,
    or the given (already placed) `params` with a fresh optimizer state."""

    if params is None:  # the one sharded init (sharding.init_sharded), then the optimizer's state
        params = nnx.to_pure_dict(nnx.state(S.init_sharded(lambda: Llama(cfg, rngs=nnx.Rngs(params=seed)), mesh)))

    @jax.jit(out_shardings=shardings)
    def init(params: Params) -> TrainState:
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    with jax.set_mesh(mesh):
        return init(params)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, S.logical_to_spec(("batch", "seq"), shape, dict(mesh.shape)))


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    z_weight: float,
    micro_steps: int = 1,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """The step over a node batch of token windows [B, L+1]; `micro_steps` micro-batches
    accumulate gradients in fp32 (B must divide by it)."""

    def loss_fn(params: Params, tok_BxL1: jax.Array):
        model = nnx.merge(graphdef, params)
        x_BxLxD, w_DxV = model.features(tok_BxL1[:, :-1])
        return head_loss(x_BxLxD, w_DxV, tok_BxL1[:, 1:], z_weight, elems=model.cfg.head_chunk_logits)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, tok_BxL1: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        if micro_steps == 1:
            (_, aux), grads = grad_fn(state.params, tok_BxL1)
        else:
            B, L1 = tok_BxL1.shape
            # micro-batch m takes rows m, m+M, ...: every device keeps its share of each one
            micro_MxBxL1 = tok_BxL1.reshape(B // micro_steps, micro_steps, L1).swapaxes(0, 1)
            micro_MxBxL1 = S.constrain(micro_MxBxL1, (None, "batch", "seq"))

            def body(acc, tok):
                (_, aux), g = grad_fn(state.params, tok)
                return jax.tree.map(jnp.add, acc, (g, aux)), None

            zero = jax.tree.map(jnp.zeros_like, state.params)
            aux0 = {"ce": jnp.zeros(()), "z": jnp.zeros(())}
            (grads, aux), _ = jax.lax.scan(body, (zero, aux0), micro_MxBxL1)
            grads, aux = jax.tree.map(lambda x: x / micro_steps, (grads, aux))
        direction, opt_state = tx.update(grads, state.opt_state, state.params)
        lr = schedule(state.step)  # the train state's step: the schedule follows the state
        updates = jax.tree.map(lambda u: (-lr * u).astype(u.dtype), direction)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": aux["ce"],
            "z_loss": aux["z"],
            "grad_norm": optax.tree.norm(grads),
            "lr": lr,
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, micro_steps: int = 1) -> Callable[[Params, jax.Array], jax.Array]:
    """Summed next-token loss of each row of a batch [B, L+1] -> [B] (L tokens per row): the
    train step's chunked head (no [B, L, V] logits), over `micro_steps` micro-batches like it."""

    def rows(params: Params, tok_BxL1: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        x_BxLxD, w_DxV = model.features(tok_BxL1[:, :-1])
        return row_nll(x_BxLxD, w_DxV, tok_BxL1[:, 1:], elems=model.cfg.head_chunk_logits)

    def eval_step(params: Params, tok_BxL1: jax.Array) -> jax.Array:
        if micro_steps == 1:
            return rows(params, tok_BxL1)
        B, L1 = tok_BxL1.shape
        micro_MxBxL1 = S.constrain(tok_BxL1.reshape(B // micro_steps, micro_steps, L1).swapaxes(0, 1),
                                   (None, "batch", "seq"))
        out_MxB = jax.lax.map(lambda tok: rows(params, tok), micro_MxBxL1)
        return out_MxB.swapaxes(0, 1).reshape(B)  # row m*M + j came from micro-batch j

    return eval_step


def compile_steps(
    train_step: Callable, eval_step: Callable, shardings: TrainState, batch_sh: NamedSharding
) -> tuple[Callable, Callable]:
    """jit both steps once with explicit in/out shardings; the train state is donated. Both are
    traced with the mesh set, so the activations' sharding constraints (`sharding.constrain`)
    hold: without it they are no-ops, and XLA replicated a micro-batch's whole computation
    on every device (seen: 10x the memory per device of the 10B step)."""
    mesh = batch_sh.mesh
    rep = NamedSharding(mesh, PartitionSpec())

    def on_mesh(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def traced(*args: Any) -> Any:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args)

        return traced

    train = jax.jit(
        on_mesh(train_step),
        in_shardings=(shardings, batch_sh),
        out_shardings=(shardings, rep),
        donate_argnums=0,
    )
    evaluate = jax.jit(on_mesh(eval_step), in_shardings=(shardings.params, batch_sh), out_shardings=rep)
    return train, evaluate
