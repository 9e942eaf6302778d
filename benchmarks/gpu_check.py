"""The first thing to run on a GPU node (a script, installs nothing, needs no network):

    python benchmarks/gpu_check.py [--preset 1b] [--steps 40] [--seq 2048] [--batch-per-device 4]

Trains the preset in bf16 (cuDNN attention) on the bundled corpus for a few dozen steps with the
real trainer, on every local GPU (FSDP), and reports tokens/s and MFU against the H100's dense
bf16 peak (989 TFLOP/s per GPU); checks that the loss falls; runs the device int8 quantize
kernel against the host codec (`net.quant`) on a pseudo-gradient-sized array; prints one JSON
line. With `--preset debug --attention xla --seq 128 --steps 8` it also runs on a CPU, as a
smoke test (MFU is then unknown).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch-per-device", type=int, default=4)
    ap.add_argument("--attention", default="cudnn", choices=["cudnn", "xla", "auto"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per device (H100: 989)")
    a = ap.parse_args()

    import jax
    import numpy as np

    from intellect_jax import config as C
    from intellect_jax.diloco.device_pg import default_quantize, kernel_available
    from intellect_jax.net import quant
    from intellect_jax.trainer.loop import Role, Trainer

    devs = jax.devices()
    out: dict = {"devices": len(devs), "device_kind": devs[0].device_kind, "platform": devs[0].platform,
                 "preset": a.preset}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = C.validate({
            "run": {"name": "gpu-check", "out_dir": tmp, "steps": a.steps, "log_every": 1, "eval_every": 0,
                    "progress": False, "peak_tflops": a.peak_tflops if devs[0].platform == "gpu" else None},
            "model": {"preset": a.preset, "compute_dtype": "bfloat16", "attention_impl": a.attention},
            "data": {"seq_len": a.seq, "batch_size": a.batch_per_device * len(devs), "cache_dir": f"{tmp}/cache"},
            "optim": {"lr": 3e-4, "warmup_steps": max(1, a.steps // 10), "decay_steps": max(1, a.steps // 5)},
            "ckpt": {"every": 0},
        })
        t = Trainer(cfg, role=Role.INNER)
        t0 = time.perf_counter()
        t.train()
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (t.run_dir / "metrics.jsonl").read_text().splitlines()]
        t.close(save=False)
    steady = [r for r in rows if r["step"] > max(2, a.steps // 4)]  # after warm-up
    loss = [r["loss"] for r in rows]
    out.update({"params": t.mcfg.num_params(), "compile_s": rows[0].get("compile_s"), "wall_s": round(wall, 1),
                "tokens_per_s": round(float(np.median([r["tokens_per_s"] for r in steady])), 1),
                "mfu": (round(float(np.median([r["mfu"] for r in steady])), 4) if steady[0].get("mfu") else None),
                "loss_first": round(loss[0], 4), "loss_last": round(loss[-1], 4),
                "loss_falls": bool(np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.1)})
    x = np.random.default_rng(0).standard_normal(25_000_000).astype(np.float32)
    x[::1000] *= 30  # outliers, as pseudo-gradients have
    on_gpu, quantize = kernel_available(), default_quantize()  # the Triton kernel, or the host codec on CPU
    xd = jax.device_put(x)
    jax.block_until_ready(quantize(xd, 64))  # compile
    t0 = time.perf_counter()
    scale, codes = jax.block_until_ready(quantize(xd, 64))
    dt = time.perf_counter() - t0
    scale, codes = np.asarray(scale), np.asarray(codes)
    ref_scale, ref_codes = quant.quantize_int8(x, 64)
    diff = int(np.count_nonzero(codes != ref_codes))
    out["quantize"] = {"on_gpu": on_gpu, "numel": x.size, "seconds": round(dt, 3),
                       "scales_equal": bool(np.array_equal(scale.view(np.uint32), ref_scale.view(np.uint32))),
                       "codes_differing": diff, "max_code_diff": int(np.max(np.abs(codes.astype(np.int16)
                                                                                  - ref_codes.astype(np.int16))))}
    out["ok"] = out["loss_falls"] and out["quantize"]["scales_equal"] and out["quantize"]["codes_differing"] == 0
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
