"""DiLoCo hyperparameter sweeps in one process (a script, not a test).

    python benchmarks/diloco_sweep.py --outer-lr 1.0 --outer-momentum 0 [--nodes 4 --inner-steps 50 ...]
    python benchmarks/diloco_sweep.py --single            # the one-node baseline on the same tokens
    python benchmarks/diloco_sweep.py --preset 150m --compute-dtype bfloat16   # on a GPU

`benchmarks/diloco_experiment.py` measures through the real system (launcher, coordinator,
sockets, int8 ring) and so costs a process per node; tuning needs many runs, so this script
runs the same outer loop (`intellect_jax.diloco.loop.NodeLoop`, the real node's) on N real
trainers in one process (`intellect_jax.testing.local.run_local`: threads, in-process
coordinator, the ring's arithmetic in-process), each node on its own data shard. Same model,
data, schedule and validation windows as the experiment (`configs/debug_diloco.toml`, warmup
10%, decay 20% of the steps, 128 held-out sequences). `--mode fp32` (default) averages in fp32,
`--mode int8` as the experiment's wire format, `int4`, `int2`, `int1`, `topk`, `top1` as those codecs
(the last three with error feedback, `--feedback`). Prints the validation loss of the final outer
params (and, with `--eval-replicas`, at every outer step each node's before averaging and the
average's), then one JSON line. `--exchange butterfly --robust AGG --attack A` makes node1 an
attacker (the fault injection of `intellect_jax.testing`, here in the benchmark, never in the
node) and prints the cosine of every applied average with the honest nodes' mean.
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
    ap.add_argument("--mode", default="fp32", choices=["fp32", "bf16", "int8", "int4", "int2", "int1", "topk", "top1"],
                    help="the exchange's codec (diloco.mode)")
    ap.add_argument("--block", type=int, default=64, help="values per scale (int8, int4, int2, int1)")
    ap.add_argument("--topk", type=int, default=64, help="topk: values kept per chunk")
    ap.add_argument("--top1-group", type=int, default=4, help="top1: the largest of every group of this many")
    ap.add_argument("--sparse-chunk", type=int, default=4096, help="topk, top1: values per chunk")
    ap.add_argument("--feedback", type=float, default=1.0, help="error feedback of int2, int1, topk and top1 (0: none)")
    ap.add_argument("--preset", default="debug", help="model preset (its vocab is set to the bundled BPE's)")
    ap.add_argument("--compute-dtype", default=None, help="e.g. bfloat16 (default: the config's float32)")
    ap.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a model field of the preset, e.g. --model hidden_size=256 (repeatable)")
    ap.add_argument("--single", action="store_true", help="one node, batch nodes x batch")
    ap.add_argument("--eval-replicas", action="store_true",
                    help="at every outer step, also the val loss of each node's params before averaging")
    ap.add_argument("--overlap", action="store_true", help="overlapped rounds (implies --device-pg)")
    ap.add_argument("--overlap-delay", type=int, default=None, help="a fixed tau in inner steps (default: merge when ready)")
    ap.add_argument("--device-pg", action="store_true",
                    help="pseudo-gradients by the device path (per-shard int8, as GPU and overlapped nodes)")
    ap.add_argument("--feedback-local", type=float, default=0.0, metavar="ALPHA",
                    help="diloco.feedback_local: each node starts its round from the outer params less ALPHA x "
                         "feedback x its residual (that share of its unsent progress kept in its own params)")
    ap.add_argument("--encode-device", action="store_true",
                    help="topk, top1, int1: encode each contribution on the devices (XLA, as GPU nodes do; implies --device-pg)")
    ap.add_argument("--eval-seqs", type=int, default=128)
    ap.add_argument("--exchange", default="ring", choices=["ring", "butterfly"])
    ap.add_argument("--robust", default="mean", help="the butterfly owners' aggregator: mean, clip, trim<k>, cclip")
    ap.add_argument("--attack", default=None, help="node1 (and node5, ...: --attackers) sends, from the first "
                    "outer step on: flip (-N x its own), push (7x its norm, one direction), ratchet (1.6^k x), x1000")
    ap.add_argument("--attackers", type=int, default=1)
    ap.add_argument("--evict", action="store_true",
                    help="evict each attacker at the barrier after every round it attacked, as the real "
                         "coordinator does on its owners' signed evidence (rule 11: flip, push, x1000 at "
                         "boundary 1 in benchmarks/byzantine_sim.py); it registers again, joins, attacks again")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/sweep", help="data cache and run directories")
    a = ap.parse_args()

    import jax
    import numpy as np

    from intellect_jax import config as C
    from intellect_jax.data.config import DataConfig
    from intellect_jax.data.pipeline import make_val_batches
    from intellect_jax.diloco.device_codec import DeviceEncoder
    from intellect_jax.diloco.device_pg import DevicePseudoGradient, host_quantize
    from intellect_jax.diloco.inner import TrainerInner
    from intellect_jax.testing.local import run_local
    from intellect_jax.diloco.parts import LoopConfig
    from intellect_jax.diloco.config import DilocoConfig
    from intellect_jax.net.comm import RingConfig
    from intellect_jax.testing.local_ring import ring_bytes
    from intellect_jax.trainer.loop import Role, Trainer

    raw = tomllib.loads((ROOT / "configs/debug_diloco.toml").read_text())
    raw.pop("diloco")
    M = 1 if a.single else a.nodes
    tag = time.strftime("%Y%m%d-%H%M%S")
    raw["run"].update(steps=a.steps, seed=a.seed, out_dir=str(ROOT / a.out), eval_every=0, log_every=50)
    raw["data"].update(batch_size=a.batch * (a.nodes if a.single else 1), cache_dir=str(ROOT / a.out / "cache"))
    raw["optim"].update(lr=a.lr, warmup_steps=a.steps // 10, decay_steps=a.steps // 5)
    raw["model"].update(preset=a.preset, **({"compute_dtype": a.compute_dtype} if a.compute_dtype else {}))
    raw["ckpt"] = {"every": 0}
    for kv in a.model:
        k, sep, v = kv.partition("=")
        if not sep:
            sys.exit(f"--model {kv!r}: expected FIELD=VALUE")
        raw["model"][k] = v  # the config's validation converts and checks it
    raw["model"].setdefault("vocab_size", raw["data"].get("bpe_vocab_size", DataConfig().bpe_vocab_size))
    try:
        cfgs = [C.validate({**raw, "run": {**raw["run"], "name": f"{tag}/node{r}"}}) for r in range(M)]
    except C.ConfigError as e:
        sys.exit(f"error: {e}")
    trainers = [Trainer(c, node_rank=r, node_count=M, role=Role.INNER)
                for r, c in enumerate(cfgs)]
    t0 = trainers[0]
    val = make_val_batches(cfgs[0].data.model_copy(update={"batch_size": 8}), t0.tok,
                           max_batches=a.eval_seqs // 8)
    n_val = sum(b["tokens"][:, 1:].size for b in val)

    def val_loss(params) -> float:
        return sum(float(np.sum(jax.device_get(t0._eval(params, t0._device_batch(b["tokens"])))))
                   for b in val) / n_val

    d = DilocoConfig(mode=a.mode, block_size=a.block, topk=a.topk, top1_group=a.top1_group,
                     sparse_chunk=a.sparse_chunk, feedback=a.feedback)
    ring = RingConfig(mode=d.wire_mode, block_size=d.wire_block, exchange=a.exchange, robust=a.robust)
    numel = sum(x.size for x in jax.tree.leaves(t0.state.params))
    sent = 0 if a.single else ring_bytes(numel, a.nodes, 0, ring)  # one bucket: the debug model is small
    start = time.time()
    if a.single:
        t0.train()
    else:
        class Inner(TrainerInner):
            """The real inner trainer; with --eval-replicas, reports val losses around each average."""

            def pseudo_gradient(self, outer_params):
                if a.eval_replicas:
                    print(f"step {self.step}: val loss of {self.t.run_dir.name} before averaging "
                          f"{val_loss(self.t.state.params):.4f}", flush=True)
                return super().pseudo_gradient(outer_params)

            def set_params(self, params):
                super().set_params(params)
                if a.eval_replicas and self.t is t0:
                    print(f"step {self.step}: val loss of the average {val_loss(self.t.state.params):.4f}", flush=True)

        loop = LoopConfig(inner_steps=a.inner_steps, outer_steps=a.steps // a.inner_steps, outer_lr=a.outer_lr,
                          outer_momentum=a.outer_momentum, overlap=a.overlap, overlap_delay=a.overlap_delay,
                          feedback=a.feedback if d.gathered else 0.0,
                          feedback_local=a.feedback_local if d.gathered else 0.0)
        device = a.overlap or a.device_pg or a.encode_device
        dpg = (lambda: DevicePseudoGradient(64, host_quantize)) if device else (lambda: None)
        enc = (lambda: DeviceEncoder(ring.mode, ring.block_size, ring.bucket_numel, ring.piece_numel)) \
            if a.encode_device else (lambda: None)
        hook, cosines, seen = attacker(a) if a.attack else (None, [], None)
        run_local(loop, [Inner(t, dpg(), enc()) for t in trainers], ring, ring_hook=hook, on_coordinator=seen)
    vl = val_loss(t0.state.params)
    print(f"final val loss {vl:.4f} ({time.time() - start:.0f} s); {sent} bytes sent per node per outer step "
          f"({numel} values)", flush=True)
    for t in trainers:
        t.close(save=False)
    if a.attack:
        print("cosine of each applied average with the honest nodes' mean: "
              + " ".join(f"{c:.3f}" for c in cosines), flush=True)
    print(json.dumps({"args": vars(a), "val_loss": vl, "seconds": round(time.time() - start, 1),
                      "bytes_per_outer_step": sent, "numel": numel,
                      **({"min_cosine": min(cosines, default=None), "cosines": cosines} if a.attack else {})}))


def attacker(a: argparse.Namespace) -> tuple:
    """(ring_hook for run_local, the list it fills with each exchange's cosine between the
    average and the honest contributors' mean, run_local's on_coordinator): the attackers'
    communicators corrupt what they send (``testing.sim_world``'s attacks), every exchange's
    inputs and result are recorded; with ``--evict`` an attacker is evicted once the call it
    attacked has returned (the in-process ring produces no evidence; the coordinator's verdict on
    it is measured in ``benchmarks/byzantine_sim.py``)."""
    import jax
    import numpy as np

    from intellect_jax.testing.local_ring import LocalGroup
    from intellect_jax.testing.sim_world import ATTACKS, attack, corrupt

    bad = {f"node{1 + 4 * i}" for i in range(a.attackers)}
    sent: set[int] = set()  # ids of the first leaf of every attacked contribution
    kept: list = []  # ... held, so that no id is reused
    rounds: dict[str, int] = {}
    cosines: list[float] = []
    coord: list = []  # the in-process coordinator, once it runs
    honest_all = LocalGroup.all_reduce_mean_all

    def flat(tree) -> np.ndarray:
        return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])

    def recorded(self, trees, dropped=None, absent=frozenset()):
        results = honest_all(self, trees, dropped, absent)
        honest = [flat(t) for r, t in enumerate(trees) if r not in absent and id(jax.tree.leaves(t)[0]) not in sent]
        if len(honest) < len(trees) and honest:
            mean, res = np.mean(honest, axis=0), flat(results[0])
            cosines.append(float(mean @ res / (np.linalg.norm(mean) * np.linalg.norm(res) + 1e-30)))
        return results

    LocalGroup.all_reduce_mean_all = recorded

    def hook(name: str, comm):
        if name not in bad:
            return comm
        inner = comm.all_reduce_mean

        def attacked(tree, **kw):
            rounds[name] = k = rounds.get(name, 0) + 1
            tree = attack(tree, a.attack, a.nodes, k) if a.attack in ATTACKS else corrupt(tree, a.attack)
            kept.append(jax.tree.leaves(tree)[0])
            sent.add(id(kept[-1]))
            out = inner(tree, **kw)
            if a.evict:
                svc = coord[0].service
                svc.locked(lambda now: svc.membership.disconnect(name, None, now, f"steered round {k} (emulated)"))
                print(f"{name} evicted after attacked round {k}", flush=True)
            return out

        comm.all_reduce_mean = attacked
        return comm

    return hook, cosines, coord.append


if __name__ == "__main__":
    main()
