"""`python -m intellect_jax.export --checkpoint runs/<name> [--step N] --out DIR`

Writes a Hugging Face directory (config.json, safetensors, generation_config.json, tokenizer)
that `transformers` loads offline. The directory appears only when complete."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from intellect_jax.cli import run_main


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.export", description=__doc__.split("\n\n")[1])
    ap.add_argument("--checkpoint", required=True, help="run directory (runs/<name>)")
    ap.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size limit")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)

    from intellect_jax.data.tokenizer import save_hf_tokenizer
    from intellect_jax.model.hf import export_hf
    from intellect_jax.trainer.load import load_run

    run = load_run(args.checkpoint, args.step)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = save_hf_tokenizer(run.tok, Path(tmp) / "tokenizer", run.model_cfg.max_seq_len)
        out = export_hf(
            run.params, run.model_cfg, args.out, tokenizer_dir=str(tok_dir), dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_gb * 2**30), bos_id=run.tok.bos_id,
            eos_id=run.tok.eos_id, overwrite=args.overwrite,
        )
    print(f"exported step {run.step} of {args.checkpoint} to {out}")
    return Path(out)


if __name__ == "__main__":
    sys.exit(run_main(main))
