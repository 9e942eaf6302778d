"""Run metrics: `metrics.jsonl`, TensorBoard event files (tensorboardX) and a tqdm progress bar."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

# dense bf16 peak TFLOP/s per device, for the MFU estimate
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}


def peak_flops(device_kind: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    for name, tf in PEAK_TFLOPS.items():
        if name.lower() in device_kind.lower():
            return tf * 1e12
    return None


class MetricsLogger:
    """Writes one JSON line per logged step; only the writing process should create one. Thread
    safe: with overlapped DiLoCo rounds the trainer's thread and the outer loop's both log."""

    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int, progress: bool):
        from tqdm import tqdm

        SummaryWriter = _summary_writer()

        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        # (made here: tensorboardX checks, then creates, and two processes of one run directory, say
        # a node refused at registration and another, can race between the two)
        (run_dir / "tb").mkdir(parents=True, exist_ok=True)
        self._tb = SummaryWriter(str(run_dir / "tb"), flush_secs=10)
        self._bar = tqdm(total=total_steps, initial=start_step, disable=not progress,
                         unit="step", dynamic_ncols=True, mininterval=0.5)
        self._lock = threading.Lock()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._log(step, metrics)

    def _log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": round(time.time(), 3)}  # wall clock, for cross-node timelines
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(k, v, step)
        if "loss" in row:
            post = {"loss": f"{row['loss']:.4f}"}
            if "tokens_per_s" in row:
                post["tok/s"] = f"{row['tokens_per_s']:.0f}"
            if "val_loss" in row:
                post["val"] = f"{row['val_loss']:.4f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        self._bar.close()
        self._tb.close()
        self._file.close()


def _summary_writer() -> Any:
    """tensorboardX's ``SummaryWriter``, imported without torch: tensorboardX imports torch at
    import time when it is installed (only to accept torch tensors; this logs Python numbers),
    which cost every node process ~1.5 s of its ~4.7 s start-up (1.1 s of imports alone)."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # its `import torch` fails (caught there)
        try:
            import tensorboardX  # noqa: F401
        finally:
            if sys.modules.get("torch", 0) is None:
                del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    return SummaryWriter


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else v
    return v
