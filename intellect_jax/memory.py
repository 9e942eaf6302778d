"""`python -m intellect_jax.memory --config configs/10b.toml --devices 8 [--section.key value ...]`

Does a config's training fit? Compiles, ahead of time and without allocating anything, the real
train step and eval step of the config (its model, batch, micro-batches, mesh, remat, dtypes)
from abstract inputs on ``--devices`` devices (fake CPU devices when there is no accelerator),
and prints, per device, XLA's memory analysis of each compiled step (arguments, outputs,
temporaries, and what the donated state lets it reuse) next to the analytic parameter +
optimizer-state figure of ``sharding.memory_report``, then one JSON line. Data, tokenizer and
checkpoints are never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from intellect_jax.cli import run_main

GiB = 2**30


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m intellect_jax.memory", description=__doc__.split("\n\n")[1])
    ap.add_argument("--config", required=True)
    ap.add_argument("--devices", type=int, default=None,
                    help="devices of one node (default: all visible; on CPU, that many fake devices)")
    ap.add_argument("--budget-gb", type=float, default=80.0, help="memory of one device in GiB, to report headroom")
    args, rest = ap.parse_known_args(argv)
    if args.devices is not None and not 1 <= args.devices <= 1024:
        ap.error(f"--devices {args.devices}: one node has 1 to 1024 devices")
    return args, rest


def main(argv: list[str] | None = None) -> dict:
    args, rest = _parse(argv)
    if args.devices and "jax" not in sys.modules and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")  # fake CPU devices must exist before jax starts
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    from intellect_jax.config import parse_args

    cfg = parse_args(["--config", args.config, *rest])
    import jax
    import numpy as np
    from flax import nnx

    from intellect_jax.model import sharding as S
    from intellect_jax.model.config import ConfigError
    from intellect_jax.model.llama import Llama
    from intellect_jax.trainer import step as T
    from intellect_jax.trainer.optim import make_schedule, make_tx

    devices = jax.devices()
    n = args.devices or len(devices)
    if n > len(devices):
        raise ConfigError(f"--devices {n}: only {len(devices)} {devices[0].platform} devices here")
    mcfg = cfg.model.build()
    mesh = S.make_mesh(cfg.mesh.fsdp, cfg.mesh.tp, devices[:n])
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
    out: dict = {"config": args.config, "devices": n, "platform": devices[0].platform, "mesh": dict(mesh.shape),
                 "batch": [B, L], "micro_batch": micro, "params": report["num_params"],
                 "analytic_params_and_opt_bytes": int(report["total_bytes_per_device"]), "budget_gb": args.budget_gb}
    for name, fn, ins in (("train", train, (abstract, batch)), ("eval", evaluate, (abstract.params, batch))):
        t0 = time.perf_counter()
        ma = fn.lower(*ins).compile().memory_analysis()
        r = {"compile_s": round(time.perf_counter() - t0, 1), "arguments_bytes": ma.argument_size_in_bytes,
             "outputs_bytes": ma.output_size_in_bytes, "aliased_bytes": ma.alias_size_in_bytes,
             "temporaries_bytes": ma.temp_size_in_bytes}
        # donated arguments are reused for the outputs
        r["peak_bytes"] = r["arguments_bytes"] + r["outputs_bytes"] - r["aliased_bytes"] + r["temporaries_bytes"]
        out[name] = r
    print(f"{args.config}: {report['num_params'] / 1e9:.2f}B params on {n} {devices[0].platform} devices, mesh "
          f"{dict(mesh.shape)}, batch {B} x {L} in micro-batches of {micro}")
    print(f"  analytic: params + AdamW state {out['analytic_params_and_opt_bytes'] / GiB:.2f} GiB per device")
    for name in ("train", "eval"):
        g = {k[:-6]: v / GiB for k, v in out[name].items() if k.endswith("_bytes")}
        print(f"  {name:5s} step (compiled in {out[name]['compile_s']:.1f} s): arguments {g['arguments']:.2f} GiB, "
              f"outputs {g['outputs']:.2f} GiB (of which {g['aliased']:.2f} GiB reuse donated inputs), temporaries "
              f"{g['temporaries']:.2f} GiB; peak {g['peak']:.2f} GiB per device, {args.budget_gb - g['peak']:.2f} GiB "
              f"under the {args.budget_gb:g} GiB budget")
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(run_main(main))
