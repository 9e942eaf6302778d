"""`python -m intellect_jax.train --config configs/debug.toml [--section.key value ...]`"""

from __future__ import annotations

import sys

from intellect_jax.cli import run_main


def main(argv: list[str] | None = None) -> dict:
    from intellect_jax.config import parse_args

    cfg = parse_args(argv, description="Train a Llama-3 model on one node (all its devices).")
    from intellect_jax.trainer.distributed import setup_runtime

    setup_runtime(cfg.run, cfg.dist)
    from intellect_jax.trainer.loop import Trainer

    trainer = Trainer(cfg)
    try:
        last = trainer.train()
    finally:
        trainer.close()
    print(f"done: step {trainer.step}, loss {last.get('loss', float('nan')):.4f}, "
          f"val_loss {last.get('val_loss', float('nan')):.4f}, run dir {trainer.run_dir}")
    return last


if __name__ == "__main__":
    sys.exit(run_main(main))
