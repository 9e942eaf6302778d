"""`python -m intellect_jax.memory --config configs/10b.toml [--target h100] [--devices 8] [--section.key value ...]`

Does a config's training fit? Compiles, ahead of time and without allocating anything, the real
train step and eval step of the config (its model, batch, micro-batches, mesh, remat, dtypes)
and the DiLoCo device programs (the pseudo-gradient and the merge of an overlapped round) from
abstract inputs, for ``--target``: ``cpu`` (fake CPU devices: XLA:CPU) or a GPU this machine
need not have (``h100``, ``h200``, ``a100``: XLA:GPU through JAX's compile-only topologies, the
``[aot]`` extra). Prints per device XLA's memory analysis of each program (arguments, outputs,
what the donated state lets it reuse, temporaries, peak), what a DiLoCo node keeps on its
devices beside the train step, the margin under the memory JAX lets the program use on the
GPU (``run.gpu_mem_fraction`` of it, less ``--reserve-gb`` for what a compile without the GPU
misses: its autotuning's choices; the CUDA context and NCCL live outside that share), the attention kernel, the collectives and whether the scheduler
overlaps them with compute, and the FLOPs per step with the step time 40% MFU would give;
then one JSON line. Data, tokenizer and checkpoints are never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from intellect_jax.cli import run_main

GiB = 2**30
MFU = 0.40  # the utilization the step-time figure assumes


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.memory", description=__doc__.split("\n\n")[1])
    ap.add_argument("--config", required=True)
    ap.add_argument("--target", default="cpu", help="cpu (fake CPU devices), or a GPU to compile for: h100, h200, "
                    "a100; a comma list (h100,cpu) compiles for each and prints them side by side")
    ap.add_argument("--devices", type=int, default=None,
                    help="devices of one node (default: 8 for a GPU target; on CPU, all visible, or that many fake)")
    ap.add_argument("--reserve-gb", type=float, default=2.0,
                    help="GiB of the allocator's share kept for what a compile-only analysis misses (default 2)")
    args, rest = ap.parse_known_args(argv)
    if args.devices is not None and not 1 <= args.devices <= 1024:
        ap.error(f"--devices {args.devices}: one node has 1 to 1024 devices")
    from intellect_jax.aot.targets import TARGETS

    args.targets = [t.strip() for t in args.target.split(",")]
    for t in args.targets:
        if t != "cpu" and t not in TARGETS:
            ap.error(f"--target {t}: choose from cpu, {', '.join(sorted(TARGETS))} (or a comma list of them)")
    if len(set(args.targets)) != len(args.targets):
        ap.error(f"--target {args.target}: a target appears twice")
    if not 0 <= args.reserve_gb < 1024:
        ap.error(f"--reserve-gb {args.reserve_gb}: 0 to 1024")
    return args, rest


def _start_jax(args: argparse.Namespace) -> None:
    """Environment jax must see when it starts: CPU only for a GPU target (its devices come from
    a compile-only topology), else the fake CPU devices asked for."""
    if "jax" in sys.modules:
        return
    gpu = any(t != "cpu" for t in args.targets)
    if gpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    n = args.devices or (8 if gpu else None)
    if "cpu" in args.targets and n and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")  # fake CPU devices must exist before jax starts
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _memory(compiled: Any) -> dict[str, int]:
    ma = compiled.memory_analysis()
    r = {"arguments_bytes": ma.argument_size_in_bytes, "outputs_bytes": ma.output_size_in_bytes,
         "aliased_bytes": ma.alias_size_in_bytes, "temporaries_bytes": ma.temp_size_in_bytes}
    # donated arguments are reused for the outputs
    r["peak_bytes"] = r["arguments_bytes"] + r["outputs_bytes"] - r["aliased_bytes"] + r["temporaries_bytes"]
    return r


def _program(fn: Any, ins: tuple, flops: float | None, peak_flops: float) -> dict[str, Any]:
    from intellect_jax.aot import hlo

    t0 = time.perf_counter()
    compiled = fn.lower(*ins).compile()
    r: dict[str, Any] = {"compile_s": round(time.perf_counter() - t0, 1), **_memory(compiled)}
    text = compiled.as_text()
    r["attention"] = hlo.attention(text)
    r["cudnn_calls"] = hlo.cudnn_calls(text)
    r["collectives"] = hlo.collectives(text).summary()
    if flops is not None:
        r["flops_per_device"] = flops
        r["step_s_at_40pct_mfu"] = flops / (MFU * peak_flops)
    return r


def _bytes(tree: Any, n: int, dtype: Any = None) -> int:
    """Per-device bytes of a tree sharded over ``n`` devices (``dtype``: as if of that type)."""
    import jax
    import numpy as np

    return sum(int(np.prod(a.shape)) * np.dtype(dtype or a.dtype).itemsize for a in jax.tree.leaves(tree)) // n


def main(argv: list[str] | None = None) -> dict:
    """One report per ``--target`` (a comma list compiles for each in one process), then, for
    several, a table of them side by side; one JSON line holds them all."""
    args, rest = _parse(argv)
    _start_jax(args)
    from intellect_jax.config import parse_args

    cfg = parse_args(["--config", args.config, *rest])
    if any(t != "cpu" for t in args.targets):
        import jax

        # a compile-only executable cannot be stored or loaded (no client): keep the cache out
        jax.config.update("jax_enable_compilation_cache", False)
    reports = [_report(cfg, args, target) for target in args.targets]
    for r in reports:
        _print(r)
    if len(reports) > 1:
        _table(reports)
    out = reports[0] if len(reports) == 1 else {"config": args.config, "targets": reports}
    print(json.dumps(out), flush=True)
    return out


def _report(cfg: Any, args: argparse.Namespace, target: str) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from intellect_jax.aot import targets
    from intellect_jax.diloco import device_pg
    from intellect_jax.model import sharding as S
    from intellect_jax.model.config import ConfigError
    from intellect_jax.model.llama import Llama
    from intellect_jax.trainer import step as T
    from intellect_jax.trainer.distributed import mem_fraction
    from intellect_jax.trainer.metrics import peak_flops
    from intellect_jax.trainer.optim import make_schedule, make_tx

    gpu = target != "cpu"
    n = args.devices or (8 if gpu else len(jax.devices("cpu")))
    if gpu:
        devices = targets.devices(target, n)
    else:
        devices = jax.devices("cpu")
        if n > len(devices):
            raise ConfigError(f"--devices {n}: only {len(devices)} cpu devices here")
    ref = targets.spec(target if gpu else "h100")  # the GPU the margin and step time are for
    mesh = S.make_mesh(cfg.mesh.fsdp, cfg.mesh.tp, devices[:n])
    mcfg = cfg.model.build().on_platform(*S.platform(mesh))
    B, L = cfg.data.batch_size, cfg.data.seq_len
    micro = cfg.run.micro_batch_size or B
    if B % micro:
        raise ConfigError(f"data.batch_size ({B}) must be a multiple of run.micro_batch_size ({micro})")
    tx = make_tx(cfg.optim)
    graphdef, abstract, shardings = T.state_shardings(mcfg, tx, mesh)
    batch_sh = T.batch_sharding(mesh, (B, L + 1))
    train, evaluate = T.compile_steps(
        T.make_train_step(graphdef, tx, make_schedule(cfg.optim, cfg.run.steps), z_weight=cfg.optim.z_loss_weight,
                          micro_steps=B // micro),
        T.make_eval_step(graphdef, B // micro), shardings, batch_sh)
    batch = jax.ShapeDtypeStruct((B, L + 1), np.int32, sharding=batch_sh)
    report = S.memory_report(lambda: Llama(mcfg, rngs=nnx.Rngs(0)), dict(mesh.shape))
    fraction = mem_fraction(cfg.run.gpu_mem_fraction)  # the share a node runs with
    usable = int(fraction * ref.memory_bytes - args.reserve_gb * GiB)
    step_flops = mcfg.flops_per_token(L) * B * L / n  # analytic: XLA:GPU gives no cost analysis
    peak = peak_flops(ref.name, cfg.run.peak_tflops)  # the trainer's MFU table (dense bf16)
    out: dict = {"config": args.config, "target": target, "device_kind": devices[0].device_kind, "devices": n,
                 "platform": devices[0].platform, "mesh": dict(mesh.shape), "batch": [B, L], "micro_batch": micro,
                 "params": report["num_params"], "attention_impl": mcfg.attention_impl,
                 "analytic_params_and_opt_bytes": int(report["total_bytes_per_device"]),
                 "usable_bytes": usable, "usable_of": ref.name, "mem_fraction": fraction,
                 "reserve_bytes": int(args.reserve_gb * GiB)}
    out["train"] = _program(train, (abstract, batch), step_flops, peak)
    out["eval"] = _program(evaluate, (abstract.params, batch), step_flops / 3, peak)  # forward only
    from intellect_jax.diloco.device_pg import pg_path

    d = cfg.diloco
    encodes = pg_path(d, 1, kernel=gpu, gpu=gpu).encode  # a single-process node's path on this target
    out["diloco"] = _diloco(abstract, n, device_pg, (d.wire_mode, d.wire_block) if encodes else None,
                            shifted=bool(encodes and d.feedback_local))
    held = out["diloco"]["resident_bytes"]
    out["node_peak_bytes"] = out["train"]["peak_bytes"] + held
    # evaluation runs at a window, beside the train state and what DiLoCo holds; a DiLoCo node
    # evaluates its outer params, placed on the devices as one more copy (the eval's arguments)
    ev = out["eval"]
    out["eval_node_peak_bytes"] = (out["train"]["arguments_bytes"] + held + ev["arguments_bytes"]
                                   + ev["outputs_bytes"] + ev["temporaries_bytes"])
    out["margin_bytes"] = usable - max(out["node_peak_bytes"], out["eval_node_peak_bytes"])
    if gpu:
        out["kernel"] = _kernel(ref.compute_capability, cfg.diloco.block_size)
    return out


def _diloco(abstract: Any, n: int, device_pg: Any, sparse: tuple[str, int] | None = None,
            shifted: bool = False) -> dict[str, Any]:
    """The DiLoCo device programs, compiled for the largest leaf (they run one leaf at a time),
    and what an overlapped node keeps on its devices while a round trains: the anchor (the
    params the round started from), the captured pseudo-gradient (fp32) until it is pulled, the
    next outer params once placed, and a copy of the optimizer state at a checkpoint window.
    ``sparse``: (wire mode, chunk) of a top-k / top-1 / int1 contribution encoded on the devices
    (``diloco/device_codec.py``), which also keeps its error-feedback residual there (fp32), the
    next one while it encodes, and the encoding's temporaries (its program compiled for the
    largest leaf, a bucket of its own), beside the next round's first steps. ``shifted``: with
    local feedback the placed outer params are shifted by the residual there, into a new copy."""
    import jax

    params = abstract.params
    big = max(jax.tree.leaves(params), key=lambda a: a.size)
    r = {"diff": _memory(device_pg._diff.lower(big, big).compile()),
         "merge": _memory(device_pg._merge.lower(big, big, big).compile())}
    held = {"anchor": _bytes(params, n), "pseudo_gradient": _bytes(params, n, "float32"),
            "placed_outer": _bytes(params, n), "stashed_opt_state": _bytes(abstract.opt_state, n)}
    if sparse:
        import jax.numpy as jnp

        from intellect_jax.diloco.device_codec import _encode_bucket

        f32 = jax.ShapeDtypeStruct(big.shape, jnp.float32, sharding=big.sharding)
        one = jax.sharding.NamedSharding(big.sharding.mesh, jax.sharding.PartitionSpec())
        scalars = [jax.ShapeDtypeStruct((), t, sharding=one) for t in (jnp.float32, jnp.bool_)]
        r["encode"] = _memory(_encode_bucket.lower([f32], [f32], *scalars, mode=sparse[0], chunk=sparse[1],
                                                   placed=(big.sharding,)).compile())
        held |= {"feedback_residual": _bytes(params, n, "float32"), "next_residual": _bytes(params, n, "float32"),
                 "encode_temporaries": r["encode"]["temporaries_bytes"]}
        if shifted:
            held["shifted_start"] = _bytes(params, n)
    r["held_bytes"] = held
    r["resident_bytes"] = sum(held.values())
    return r


def _table(reports: list[dict]) -> None:
    """The targets side by side, one row per figure (GiB per device)."""
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    coll = lambda r: " ".join(f"{k} {v['count']}" + (f" ({v['overlapped']}/{v['async']} overlapped)"  # noqa: E731
                                                      if v["async"] else "") for k, v in r["collectives"].items())
    rows = [("device", lambda o: f"{o['devices']} x {o['device_kind']}"),
            ("train arguments", lambda o: g(o["train"]["arguments_bytes"])),
            ("train temporaries", lambda o: g(o["train"]["temporaries_bytes"])),
            ("train peak", lambda o: g(o["train"]["peak_bytes"])),
            ("eval peak", lambda o: g(o["eval"]["peak_bytes"])),
            ("node peak (+ DiLoCo held)", lambda o: g(o["node_peak_bytes"])),
            ("node peak evaluating", lambda o: g(o["eval_node_peak_bytes"])),
            ("margin under usable", lambda o: f"{g(o['margin_bytes'])} of {g(o['usable_bytes'])}"),
            ("attention", lambda o: f"{o['train']['attention']} (eval {o['eval']['attention']})"),
            ("train collectives", lambda o: coll(o["train"]) or "none")]
    width = max(len(n) for n, _ in rows)
    print(f"  {'':{width}} | " + " | ".join(r["target"] for r in reports))
    for name, f in rows:
        print(f"  {name:{width}} | " + " | ".join(f(r) for r in reports))


def _kernel(cc: tuple[int, int], block: int) -> dict[str, Any]:
    """The Triton int8 quantize kernel (the device pseudo-gradient's) compiled for the target by
    Triton's own compiler: jax-triton lowers only for a GPU it can see."""
    try:
        from intellect_jax.kernels import quant_triton
    except ImportError:
        return {"error": "triton is not installed (the [aot] extra brings it)"}
    try:
        return quant_triton.report_in_subprocess(cc[0] * 10 + cc[1], block)
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
        return {"error": str(e) or type(e).__name__}


def _print(out: dict) -> None:
    g = lambda b: b / GiB  # noqa: E731
    print(f"{out['config']}: {out['params'] / 1e9:.2f}B params on {out['devices']} x {out['device_kind']} "
          f"({out['target']}), mesh {out['mesh']}, batch {out['batch'][0]} x {out['batch'][1]} in micro-batches "
          f"of {out['micro_batch']}, attention {out['attention_impl']}")
    print(f"  analytic: params + AdamW state {g(out['analytic_params_and_opt_bytes']):.2f} GiB per device")
    for name in ("train", "eval"):
        r = out[name]
        coll = ", ".join(f"{k} {v['count']}" + (f" ({v['overlapped']} of {v['async']} async overlapped)" if v["async"]
                                                 else "") for k, v in r["collectives"].items()) or "none"
        print(f"  {name:5s} (compiled in {r['compile_s']:.1f} s): arguments {g(r['arguments_bytes']):.2f} GiB, "
              f"outputs {g(r['outputs_bytes']):.2f} GiB ({g(r['aliased_bytes']):.2f} reuse donated inputs), "
              f"temporaries {g(r['temporaries_bytes']):.2f} GiB; peak {g(r['peak_bytes']):.2f} GiB")
        print(f"        attention {r['attention']} {r['cudnn_calls']}; collectives: {coll}; "
              f"{r['flops_per_device'] / 1e12:.1f} TFLOP per device, {r['step_s_at_40pct_mfu']:.2f} s at 40% MFU")
    d = out["diloco"]
    print("  DiLoCo held beside the train step: " + ", ".join(f"{k} {g(v):.2f}" for k, v in d["held_bytes"].items())
          + f" GiB; node peak {g(out['node_peak_bytes']):.2f} GiB training, "
          f"{g(out['eval_node_peak_bytes']):.2f} GiB evaluating")
    if "kernel" in out:
        k = out["kernel"]
        print("  int8 quantize kernel: " + (k["error"] if "error" in k else
              f"compiled for {k['target']} ({k['cubin_bytes']} bytes of cubin, {k['num_warps']} warps), "
              f"{k['ieee_divisions']} IEEE divisions, {k['fused_multiply_adds']} fused multiply-adds"))
    verdict = "fits" if out["margin_bytes"] >= 0 else "does NOT fit"
    print(f"  {verdict}: margin {g(out['margin_bytes']):.2f} GiB under {g(out['usable_bytes']):.2f} GiB usable "
          f"({out['mem_fraction']:g} of {out['usable_of']}'s memory less {g(out['reserve_bytes']):.1f} GiB reserve)")


if __name__ == "__main__":
    sys.exit(run_main(main))
