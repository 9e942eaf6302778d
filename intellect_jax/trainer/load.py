"""Load a finished or running run's checkpoint for tools (eval, export): config, tokenizer, params."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from intellect_jax.config import TrainConfig
from intellect_jax.data.tokenizer import Tok, tok_from_state
from intellect_jax.model import sharding as S
from intellect_jax.model.config import ConfigError, ModelConfig
from intellect_jax.trainer import step as T
from intellect_jax.trainer.checkpoint import CheckpointError, Checkpointer
from intellect_jax.trainer.optim import make_tx


@dataclass
class LoadedRun:
    cfg: TrainConfig
    model_cfg: ModelConfig
    tok: Tok
    step: int
    graphdef: Any
    params: T.Params
    mesh: Any


def load_run(path: str | Path, step: int | None = None) -> LoadedRun:
    """`path` is runs/<name> (or its ckpt/ directory); the latest step unless `step` is given."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"--checkpoint {p}: no such run directory")
    ckdir = p / "ckpt" if (p / "ckpt").is_dir() else p
    ck = Checkpointer(ckdir, every=0, keep=10**6, async_save=False)
    try:
        if ck.latest_step() is None:
            raise CheckpointError(f"--checkpoint {p}: no complete checkpoint in {ckdir}")
        if step is not None and step not in ck.all_steps():
            raise CheckpointError(f"--step {step}: not in {ckdir} (have {ck.all_steps()})")
        meta = ck.restore_json("meta", step)
        cfg = TrainConfig.model_validate(meta["config"])
        tok = tok_from_state(ck.restore_json("tokenizer", step))
        mesh = S.make_mesh(fsdp=-1, tp=1)
        mcfg = cfg.model.build()
        try:
            mcfg = mcfg.on_platform(*S.platform(mesh))
        except ConfigError:  # its kernel (cuDNN's, a GPU run) cannot run here: this machine's choice
            mcfg = mcfg.model_copy(update={"attention_impl": "auto"}).on_platform(*S.platform(mesh))
        tx = make_tx(cfg.optim)
        graphdef, abstract, _ = T.state_shardings(mcfg, tx, mesh)
        step = ck.latest_step() if step is None else step
        if "diloco" in ck.item_names(step):  # a DiLoCo node's checkpoint: its outer params
            fp32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, "float32", sharding=x.sharding),
                                abstract.params)
            arrays = {"diloco": {"outer_params": fp32, "outer_opt_state": {"momentum": fp32},
                                 "inner_opt_state": abstract.opt_state}}
            out = ck.restore(step, arrays, ("meta",))
            params = jax.tree.map(lambda x, a: x.astype(a.dtype), out["diloco"]["outer_params"], abstract.params)
        else:
            out = ck.restore(step, {"state": abstract}, ("meta",))
            params = out["state"].params
    finally:
        ck.close()
    return LoadedRun(cfg, mcfg, tok, int(out["meta"]["step"]), graphdef, params, mesh)
