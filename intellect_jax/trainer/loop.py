"""The single-node trainer: builds mesh, data, state and the jitted steps from a `TrainConfig`,
then runs inner steps with logging, evaluation and checkpoints. DiLoCo drives `train(until)`."""

from __future__ import annotations

import enum
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from intellect_jax.config import TrainConfig
from intellect_jax.data import tokenizer as toklib
from intellect_jax.data.pipeline import make_train_iter, make_val_batches
from intellect_jax.files import atomic_write
from intellect_jax.model import sharding as S
from intellect_jax.model.config import ConfigError
from intellect_jax.trainer import step as T
from intellect_jax.trainer.checkpoint import Checkpointer
from intellect_jax.trainer.metrics import MetricsLogger, peak_flops
from intellect_jax.trainer.optim import make_schedule, make_tx


class RunDirError(RuntimeError):
    pass


def prepare_run_dir(cfg: TrainConfig) -> Path:
    """Create runs/<name>/ and prove it is writable; refuse to train over an existing run's
    checkpoints unless resuming (nothing is overwritten by accident)."""
    d = cfg.run_dir
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{uuid.uuid4().hex}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"run.out_dir: cannot write run directory {d}: {e.strerror or e}") from None
    ckpt = d / "ckpt"
    has_ckpt = ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
    if has_ckpt and not cfg.ckpt.resume:
        raise RunDirError(
            f"{d} already holds checkpoints: pass --ckpt.resume to continue it, "
            "or choose another --run.name"
        )
    return d


def warn(line: str) -> None:
    """One warning line on stderr, flushed at once (it must reach the operator before a crash)."""
    print(line, file=sys.stderr, flush=True)


class Role(enum.Enum):
    """Who runs the job around a trainer's inner steps."""

    # the trainer's own job: it resumes from its checkpoints (`ckpt.resume`), saves every
    # `ckpt.every` steps and evaluates every `run.eval_every` steps and at the end
    SOLO = "solo"
    # DiLoCo's inner trainer: the outer loop drives `train(until, stop)` and resumes, saves and
    # evaluates at outer-step boundaries through its store; on a node of several processes its
    # checkpoints are host copies that process 0 alone writes (the others have no `ckpt`)
    INNER = "inner"


class Trainer:
    """One node's inner loop. `node_rank/node_count` pick this node's data shard (DiLoCo);
    `devices`, the devices it trains on (default: all the process sees)."""

    def __init__(self, cfg: TrainConfig, *, node_rank: int = 0, node_count: int = 1, role: Role = Role.SOLO,
                 devices: Sequence[Any] | None = None):
        self.cfg, self.role = cfg, role
        solo = role is Role.SOLO
        self.lead = jax.process_index() == 0
        self.mesh = S.make_mesh(cfg.mesh.fsdp, cfg.mesh.tp, devices)
        self.mcfg = cfg.model.build().on_platform(*S.platform(self.mesh))  # the attention kernel
        self.tok = toklib.load_tokenizer(cfg.data)
        toklib.check_vocab(self.tok, self.mcfg.vocab_size)

        B, L = cfg.data.batch_size, cfg.data.seq_len
        if L > self.mcfg.max_seq_len:
            raise ConfigError(f"data.seq_len ({L}) exceeds model max_seq_len ({self.mcfg.max_seq_len})")
        micro = cfg.run.micro_batch_size or B
        if B % micro:
            raise ConfigError(f"data.batch_size ({B}) must be a multiple of run.micro_batch_size ({micro})")
        nproc = jax.process_count()
        if B % nproc:
            raise ConfigError(f"data.batch_size ({B}) must divide over {nproc} host processes")
        self.total_steps = cfg.run.steps
        self.schedule = make_schedule(cfg.optim, self.total_steps)
        tx = make_tx(cfg.optim)
        self.graphdef, self.abstract_state, self.shardings = T.state_shardings(self.mcfg, tx, self.mesh)
        self.batch_sh = T.batch_sharding(self.mesh, (B, L + 1))
        self.data = make_train_iter(
            cfg.data, self.tok, node_rank=node_rank, node_count=node_count,
            process_index=jax.process_index(), process_count=nproc,
        )
        self._val = None
        self.node_rank, self.node_count = node_rank, node_count
        self.run_dir = prepare_run_dir(cfg)  # after every input check: bad input writes nothing

        self.ckpt: Checkpointer | None = None
        if self.lead or solo or nproc == 1:
            self.ckpt = Checkpointer(self.run_dir / "ckpt", every=cfg.ckpt.every, keep=cfg.ckpt.keep,
                                     async_save=cfg.ckpt.async_save, lead_only=not solo)
        if solo and cfg.ckpt.resume and self.ckpt is not None and self.ckpt.all_steps():  # the newest readable checkpoint; damaged ones are skipped
            _, out = self.ckpt.restore_newest({"state": self.abstract_state}, ("data",), warn=warn)
            self.state = out["state"]
            self.data.set_state(out["data"])
        else:
            params = None
            if cfg.model.init_from:  # continue training a published checkpoint
                from intellect_jax.model.hf import load_hf_state

                params = nnx.to_pure_dict(load_hf_state(cfg.model.init_from, self.mcfg, mesh=self.mesh))
            self.state = T.init_state(self.mcfg, tx, self.mesh, cfg.run.seed, self.shardings, params)
        self.step = int(jax.device_get(self.state.step))

        step_fn = T.make_train_step(self.graphdef, tx, self.schedule,
                                    z_weight=cfg.optim.z_loss_weight, micro_steps=B // micro)
        self._train, self._eval = T.compile_steps(
            step_fn, T.make_eval_step(self.graphdef, B // micro), self.shardings, self.batch_sh
        )
        self.compile_s: float | None = None  # the train step is compiled ahead of its first call
        self._unreported: dict = {}  # metrics waiting for the next logged row (compile_s)
        self.tokens_per_step = B * L
        n_dev = self.mesh.size
        peak = peak_flops(jax.devices()[0].device_kind, cfg.run.peak_tflops)
        self._peak_total = peak * n_dev if peak else None
        self.logger = None
        # Throughput clock: every step up to `_mark[1]` had finished at time `_mark[0]`; host
        # work that is not training (eval, checkpoints) since then is `_off` seconds.
        self._mark, self._off = (time.perf_counter(), self.step), 0.0
        # XLA:CPU runs several in-flight multi-process programs concurrently and their gloo
        # collectives can interleave differently per process (a deadlock seen under load):
        # a CPU node spanning processes waits for each step. GPUs keep the async dispatch.
        self._sync_each_step = nproc > 1 and jax.devices()[0].platform == "cpu"
        if self.lead:
            atomic_write(self.run_dir / "config.json", cfg.model_dump_json(indent=2))
            toklib.save_hf_tokenizer(self.tok, self.run_dir / "tokenizer", self.mcfg.max_seq_len)
            self.logger = MetricsLogger(self.run_dir, total_steps=self.total_steps,
                                        start_step=self.step, progress=cfg.run.progress)

    # ------------------------------------------------------------------------------------
    def _device_batch(self, local: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.batch_sh, np.asarray(local, np.int32))

    def evaluate(self, params: Any = None) -> float:
        """Mean validation loss per token over `run.eval_batches` held-out batches, of the
        current params or of the given (host) params."""
        if self._val is None:
            self._val = make_val_batches(
                self.cfg.data, self.tok, max_batches=self.cfg.run.eval_batches,
                node_rank=self.node_rank, node_count=self.node_count,
                process_index=jax.process_index(), process_count=jax.process_count(),
            )
        if params is None:
            params = self.state.params
        else:
            params = jax.device_put(jax.tree.map(lambda x, a: np.asarray(x, a.dtype), params,
                                                 self.abstract_state.params), self.shardings.params)
        tot, n = 0.0, 0
        for b in self._val:
            nll_B = jax.device_get(self._eval(params, self._device_batch(b["tokens"])))
            tot, n = tot + float(np.sum(nll_B)), n + nll_B.size * self.cfg.data.seq_len
        return tot / max(n, 1)

    def save(self, *, force: bool = False) -> None:
        if self.step in self.ckpt.all_steps():
            return
        meta = {"step": self.step, "config": self.cfg.model_dump(mode="json"),
                "node_rank": self.node_rank, "node_count": self.node_count}
        self.ckpt.save(self.step, {"state": self.state},
                       {"data": self.data.get_state(), "meta": meta, "tokenizer": self.tok.state()}, force=force)

    def set_params(self, params: Any) -> None:
        """Replace the parameters (e.g. DiLoCo's outer params), placed with their shardings."""
        self.state = self.state.replace(params=jax.device_put(params, self.shardings.params))

    def set_state(self, step: int, params: Any, opt_state: Any) -> None:
        """Adopt a whole train state received from a peer (live recovery)."""
        placed = jax.device_put((params, opt_state), (self.shardings.params, self.shardings.opt_state))
        self.state = T.TrainState(jax.device_put(np.int32(step), self.shardings.step), *placed)
        self.step = step

    def _compile(self) -> None:
        """Compile the train step from abstract inputs before the first step, so that no
        step's time includes compilation (reported once as `compile_s`)."""
        t0 = time.perf_counter()
        B, L = self.cfg.data.batch_size, self.cfg.data.seq_len
        batch = jax.ShapeDtypeStruct((B, L + 1), np.int32, sharding=self.batch_sh)
        self._train = self._train.lower(self.abstract_state, batch).compile()
        self.compile_s = time.perf_counter() - t0
        self._unreported["compile_s"] = self.compile_s

    def _off_clock(self, fn: Any) -> Any:
        """Run host work that is not training (an eval, a checkpoint) without counting its time
        in the step time: the steps already dispatched are waited for first (that is training)."""
        jax.block_until_ready(self.state)
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self._off += time.perf_counter() - t0

    def _measure(self, step: int, metrics: Any) -> dict:
        """Fetch `step`'s metrics (waiting for it) and close the throughput interval there:
        step time and tokens/s over the steps since the last fetch, less off-clock time."""
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        (t0, s0), off = self._mark, self._off
        n, secs = step - s0, now - t0 - off
        if n > 0 and secs > 0:
            m["step_time"] = secs / n
            m["tokens_per_s"] = self.tokens_per_step * n / secs
            if self._peak_total:
                m["mfu"] = self.mcfg.flops_per_token(self.cfg.data.seq_len) * m["tokens_per_s"] / self._peak_total
        m.update(self._unreported)
        self._mark, self._off, self._unreported = (now, step), 0.0, {}
        return m

    def _log(self, step: int, metrics: Any, more: Any = None, force: bool = False) -> dict:
        """Write `step`'s metrics if it is a logged step (or forced), with `more()` added after
        they are measured; returns them ({} if not logged)."""
        if not (force or step % self.cfg.run.log_every == 0 or step == 1):
            return {}
        m = self._measure(step, metrics)
        m.update(more() if more else {})
        if self.logger is not None:
            self.logger.log(step, m)
        return m

    def train(self, until: int | None = None, stop: Callable[[], bool] | None = None) -> dict:
        """Run inner steps up to step `until` (default: the job's end), or until `stop()` says so
        before a step (then at most one step is queued on the devices); returns the last metrics.

        Step N is dispatched before step N-1's metrics are fetched, so the host never idles
        the devices waiting on a log line. Logged step times cover only the steps themselves
        (data loading included), never compilation, evaluation or checkpointing."""
        until = min(until or self.cfg.run.stop_at or self.total_steps, self.total_steps)
        if self.compile_s is None:
            self._compile()
        every, ev, solo = self.cfg.ckpt.every, self.cfg.run.eval_every, self.role is Role.SOLO
        pending, last = None, {}
        jax.block_until_ready(self.state)
        self._mark, self._off = (time.perf_counter(), self.step), 0.0
        while self.step < until and not (stop is not None and stop()):
            batch = self._device_batch(next(self.data)["tokens"])
            self.state, metrics = self._train(self.state, batch)
            self.step += 1
            if self._sync_each_step:
                jax.block_until_ready(metrics)
            elif stop is not None and pending is not None:  # step N-1 done before N+1 is dispatched: at
                jax.block_until_ready(pending[1])  # most one step queued when stop() turns true
            if pending is not None:
                last = self._log(*pending) or last
            pending = (self.step, metrics)
            if solo and every and self.step % every == 0:
                self._off_clock(self.save)
            if solo and ((ev and self.step % ev == 0) or self.step == self.total_steps):
                last = self._log(*pending, more=lambda: {"val_loss": self._off_clock(self.evaluate)},
                                 force=True)
                pending = None
        if pending is not None:
            last = self._log(*pending, force=True) or last
        return last

    def close(self, *, save: bool = True) -> None:
        if save and self.ckpt is not None:
            self.save(force=True)
        if self.ckpt is not None:
            self.ckpt.close()
        if self.logger is not None:
            self.logger.close()
