"""`python -m intellect_jax.plot runs/<name> [more runs] [--out DIR]`: PNG plots from metrics.jsonl.

Writes loss.png (train and validation loss), lr.png and throughput.png into the run directory
(or --out); for a DiLoCo node also utilization.png, sync.png (sync time and the inner loop's
wait per outer step), nodes.png (active nodes over steps) and, with data leases, goodput.png
(the run's tokens trained / tokens computed, as the coordinator counted them). Several runs (e.g. a node of a
synchronous and of an overlapped run) are drawn on the same axes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from intellect_jax.cli import run_main

PLOTS = {
    "loss": ("loss", [("loss", "train"), ("val_loss", "validation")]),
    "lr": ("learning rate", [("lr", "lr")]),
    "throughput": ("tokens / s", [("tokens_per_s", "tokens/s")]),
    # DiLoCo runs (one point per outer step)
    "utilization": ("compute utilization", [("utilization", "compute / (compute + idle)")]),
    "sync": ("seconds per outer step", [("sync_s", "sync"), ("overlap_wait_s", "inner loop waited")]),
    "nodes": ("active nodes", [("nodes", "nodes in the epoch")]),
    "goodput": ("goodput (data leases)", [("goodput", "tokens trained / computed")]),
}
MARKED = {"val_loss", "utilization", "sync_s", "overlap_wait_s", "goodput"}


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is this a run directory?)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{i}: not a JSON line") from None
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.plot", description=__doc__.split("\n\n")[1])
    ap.add_argument("run_dir", nargs="+", help="one run, or several drawn on the same axes (e.g. a synchronous "
                    "and an overlapped DiLoCo node)")
    ap.add_argument("--out", default=None, help="where to write the PNGs (default: the first run dir)")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [Path(d) for d in args.run_dir]
    rows_of = [read_metrics(run / "metrics.jsonl") for run in runs]
    names = [run.name if len(runs) == 1 else "/".join(run.parts[-2:]) for run in runs]
    out_dir = Path(args.out) if args.out else runs[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (ylabel, keys) in PLOTS.items():
        if not any(series(rows, key)[0] for rows in rows_of for key, _ in keys):
            continue  # e.g. no DiLoCo metrics in a single-node run
        fig, ax = plt.subplots(figsize=(7, 4))
        for run_name, rows in zip(names, rows_of, strict=True):
            for key, label in keys:
                x, y = series(rows, key)
                label = label if len(runs) == 1 else f"{run_name}: {label}"
                if not x:
                    continue
                if key == "nodes":
                    ax.step(x, y, where="post", label=label)
                else:
                    ax.plot(x, y, marker="o" if key in MARKED else None, ms=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{' vs '.join(names)}: {ylabel}")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        path = out_dir / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    print(" ".join(str(p) for p in written))
    return written


if __name__ == "__main__":
    sys.exit(run_main(main))
