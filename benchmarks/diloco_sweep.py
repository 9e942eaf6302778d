"""DiLoCo hyperparameter sweeps in one process (a script, not a test).

    python benchmarks/diloco_sweep.py --outer-lr 1.0 --outer-momentum 0 [--nodes 4 --inner-steps 50 ...]
    python benchmarks/diloco_sweep.py --single            # the one-node baseline on the same tokens
    python benchmarks/diloco_sweep.py --preset 150m --compute-dtype bfloat16   # on a GPU

`benchmarks/diloco_experiment.py` measures through the real system (launcher, coordinator,
sockets, int8 ring) and so costs a process per node; tuning needs many runs, so this script
replays the same algorithm in one process on one device: N replicas of the trainer's jitted
`train_step`, each on its own data shard (`make_train_iter(node_rank=r, node_count=N)`), and
every H steps the outer step of `diloco.outer` (pseudo-gradient = outer - inner, averaged in
fp32, Nesterov SGD), then the outer params written back to every replica. Same model, data,
schedule and validation windows as the experiment (`configs/debug_diloco.toml`, warmup 10%,
decay 20% of the steps, 128 held-out sequences); the average is the exact fp32 mean (the
experiment's int8 ring measured 0.9993x of fp32). Prints the train loss every 50 steps, the
validation loss every `--eval-every` steps and at the end, then one JSON line;
`--eval-replicas` adds, at every outer step, each node's validation loss before averaging and
that of the averaged params.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=50, help="H")
    ap.add_argument("--steps", type=int, default=500, help="inner steps per node")
    ap.add_argument("--batch", type=int, default=8, help="sequences per node per step")
    ap.add_argument("--lr", type=float, default=3e-3, help="inner (and one-node) peak learning rate")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--preset", default="debug", help="model preset (its vocab is set to the bundled BPE's)")
    ap.add_argument("--compute-dtype", default=None, help="e.g. bfloat16 (default: the config's float32)")
    ap.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a model field of the preset, e.g. --model hidden_size=256 (repeatable)")
    ap.add_argument("--single", action="store_true", help="one node, batch nodes x batch")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--eval-replicas", action="store_true",
                    help="at every outer step, also the val loss of each node's params before averaging")
    ap.add_argument("--eval-seqs", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/sweep", help="data cache and scratch")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from intellect_jax import config as C
    from intellect_jax.data import tokenizer as toklib
    from intellect_jax.data.pipeline import make_train_iter, make_val_batches
    from intellect_jax.diloco import outer as O
    from intellect_jax.model import sharding as S
    from intellect_jax.trainer import step as T
    from intellect_jax.trainer.optim import make_schedule, make_tx

    raw = tomllib.loads((ROOT / "configs/debug_diloco.toml").read_text())
    raw.pop("diloco")
    M = 1 if a.single else a.nodes
    raw["run"].update(steps=a.steps, seed=a.seed, out_dir=str(ROOT / a.out))
    raw["data"].update(batch_size=a.batch * (a.nodes if a.single else 1))
    raw["optim"].update(lr=a.lr, warmup_steps=a.steps // 10, decay_steps=a.steps // 5)
    raw["model"].update(preset=a.preset, **({"compute_dtype": a.compute_dtype} if a.compute_dtype else {}))
    for kv in a.model:
        k, sep, v = kv.partition("=")
        if not sep:
            sys.exit(f"--model {kv!r}: expected FIELD=VALUE")
        raw["model"][k] = v  # the config's validation converts and checks it
    try:
        cfg = C.validate(raw)
        mcfg = cfg.model.model_copy(update={"vocab_size": cfg.data.bpe_vocab_size}).build()  # the bundled BPE's
    except C.ConfigError as e:
        sys.exit(f"error: {e}")
    tok = toklib.load_tokenizer(cfg.data)
    mesh = S.make_mesh(devices=jax.devices()[:1])
    tx, sched = make_tx(cfg.optim, a.steps), make_schedule(cfg.optim, a.steps)
    graphdef, _, sh = T.state_shardings(mcfg, tx, mesh)
    init = jax.device_get(T.init_state(mcfg, tx, mesh, a.seed, sh))
    step = jax.jit(T.make_train_step(graphdef, tx, sched, z_weight=cfg.optim.z_loss_weight),
                   donate_argnums=0)
    evaluate = jax.jit(T.make_eval_step(graphdef))
    states = [jax.tree.map(jnp.asarray, init) for _ in range(M)]  # every node starts alike
    data = [iter(make_train_iter(cfg.data, tok, node_rank=r, node_count=M)) for r in range(M)]
    val = make_val_batches(cfg.data.model_copy(update={"batch_size": 8}), tok, max_batches=a.eval_seqs // 8)
    n_val = sum(b["tokens"][:, 1:].size for b in val)

    def val_loss(params) -> float:
        return sum(float(jnp.sum(evaluate(params, jnp.asarray(b["tokens"])))) for b in val) / n_val

    otx = O.nesterov_sgd(a.outer_lr, a.outer_momentum)
    outer = O.init_outer(init.params, otx)
    t0, last = time.time(), None
    for s in range(1, a.steps + 1):
        losses = []
        for r in range(M):
            states[r], m = step(states[r], jnp.asarray(next(data[r])["tokens"], jnp.int32))
            losses.append(m["loss"])
        if not a.single and s % a.inner_steps == 0:
            before = [val_loss(st.params) for st in states] if a.eval_replicas else None
            pgs = [O.pseudo_gradient(outer, st.params) for st in states]
            avg = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *pgs)
            outer = O.outer_step(outer, avg, otx)
            states = [st.replace(params=jax.tree.map(jnp.asarray, outer.params)) for st in states]
            if before:
                print(f"outer step at {s}: val loss of the nodes "
                      + " ".join(f"{v:.4f}" for v in before)
                      + f", of their average {val_loss(states[0].params):.4f}", flush=True)
        if s % 50 == 0 or s == a.steps:
            vl = val_loss(states[0].params) if s == a.steps or (a.eval_every and s % a.eval_every == 0) else None
            last = vl if vl is not None else last
            print(f"step {s:5d}  train loss {float(np.mean(losses)):.4f}"
                  + (f"  val loss {vl:.4f}" if vl is not None else "") + f"  {time.time() - t0:.0f} s", flush=True)
    print(json.dumps({"args": vars(a), "val_loss": last, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
