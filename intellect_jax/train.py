"""`python -m intellect_jax.train --config configs/debug.toml [--section.key value ...]`

One node: all its local devices (and, with `[dist]`, all its hosts). With `--diloco.enabled`
the node joins an elastic DiLoCo run through `--diloco.coordinator host:port`."""

from __future__ import annotations

import sys

from intellect_jax.cli import run_main


def main(argv: list[str] | None = None) -> dict:
    from intellect_jax.config import parse_args

    cfg = parse_args(argv, description="Train a Llama-3 model on one node (all its devices).")
    from intellect_jax.trainer.distributed import setup_runtime

    setup_runtime(cfg.run, cfg.dist)
    if cfg.diloco.enabled:
        return _diloco(cfg)
    from intellect_jax.trainer.loop import Trainer

    trainer = Trainer(cfg)
    try:
        last = trainer.train()
    finally:
        trainer.close()
    print(f"done: step {trainer.step}, loss {last.get('loss', float('nan')):.4f}, "
          f"val_loss {last.get('val_loss', float('nan')):.4f}, run dir {trainer.run_dir}")
    return last


def _diloco(cfg) -> dict:
    import jax

    from intellect_jax.diloco.node import DilocoNode, run_follower
    from intellect_jax.diloco.state import state_hash

    if jax.process_index() != 0:  # process 0 speaks for a multi-process node; the others follow it
        n = run_follower(cfg)
        print(f"done: process {jax.process_index()} of the node followed {n} commands", flush=True)
        return {"commands": n}
    node = DilocoNode(cfg)
    try:
        outcome = node.run()
    finally:
        node.close()
    s = node.loop.state if node.loop is not None else None
    if s is None:  # registered after the run had completed: nothing to do
        print(f"done: node {node.node_id}, {outcome.value}", flush=True)
        return {"outcome": outcome.value}
    h = state_hash(s)
    print(f"done: node {node.node_id}, {outcome.value}, outer step {s.outer_step}, step {node.trainer.step}, "
          f"hash {h}", flush=True)
    return {"outcome": outcome.value, "outer_hash": h, "outer_step": s.outer_step}


if __name__ == "__main__":
    sys.exit(run_main(main))
