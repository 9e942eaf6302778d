"""A DiLoCo node process: builds the real collaborators from the run config and runs the one
outer loop (:class:`~.loop.NodeLoop`) with them.

Collaborators: the trainer (`TrainerInner`), a coordinator client over authenticated TCP, a
ring factory over this node's `NetNode` listener, the state transport over the same listener,
and the checkpoint store over the trainer's one `Checkpointer`.
"""

from __future__ import annotations

import dataclasses

import jax

from intellect_jax.config import TrainConfig
from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.diloco.device_pg import PgPath, kernel_available, pg_path
from intellect_jax.diloco.inner import TrainerInner
from intellect_jax.diloco.loop import NodeLoop
from intellect_jax.diloco.parts import DilocoError, LoopConfig, NodeParts, Outcome
from intellect_jax.diloco.multihost import Follower, Followers, LeadInner, share_port
from intellect_jax.coordinator.protocol import DataPlan, Epoch
from intellect_jax.diloco.store import CheckpointStore
from intellect_jax.diloco.transfer import NetTransport
from intellect_jax.net.identity import Credentials, keys_dir, sole_identity
from intellect_jax.net.comm import NetNode, RingConfig, parse_address
from intellect_jax.net.transport import TransportConfig
from intellect_jax.trainer.loop import Role, Trainer

__all__ = ["DilocoError", "DilocoNode", "loop_config", "run_follower"]


def node_identity(cfg: TrainConfig) -> str:
    """This node's id: ``diloco.node_id``, else the one node identity in its keys directory."""
    return cfg.diloco.node_id or sole_identity(keys_dir(cfg.diloco.keys))


def transport_config(cfg: TrainConfig) -> TransportConfig:
    """The node's transport: its own credentials (checked: one line naming the file if not good)."""
    d = cfg.diloco
    return TransportConfig(run_id=d.run_id, identity=Credentials.load(keys_dir(d.keys), node_identity(cfg)),
                           io_timeout=d.allreduce_deadline)


def loop_config(cfg: TrainConfig, path: PgPath) -> LoopConfig:
    d, H = cfg.diloco, cfg.diloco.inner_steps
    for name, v in (("run.steps", cfg.run.steps), ("run.stop_at", cfg.run.stop_at or 0)):
        if v % H:
            raise DilocoError(f"{name} ({v}) must be a multiple of diloco.inner_steps ({H})")
    return LoopConfig(inner_steps=H, outer_steps=cfg.run.steps // H,
                      stop_at=cfg.run.stop_at // H if cfg.run.stop_at else None, outer_lr=d.outer_lr,
                      outer_momentum=d.outer_momentum, max_retries=d.max_retries,
                      transfer_timeout=d.transfer_timeout, admission_timeout=d.admission_timeout,
                      watch_interval=d.heartbeat_interval, ckpt_every=cfg.ckpt.every, eval_every=cfg.run.eval_every,
                      overlap=path.overlap, overlap_delay=d.overlap_delay,
                      feedback=d.feedback if d.gathered else 0.0, feedback_local=d.feedback_local)


def node_pg_path(cfg: TrainConfig) -> PgPath:
    """This process's node's pseudo-gradient path (:func:`~.device_pg.pg_path`)."""
    return pg_path(cfg.diloco, jax.process_count(), kernel_available(),
                   gpu=any(d.platform == "gpu" for d in jax.devices()))


def run_follower(cfg: TrainConfig) -> int:
    """A non-lead process of a multi-process DiLoCo node: returns the commands it served."""
    d = cfg.diloco
    port = share_port(0)
    trainer = Trainer(cfg, node_rank=d.data_rank, node_count=d.data_ranks, role=Role.INNER)
    try:
        lead = (parse_address(cfg.dist.coordinator_address or "")[0], port)
        dpg = node_pg_path(cfg).build(d.block_size)
        assert dpg is not None  # a node of several processes takes the device path
        f = Follower.connect(trainer, dpg, transport_config(cfg), lead, timeout=d.transfer_timeout)
        try:
            return f.run()
        finally:
            f.close()
    finally:
        trainer.close(save=False)


class DilocoNode:
    def __init__(self, cfg: TrainConfig, *, log=None):
        d = cfg.diloco
        self.path = node_pg_path(cfg)
        self.loop_cfg = loop_config(cfg, self.path)
        if not d.coordinator:
            raise DilocoError("diloco.coordinator (host:port) is required")
        self.cfg = cfg
        self.node_id = node_identity(cfg)
        self._log = log or (lambda msg: print(f"[{self.node_id}] {msg}", flush=True))
        self.tcfg = transport_config(cfg)
        host, port = parse_address(d.listen)
        self.net = NetNode(self.tcfg, host, port)
        addr = d.advertise or f"{self.net.address[0]}:{self.net.address[1]}"
        self.ring_cfg = RingConfig(mode=d.wire_mode, block_size=d.wire_block, streams=d.streams,
                                   deadline=d.allreduce_deadline, exchange=d.exchange, robust=d.robust)
        self.client = CoordinatorClient(
            d.coordinator, self.tcfg, self.node_id, addr, devices=jax.device_count(),
            fingerprint=cfg.model.build().fingerprint(), heartbeat_interval=d.heartbeat_interval,
            reconnect_timeout=d.reconnect_timeout, outer_steps=self.loop_cfg.outer_steps,
            register_timeout=d.register_timeout, say=self._log,
            data=DataPlan(True) if d.leases else DataPlan(False, d.data_rank, d.data_ranks),
        )
        self.trainer: Trainer | None = None
        self.loop: NodeLoop | None = None
        self.followers: Followers | None = None  # the node's other processes (lead of a multi-process node)

    def _ring(self, ep: Epoch):
        return self.net.ring(ep.members, ep.rank, epoch=ep.epoch_id, step=ep.outer_step, config=self.ring_cfg)

    def run(self) -> Outcome:
        d = self.cfg.diloco
        # checkpoints and evals happen at outer boundaries; the store restores, not the trainer
        multi = jax.process_count() > 1
        if multi:  # the node's other processes learn where to reach this one (before any other program)
            share_port(self.net.address[1])
        self.trainer = Trainer(self.cfg, node_rank=d.data_rank, node_count=d.data_ranks, role=Role.INNER)
        store = CheckpointStore(self.trainer, resume=self.cfg.ckpt.resume, init_from=d.init_from,
                                meta={"node_id": self.node_id, "node_rank": d.data_rank, "node_count": d.data_ranks},
                                warn=self._log)
        transport = NetTransport(self.net, self.node_id, log=self._log, watch_interval=d.heartbeat_interval,
                                 serve_timeout=d.transfer_timeout)
        dpg = self.path.build(d.block_size)
        if multi:
            self._log(f"speaking for {jax.process_count()} processes; waiting for the others to connect")
            self.followers = Followers(self.net, jax.process_count(), timeout=d.transfer_timeout)
            assert dpg is not None  # a node of several processes takes the device path
            inner: TrainerInner = LeadInner(self.trainer, dpg, self.followers)
        else:
            rc = self.ring_cfg
            inner = TrainerInner(self.trainer, dpg, self.path.encoder(rc.mode, rc.block_size, rc.bucket_numel,
                                                                      rc.piece_numel))
        self._log(self.path.describe(d.overlap_delay))
        if d.exchange == "butterfly":
            self._log(f"butterfly exchange: each segment's owner checks every member's signed piece and "
                      f"aggregates them with {d.robust}")
        parts = NodeParts(self.node_id, inner, self.client, self._ring, transport, store, log=self._log)
        loop_cfg = self.loop_cfg
        if d.leases:  # (every process of the node reads its rows of the leased batches: LeadInner.lease)
            u, data = d.lease_unit, self.cfg.data
            loop_cfg = dataclasses.replace(loop_cfg, data_units=(u, u * data.batch_size * data.seq_len,
                                                                 self.trainer.data.stream))
            self._log(f"data leased from the coordinator in units of {u} inner steps")
        self.loop = NodeLoop(loop_cfg, parts)
        return self.loop.run()

    def close(self) -> None:
        if self.followers is not None:
            self.followers.close()
        self.client.close()
        self.net.close()
        if self.trainer is not None:
            self.trainer.close(save=False)
