"""`python -m intellect_jax.eval --checkpoint runs/<name> --data FILE [--step N] [--field text]`

Prints one JSON line: mean loss per token, token count and perplexity on a txt/jsonl/parquet
file (or directory), tokenized with the run's own tokenizer."""

from __future__ import annotations

import argparse
import json
import math
import sys

from intellect_jax.cli import run_main


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.eval", description=__doc__.split("\n\n")[1])
    ap.add_argument("--checkpoint", required=True, help="run directory (runs/<name>)")
    ap.add_argument("--data", required=True, help="a .txt/.jsonl/.parquet file or a directory of them")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--field", default="text", help="jsonl field / parquet column")
    ap.add_argument("--seq-len", type=int, default=None, help="window length (default: the run's)")
    ap.add_argument("--batch-size", type=int, default=8)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    import jax
    import numpy as np

    from intellect_jax.data.errors import DataError
    from intellect_jax.data.pipeline import make_eval_batches
    from intellect_jax.trainer import step as T
    from intellect_jax.trainer.load import load_run

    run = load_run(args.checkpoint, args.step)
    L = args.seq_len or run.cfg.data.seq_len
    n_dev = run.mesh.size
    B = max(n_dev, args.batch_size - args.batch_size % n_dev)
    sh = T.batch_sharding(run.mesh, (B, L + 1))
    evaluate = jax.jit(T.make_eval_step(run.graphdef), out_shardings=None)
    tot, n = 0.0, 0
    for batch in make_eval_batches(args.data, run.tok, L, B, args.field):
        tok = np.asarray(batch["tokens"], np.int32)
        rows = tok.shape[0]
        if rows < B:  # pad the last batch; only its real rows are counted
            tok = np.concatenate([tok, np.zeros((B - rows, L + 1), np.int32)])
        nll_B = jax.device_get(evaluate(run.params, jax.device_put(tok, sh)))
        tot, n = tot + float(np.sum(nll_B[:rows])), n + rows * L
    if n == 0:
        raise DataError(f"--data {args.data}: fewer than {L + 1} tokens, not one window to score")
    out = {"checkpoint": str(args.checkpoint), "step": run.step, "data": args.data,
           "loss": tot / n, "tokens": int(n), "perplexity": math.exp(tot / n)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(run_main(main))
