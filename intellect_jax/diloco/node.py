"""One DiLoCo node: H inner steps, then an outer step averaged across the current epoch's nodes.

Round k+1 (k outer steps done): inner steps up to (k+1)*H -> pseudo-gradient = outer - inner
(host, fp32) -> barrier `sync(k)` at the coordinator gives the epoch's ring -> int8 ring
all-reduce mean -> Nesterov outer step -> outer params written back to the device params (the
inner AdamW state carries on). A failed all-reduce (a peer died) is retried over the next
epoch from the unchanged pseudo-gradient. Joiners named in the epoch get this node's state
streamed in the background after the outer step.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from intellect_jax.config import TrainConfig
from intellect_jax.diloco import outer as O
from intellect_jax.diloco import transfer
from intellect_jax.diloco.client import CoordinatorClient
from intellect_jax.diloco.protocol import Epoch, Evicted
from intellect_jax.net.auth import load_secret
from intellect_jax.net.comm import NetNode, RingConfig, parse_address
from intellect_jax.net.errors import NetError
from intellect_jax.net.transport import TransportConfig
from intellect_jax.trainer.loop import Trainer

CHAOS_ENV = "INTELLECT_JAX_CHAOS_KILL_AT"  # test/demo fault injection: SIGKILL inside that all-reduce


class DilocoError(RuntimeError):
    pass


def transport_config(cfg: TrainConfig) -> TransportConfig:
    d = cfg.diloco
    return TransportConfig(run_id=d.run_id, secret=load_secret(d.secret_file),
                           io_timeout=d.allreduce_deadline)


class DilocoNode:
    def __init__(self, cfg: TrainConfig, *, log=None):
        d = cfg.diloco
        for name, v in (("run.steps", cfg.run.steps), ("run.stop_at", cfg.run.stop_at or 0)):
            if v % d.inner_steps:
                raise DilocoError(f"{name} ({v}) must be a multiple of diloco.inner_steps ({d.inner_steps})")
        if not d.coordinator:
            raise DilocoError("diloco.coordinator (host:port) is required")
        self.cfg, self.H = cfg, d.inner_steps
        self.node_id = d.node_id or f"{socket.gethostname()}-{os.getpid()}"
        self._log = log or (lambda msg: print(f"[{self.node_id}] {msg}", flush=True))
        self.tcfg = transport_config(cfg)
        host, port = parse_address(d.listen)
        self.net = NetNode(self.tcfg, host, port)
        addr = d.advertise or f"{self.net.address[0]}:{self.net.address[1]}"
        self.trainer: Trainer | None = None  # built after registering: a refused node fails fast
        self.ring_cfg = RingConfig(mode=d.mode, block_size=d.block_size, streams=d.streams,
                                   deadline=d.allreduce_deadline)
        self.tx = O.nesterov_sgd(d.outer_lr, d.outer_momentum)
        self.client = CoordinatorClient(
            d.coordinator, self.tcfg, self.node_id, addr, devices=jax.device_count(),
            fingerprint=cfg.model.build().fingerprint(), heartbeat_interval=d.heartbeat_interval,
            reconnect_timeout=d.reconnect_timeout,
        )
        self.outer: O.OuterState | None = None
        self._hash: str | None = None  # of self.outer; set at every outer step
        self._serving: list[threading.Thread] = []

    # ---- start: founding member, resumed member, or joiner -----------------------------------
    def _outer_abstract(self) -> Any:
        p = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), self.trainer.abstract_state.params)
        return O.OuterState(p, self.tx.init(p), 0)

    def start(self) -> int:
        """Register and obtain the state; returns the number of completed outer steps."""
        if self.cfg.diloco.join_after:
            self._wait_for_run(self.cfg.diloco.join_after)
        if self.cfg.ckpt.resume:
            self._build_trainer()
        resumed = self.trainer is not None and self.trainer.step > 0
        if resumed:  # whole-run restart from our own checkpoint (saved at a boundary)
            self.outer = self._restore_outer(self.trainer.ckpt, self.trainer.step)
        elif self.cfg.diloco.init_from:  # a joiner starting from a shared checkpoint directory
            self._build_trainer()
            self._load_shared(self.cfg.diloco.init_from)
            resumed = True
        if resumed:
            reply = self.client.register(outer_step=self.outer.step)
        else:
            reply = self.client.register()
        self._log(f"registered with {self.cfg.diloco.coordinator} as "
                  f"{'member' if reply.member else 'joiner'} at outer step {reply.outer_step}")
        if self.trainer is None:
            self._build_trainer()
        if reply.member:
            if self.outer is None:
                self.outer = O.init_outer(self.trainer.state.params, self.tx)
            return self.outer.step
        return self._join()

    def _restore_outer(self, ckpt, step: int) -> O.OuterState:
        tree = ckpt.restore_extra("outer", self._outer_abstract()._asdict(), step)
        opt = tree["opt_state"]
        momentum = opt.momentum if hasattr(opt, "momentum") else opt["momentum"]
        return O.OuterState(tree["params"], O.MomentumState(momentum), int(tree["step"]))

    def _load_shared(self, path: str) -> None:
        """Train state + outer state from another node's latest checkpoint (e.g. on shared storage).
        If the run has moved past it, registration makes this node a joiner and a live peer's
        state replaces it."""
        from pathlib import Path

        from intellect_jax.trainer.checkpoint import Checkpointer

        d = Path(path)
        ck = Checkpointer(d / "ckpt" if (d / "ckpt").is_dir() else d, every=0, keep=10**6, async_save=False)
        try:
            step = ck.latest_step()
            if step is None:
                raise DilocoError(f"diloco.init_from {path}: no complete checkpoint there")
            state, _, _ = ck.restore(self.trainer.abstract_state, step)
            self.outer = self._restore_outer(ck, step)
        finally:
            ck.close()
        self.trainer.state, self.trainer.step = state, step
        self._log(f"loaded the checkpoint of step {step} (outer step {self.outer.step}) from {path}")

    def _build_trainer(self) -> None:
        d = self.cfg.diloco
        self.trainer = Trainer(self.cfg, node_rank=d.data_rank, node_count=d.data_ranks, periodic_save=False,
                               evaluate=False)  # checkpoints and evals happen at outer boundaries

    def _wait_for_run(self, k: int) -> None:
        """Ready (compiled, data loaded) but register only once the run has done k outer steps."""
        self._log(f"waiting for the run to complete {k} outer steps before registering")
        deadline = time.monotonic() + self.cfg.diloco.admission_timeout
        while time.monotonic() < deadline:
            try:
                if self.client.status()["outer_step"] >= k:
                    return
            except Exception:  # coordinator not up yet, or restarting
                pass
            time.sleep(0.5)
        raise DilocoError(f"the run did not reach outer step {k} within {self.cfg.diloco.admission_timeout:.0f}s")

    def _join(self) -> int:
        requeue = False
        while True:
            adm = self.client.wait_admission(requeue=requeue, timeout=self.cfg.diloco.admission_timeout)
            self._log(f"admitted at boundary {adm.admitted_at}; receiving state of outer step "
                      f"{adm.outer_step} from {adm.donor_id}")
            t0 = time.time()
            try:
                meta, tree = transfer.recv_state(self.net, self.node_id, adm.outer_step, self._transfer_abstract(),
                                                 timeout=self.cfg.diloco.transfer_timeout)
            except (NetError, OSError, ValueError) as e:
                self._log(f"state transfer from {adm.donor_id} failed ({e}); re-queued")
                requeue = True
                continue
            outer = O.OuterState(tree["outer"]["params"], O.MomentumState(tree["outer"]["momentum"]),
                                 int(meta["outer_step"]))
            got = O.state_hash(outer)
            if got != meta["hash"]:
                raise DilocoError(f"state from {adm.donor_id} fails its hash check ({got} != {meta['hash']})")
            self.outer, self._hash = outer, got
            self.trainer.set_state(int(meta["inner_step"]), outer.params, tree["opt_state"])
            self._log(f"restored state of outer step {outer.step} (hash {got[:12]}) in {time.time() - t0:.1f}s "
                      f"(wall {t0:.3f} -> {time.time():.3f})")
            if self.client.state_received(adm.outer_step):
                return outer.step
            requeue = True

    def _transfer_abstract(self) -> dict:
        ab = self._outer_abstract()
        opt = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), self.trainer.abstract_state.opt_state)
        return {"outer": {"params": ab.params, "momentum": ab.opt_state.momentum}, "opt_state": opt}

    # ---- the outer loop ------------------------------------------------------------------------
    def run(self) -> None:
        k = self.start()
        n_outer = (self.cfg.run.stop_at or self.cfg.run.steps) // self.H  # stop_at: end this job early
        while k < n_outer:
            t0 = time.perf_counter()
            last = self.trainer.train(until=(k + 1) * self.H)
            compute_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            pg = O.pseudo_gradient(self.outer, self.trainer.state.params)
            try:
                avg, ep, stats, tries = self._all_reduce(k, pg)
            except Evicted as e:  # we stalled or fell behind: rejoin and take a live peer's state
                self._log(f"evicted ({e}); registering again as a joiner")
                self.client.register()
                k = self._join()
                continue
            self.outer = O.outer_step(self.outer, avg, self.tx)
            self.trainer.set_params(self.outer.params)
            h = self._hash = O.state_hash(self.outer)  # hashed once per outer step
            sync_s = time.perf_counter() - t1
            k = self.outer.step
            self._serve(ep)
            every = self.cfg.ckpt.every
            if (every and self.trainer.step % every == 0) or k == n_outer:
                self.trainer.save(extra={"outer": self.outer._asdict()})
            ev = self.cfg.run.eval_every
            if (ev and self.trainer.step % ev == 0) or k == n_outer:  # the outer params' val loss
                m_val = {"val_loss": self.trainer.evaluate()}
            else:
                m_val = {}
            m = {**m_val, "outer_step": k, "epoch": ep.epoch_id, "nodes": ep.world_size, "sync_s": sync_s,
                 "compute_s": compute_s, "utilization": compute_s / (compute_s + sync_s),
                 "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                 "allreduce_tries": tries, "outer_hash": h, "wall_time": time.time()}
            if self.trainer.logger is not None:
                self.trainer.logger.log(self.trainer.step, m)
            self._log(f"outer step {k}: epoch {ep.epoch_id} ({ep.world_size} nodes), loss "
                      f"{last.get('loss', float('nan')):.4f}, sync {sync_s:.2f}s, "
                      f"sent {stats.bytes_sent / 2**20:.2f} MiB, hash {h[:12]}")
        self._final_sync(k)

    def _all_reduce(self, k: int, pg: Any):
        prev_hash = self._hash or O.state_hash(self.outer)
        retry_of = None
        for attempt in range(self.cfg.diloco.max_retries + 1):
            ep = self.client.sync(k, state_hash=prev_hash, retry_of=retry_of)
            if ep.hash_mismatch:
                self._log(f"WARNING outer-state hashes disagree at step {k}: {list(ep.hash_mismatch)}")
            comm = self.net.ring(ep.addresses, ep.rank, epoch=ep.epoch_id, config=self.ring_cfg)
            try:
                self._chaos(k, comm)
                avg = comm.all_reduce_mean(pg)
                stats = comm.last_stats
                return avg, ep, stats, attempt + 1
            except NetError as e:
                self._log(f"all-reduce of outer step {k + 1} failed in epoch {ep.epoch_id}: {e}; retrying")
                retry_of = ep.epoch_id
            finally:
                comm.close()
        raise DilocoError(f"outer step {k + 1}: all-reduce failed {self.cfg.diloco.max_retries + 1} times")

    def _serve(self, ep: Epoch) -> None:
        if not ep.serve:
            return
        meta = {"outer_step": self.outer.step, "inner_step": self.trainer.step, "hash": self._hash}
        tree = {"outer": {"params": self.outer.params, "momentum": self.outer.opt_state.momentum},
                "opt_state": O.to_host(self.trainer.state.opt_state)}  # snapshot now, send later
        for joiner_id, joiner_addr in ep.serve:
            self._serving.append(transfer.serve_in_background(
                self.net, joiner_addr, joiner_id, meta, tree, timeout=self.cfg.diloco.transfer_timeout,
                log=self._log))

    def _final_sync(self, k: int) -> None:
        """Report the final outer-state hash so the coordinator compares it too, then leave."""
        try:
            self.client.sync(k, state_hash=self._hash or O.state_hash(self.outer))
        except Exception as e:  # the others may already be gone; the run itself is complete
            self._log(f"final sync skipped: {e}")

    def _chaos(self, k: int, comm: Any) -> None:
        """Fault injection for tests and demos: SIGKILL this process once bytes of the all-reduce
        of outer step k+1 are on the wire (so the peers are mid-reduction)."""
        if os.environ.get(CHAOS_ENV) != str(k + 1):
            return

        def watch() -> None:
            while True:
                links = getattr(comm, "_links", None)
                if links is not None and links.traffic()[0] > 100_000:  # data frames, not just META
                    self._log(f"chaos: SIGKILL inside the all-reduce of outer step {k + 1}")
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.0005)

        threading.Thread(target=watch, daemon=True).start()

    def close(self) -> None:
        for th in self._serving:
            th.join(timeout=self.cfg.diloco.transfer_timeout)
        try:
            self.client.leave()
        except Exception:
            pass
        self.client.close()
        self.net.close()
        if self.trainer is not None:
            self.trainer.close(save=False)
