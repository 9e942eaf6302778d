"""Train-step speed on CPU: our jitted step vs transformers' `LlamaForCausalLM`, same model and batch.

Ours is the exact function the trainer runs (`make_train_step` + `compile_steps`: forward,
backward, z-loss, global-norm clip, AdamW update, state donated) on ONE CPU device. Torch is
`LlamaForCausalLM` (sdpa attention) with labels, `loss.backward()`, `clip_grad_norm_` (ours clips
too; `--clip 0` turns it off on both sides), `torch.optim.AdamW` (fused kernel when available),
`zero_grad`. Both start from the same weights (ours exported with `export_hf`), so the first-step
losses printed must agree; both see the same tokens [B, L+1] (inputs [:, :-1], targets [:, 1:]).

Threads: XLA:CPU has no thread-count option; its intra-op (Eigen) pool is sized from the process
CPU affinity mask. So `--threads N` pins this process to the first N allowed cores *before* jax
or torch start (`os.sched_setaffinity`) and calls `torch.set_num_threads(N)`: both frameworks then
use N threads. Default: all cores this process may use. Compile and `--warmup` steps are excluded;
jax is timed with `jax.block_until_ready` on every step. Timed steps alternate jax / torch so a
busy machine loads both alike; the median step time is reported, with the ratio of fastest steps.
Under heavy background load torch's OpenMP threads suffer far more than XLA's pool, which
inflates the 2-thread ratio: check `--threads 1` too (and `uptime`) before trusting a number.

Run (from the repo root):
    python benchmarks/step_speed.py                                   # debug preset, B16 x L128
    python benchmarks/step_speed.py --hidden-size 512 --layers 8 --heads 8 --kv-heads 4 \\
        --ffn 1536 --batch 8 --seq 256                                # a larger model
    python benchmarks/step_speed.py --dtype bf16 --json               # ours bf16 vs torch autocast bf16
    XLA_FLAGS=--xla_cpu_use_onednn=true python benchmarks/step_speed.py --only jax    # try XLA flags
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="debug")
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compilation")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for both (0: all allowed cores)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--clip", type=float, default=1.0, help="grad-norm clip, both sides (0: off)")
    p.add_argument("--z-weight", type=float, default=2e-4, help="our z-loss weight (trainer default)")
    p.add_argument("--only", choices=["jax", "torch"], help="run one side only (own init weights)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args(argv)


def pin_threads(n: int) -> int:
    """Restrict this process to n cores (before jax/torch start their pools); return n."""
    cores = sorted(os.sched_getaffinity(0))
    n = n or len(cores)
    if not 1 <= n <= len(cores):
        raise SystemExit(f"--threads must be 1..{len(cores)}, got {n}")
    os.sched_setaffinity(0, cores[:n])
    return n


def model_config(a: argparse.Namespace):
    from intellect_jax.model.config import ModelConfig

    over = {"hidden_size": a.hidden_size, "num_layers": a.layers, "num_heads": a.heads,
            "num_kv_heads": a.kv_heads, "ffn_size": a.ffn, "vocab_size": a.vocab}
    over = {k: v for k, v in over.items() if v is not None}
    dt = "float32" if a.dtype == "fp32" else "bfloat16"
    return ModelConfig.preset(a.preset, compute_dtype=dt, param_dtype="float32",
                              max_seq_len=max(a.seq, 8), **over)


def prepare(step, n_warm: int) -> tuple[float, float]:
    """Run `step` once (jax: compile) and `n_warm` more times; return (first-call s, first loss)."""
    t0 = time.perf_counter()
    loss0 = float(step())
    first = time.perf_counter() - t0
    for _ in range(n_warm):
        step()
    return first, loss0


def time_interleaved(steps: dict, n: int) -> dict[str, list[float]]:
    """Time n calls of each step, alternating frameworks so both see the same background load."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(n):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()  # blocks until the step is done
            times[name].append(time.perf_counter() - t0)
    return times


def bench_jax(cfg, a, tok_np, hf_dir: Path | None):
    import jax

    from intellect_jax.model.hf import export_hf
    from intellect_jax.model.sharding import make_mesh
    from intellect_jax.trainer import step as T
    from intellect_jax.trainer.optim import OptimConfig, make_schedule, make_tx

    ocfg = OptimConfig(lr=1e-4, schedule="constant", warmup_steps=0, clip_norm=a.clip,
                       z_loss_weight=a.z_weight)
    total = 1 + a.warmup + a.steps
    tx, sched = make_tx(ocfg), make_schedule(ocfg, total)
    mesh = make_mesh(devices=jax.devices()[:1])  # one CPU device: the fair comparison
    graphdef, _, sh = T.state_shardings(cfg, tx, mesh)
    state = T.init_state(cfg, tx, mesh, a.seed, sh)
    if hf_dir is not None:  # hand torch the same initial weights
        export_hf(state.params, cfg, hf_dir)
    bsh = T.batch_sharding(mesh, tok_np.shape)
    train, _ = T.compile_steps(
        T.make_train_step(graphdef, tx, sched, z_weight=ocfg.z_loss_weight),
        T.make_eval_step(graphdef), sh, bsh)
    batch = jax.device_put(tok_np, bsh)
    box = [state]

    def step() -> float:
        box[0], metrics = train(box[0], batch)
        jax.block_until_ready((box[0], metrics))
        return metrics["loss"]

    return step


def bench_torch(cfg, a, tok_np, hf_dir: Path | None, threads: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(a.seed)
    hf = cfg.to_hf()
    rope = {"rope_type": "default"} if hf["rope_scaling"] is None else dict(hf["rope_scaling"])
    rope["rope_theta"] = hf["rope_theta"]
    skip = {"architectures", "model_type", "torch_dtype", "rope_scaling", "rope_theta"}
    kw = {k: v for k, v in hf.items() if k not in skip}
    hcfg = LlamaConfig(**kw, rope_parameters=rope, use_cache=False)
    model = LlamaForCausalLM._from_config(hcfg, attn_implementation="sdpa", dtype=torch.float32)
    if hf_dir is not None:
        from intellect_jax.model.hf import hf_tensors

        sd = {n: torch.from_numpy(x.copy()) for n, x in hf_tensors(hf_dir)}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.train()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.1, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.1, foreach=True)
    tok = torch.from_numpy(tok_np.astype("int64"))
    inp, tgt = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    bf16 = a.dtype == "bf16"

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=inp, labels=tgt, shift_labels=tgt).loss
        loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def summarize(first: float, loss0: float, times: list[float], tokens: int, flops_tok: float) -> dict:
    med = statistics.median(times)
    return {"first_call_s": first, "median_step_s": med, "min_step_s": min(times),
            "max_step_s": max(times), "tokens_per_s": tokens / med,
            "gflops_per_s": flops_tok * tokens / med / 1e9, "first_loss": loss0}


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    threads = pin_threads(a.threads)  # before jax / torch create their thread pools
    import numpy as np

    cfg = model_config(a)
    tokens = a.batch * a.seq
    rng = np.random.default_rng(a.seed)
    tok_np = rng.integers(0, cfg.vocab_size, (a.batch, a.seq + 1), dtype=np.int32)
    res: dict = {
        "config": {"preset": a.preset, **cfg.model_dump(include={
            "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size",
            "compute_dtype"})},
        "batch": a.batch, "seq": a.seq, "steps": a.steps, "warmup": a.warmup,
        "threads": threads, "dtype": a.dtype, "clip": a.clip, "z_weight": a.z_weight,
        "num_params": cfg.num_params(), "load_avg": os.getloadavg(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    flops_tok = cfg.flops_per_token(a.seq)
    steps, prep = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf" if a.only is None else None
        if a.only in (None, "jax"):
            import jax

            assert jax.devices()[0].platform == "cpu", jax.devices()
            steps["jax"] = bench_jax(cfg, a, tok_np, hf_dir)
        if a.only in (None, "torch"):
            steps["torch"] = bench_torch(cfg, a, tok_np, hf_dir, threads)
    for name, step in steps.items():  # first losses: both see the same weights and tokens
        prep[name] = prepare(step, a.warmup)
    for name, times in time_interleaved(steps, a.steps).items():
        res[name] = summarize(*prep[name], times, tokens, flops_tok)
    if "jax" in res and "torch" in res:
        res["ratio_ours_over_torch"] = res["jax"]["tokens_per_s"] / res["torch"]["tokens_per_s"]
        res["ratio_of_min_steps"] = res["torch"]["min_step_s"] / res["jax"]["min_step_s"]
    res["load_avg_end"] = os.getloadavg()
    if a.json:
        print(json.dumps(res, indent=2))
        return res
    c = res["config"]
    print(f"model: {a.preset} D={c['hidden_size']} layers={c['num_layers']} heads={c['num_heads']}/"
          f"{c['num_kv_heads']} F={c['ffn_size']} V={c['vocab_size']} ({res['num_params'] / 1e6:.1f}M "
          f"params) | batch {a.batch} x seq {a.seq} | {a.dtype} | threads {threads} | "
          f"load {res['load_avg'][0]:.2f} -> {res['load_avg_end'][0]:.2f}")
    for name in ("jax", "torch"):
        if name in res:
            r = res[name]
            print(f"  {name:5s}  median {r['median_step_s'] * 1e3:8.1f} ms  (min {r['min_step_s'] * 1e3:.1f}, "
                  f"max {r['max_step_s'] * 1e3:.1f})  {r['tokens_per_s']:9.0f} tok/s  "
                  f"{r['gflops_per_s']:6.1f} GFLOP/s  first call {r['first_call_s']:.2f} s  "
                  f"loss0 {r['first_loss']:.4f}")
    if "ratio_ours_over_torch" in res:
        print(f"  ours / torch tokens/s: {res['ratio_ours_over_torch']:.2f}x of medians, "
              f"{res['ratio_of_min_steps']:.2f}x of fastest steps  (target >= 1.5x)")
    return res


if __name__ == "__main__":
    main()
