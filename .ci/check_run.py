"""CI check of the default training run: the loss fell and throughput figures are sane."""

import json
import statistics
import sys
from pathlib import Path

rows = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
loss = [r["loss"] for r in rows if r.get("loss") is not None]
val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
tps = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s") is not None and r["step"] > 10]
med = statistics.median(tps)
print(f"train loss {loss[0]:.3f} -> {loss[-1]:.3f}, val loss {val[0]:.3f} -> {val[-1]:.3f}, "
      f"tokens/s median {med:.0f}, max {max(tps):.0f}, min {min(tps):.0f}")
assert loss[-1] < loss[0] - 2.0, "the training loss did not fall"
assert val[-1] < val[0], "the validation loss did not fall"
assert max(tps) <= 2 * med, f"a tokens/s value above 2x the median ({max(tps):.0f} vs {med:.0f})"
