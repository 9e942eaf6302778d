"""The first thing to run on a GPU node (a script, installs nothing, needs no network):

    python benchmarks/gpu_check.py [--preset 1b] [--layers N] [--remat] [--head-chunk N] [--steps 40]
                                   [--seq 2048] [--batch-per-device 4] [--bare-steps 5] [--no-kernel]

Trains the preset in bf16 (attention "auto": cuDNN's fused kernel on a GPU) on the bundled
corpus for a few dozen steps with the real trainer, on every local GPU (FSDP), and reports
tokens/s and MFU against the H100's dense bf16 peak (989 TFLOP/s per GPU); checks that the loss
falls; reports the compiled train step's memory (XLA's analysis on the real device, the figure
`python -m intellect_jax.memory --target h100` predicts without one) beside the allocator's
measured peak and limit; runs the device int8 quantize kernel against the host codec
(`net.quant`) on a pseudo-gradient-sized array; prints one JSON line. With `--preset debug
--attention xla --seq 128 --steps 8` it also runs on a CPU, as a smoke test (MFU is then unknown).
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


def bare_steps(t, n: int, peak_tflops: float) -> dict:
    """The compiled train step alone: ``n`` steps on one device-resident batch of random tokens,
    after one untimed step; and the host data pipeline alone, over as many batches. Tells a
    slow program from a starved one."""
    import jax
    import numpy as np

    B, L = t.cfg.data.batch_size, t.cfg.data.seq_len
    rng = np.random.default_rng(0)
    tok = t._device_batch(rng.integers(0, t.mcfg.vocab_size, (B, L + 1), dtype=np.int32))
    state, m = t._train(t.state, tok)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(n):
        state, m = t._train(state, tok)
    jax.block_until_ready((state, m))
    step_s = (time.perf_counter() - t0) / n
    t.state = state  # the old one was donated
    t0 = time.perf_counter()
    for _ in range(n):
        next(t.data)
    data_s = (time.perf_counter() - t0) / n
    flops = t.mcfg.flops_per_token(L) * B * L
    dev = jax.devices()[0]
    return {"step_s": round(step_s, 4), "tokens_per_s": round(B * L / step_s, 1),
            "mfu": round(flops / step_s / (peak_tflops * 1e12 * len(jax.devices())), 4) if dev.platform == "gpu" else None,
            "data_s_per_batch": round(data_s, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch-per-device", type=int, default=4)
    ap.add_argument("--attention", default="auto", choices=["cudnn", "xla", "auto"])
    ap.add_argument("--layers", type=int, default=None, help="override the preset's depth (a shallower model of its shape)")
    ap.add_argument("--head-chunk", type=int, default=None, help="logits per chunk of the fused head + loss "
                    "(default: the platform's, model.config.HEAD_CHUNK_LOGITS)")
    ap.add_argument("--remat", action="store_true", help="rematerialize each layer in the backward pass")
    ap.add_argument("--bare-steps", type=int, default=5, help="steps timed on one device-resident batch (no data loading)")
    ap.add_argument("--no-kernel", action="store_true", help="skip the quantize kernel check")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per device (H100: 989)")
    a = ap.parse_args()

    from intellect_jax import config as C
    from intellect_jax.trainer.distributed import set_mem_fraction

    fraction = set_mem_fraction(C.RunConfig().gpu_mem_fraction)  # before JAX's GPU backend starts, as a node does
    import jax
    import numpy as np

    from intellect_jax.memory import _memory
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
            "model": {"preset": a.preset, "compute_dtype": "bfloat16", "attention_impl": a.attention,
                      **({"remat": True} if a.remat else {}), **({"num_layers": a.layers} if a.layers else {}),
                      **({"head_chunk_logits": a.head_chunk} if a.head_chunk else {})},
            "data": {"seq_len": a.seq, "batch_size": a.batch_per_device * len(devs), "cache_dir": f"{tmp}/cache"},
            "optim": {"lr": 3e-4, "warmup_steps": max(1, a.steps // 10), "decay_steps": max(1, a.steps // 5)},
            "ckpt": {"every": 0},
        })
        t = Trainer(cfg, role=Role.INNER)
        t0 = time.perf_counter()
        t.train()
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (t.run_dir / "metrics.jsonl").read_text().splitlines()]
        out["bare"] = bare_steps(t, a.bare_steps, a.peak_tflops)
        from intellect_jax.aot import hlo

        text = t._train.as_text()  # the compiled train step
        stats = devs[0].memory_stats() or {}
        out["memory"] = {"compiled": _memory(t._train), "attention": hlo.attention(text),
                         "cudnn_calls": hlo.cudnn_calls(text), "mem_fraction": fraction,
                         "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit")}
        t.close(save=False)
    steady = [r for r in rows if r["step"] > max(2, a.steps // 4)] or rows[-1:]  # after warm-up
    loss = [r["loss"] for r in rows]
    out.update({"params": t.mcfg.num_params(), "head_chunk_logits": t.mcfg.head_chunk_logits, "compile_s": rows[0].get("compile_s"), "wall_s": round(wall, 1),
                "tokens_per_s": round(float(np.median([r["tokens_per_s"] for r in steady])), 1),
                "mfu": (round(float(np.median([r["mfu"] for r in steady])), 4) if steady[0].get("mfu") else None),
                "loss_first": round(loss[0], 4), "loss_last": round(loss[-1], 4),
                "loss_falls": bool(np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.1)})
    if a.no_kernel:
        out["ok"] = out["loss_falls"]
        print(json.dumps(out), flush=True)
        return
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
