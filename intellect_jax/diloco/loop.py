"""The DiLoCo outer loop of one node: the one implementation behind the real node
(:mod:`.node`), the in-process sweep benchmark and the fault simulation.

`NodeLoop` is handed its collaborators (:class:`NodeParts`) instead of building them: the inner
trainer, the coordinator client, a ring factory, the state transport and the checkpoint
store, plus a clock. A node obtains its state one of three ways: founding a fresh run, resuming
from its own (or a shared) checkpoint, or joining and taking a live peer's state. Then, per
round: H inner steps, pseudo-gradient, barrier, ring all-reduce (retried over new epochs),
outer step, state streamed to the joiners this node donates to, checkpoint, evaluation.

Recovery: any :class:`Evicted` (stalled, behind, diverged, a lost session) sends the node back
to registration with the state it holds; a joiner whose transfer fails or whose donor vanishes
asks to be admitted again. Metrics of outer step k are written once the coordinator has
recorded step k's hash (the next barrier returned), so no node ever logs a state that the run's
history did not keep.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np

from intellect_jax.coordinator.client import CoordinatorClient
from intellect_jax.coordinator.clock import REAL, Clock, abort_when
from intellect_jax.diloco.guard import GuardConfig, OwnGuard, check_average, inspect, remember, tree_norm
from intellect_jax.coordinator.protocol import Admission, Epoch, Evicted, Resume, RunCompleted
from intellect_jax.diloco.state import DilocoState, nesterov_sgd, outer_step, state_hash
from intellect_jax.net.comm import Communicator
from intellect_jax.net.errors import NetError, PeerTimeout


class DilocoError(RuntimeError):
    pass


class TransferFailed(NetError):
    """A joiner did not get a usable state from its donor (gone, stalled, revoked, bad hash)."""


class Inner(Protocol):
    """The node's inner trainer, as the outer loop sees it."""

    step: int

    def train(self, until: int, stop: Callable[[], bool] | None = None) -> dict[str, Any]: ...  # stop: checked per step

    def pseudo_gradient(self, outer_params: Any) -> Any: ...  # outer - inner, a host fp32 tree

    def init_state(self, tx: Any) -> DilocoState: ...  # outer step 0 of a fresh run

    def set_params(self, params: Any) -> None: ...

    def snapshot(self) -> Any: ...  # a host copy of the inner optimizer state

    def live_opt_state(self) -> Any: ...  # the inner optimizer state as it is (a checkpoint takes it)

    def data_state(self) -> dict | None: ...

    def adopt(self, s: DilocoState) -> None: ...  # params := outer params; opt state, step, data if given

    def template(self) -> DilocoState: ...  # shapes and dtypes of a transferred state

    def evaluate(self, params: Any = None) -> float: ...  # the current params, or the given host params

    def record(self, step: int, metrics: dict[str, Any]) -> None: ...

    # overlapped rounds (LoopConfig.overlap): the params a round started from are its anchor
    def capture(self) -> Any: ...  # the round's pseudo-gradient (anchor - params), cheaply; anchor := params

    def pull(self, captured: Any, like: Any) -> Any: ...  # its host fp32 tree (may run while training)

    def place(self, outer_params: Any) -> Any: ...  # a device copy of host params (may run while training)

    def stash(self) -> Any: ...  # a copy of the inner optimizer state the next steps leave alone (no wait)

    def merge(self, placed: Any) -> None: ...  # params := placed + (params - anchor); anchor := placed


class Transport(Protocol):
    def serve(self, joiner_id: str, joiner_addr: str, snapshot: DilocoState, meta: dict[str, Any],
              cancelled: Callable[[], bool]) -> Any: ...  # an event, set once sent, failed or cancelled

    def receive(self, adm: Admission, template: DilocoState, cancelled: Callable[[], bool],
                timeout: float) -> tuple[dict[str, Any], DilocoState]: ...


class Store(Protocol):
    """The node's one checkpointing path."""

    def latest(self) -> DilocoState | None: ...  # newest readable checkpoint to start from (or None)

    def save(self, s: DilocoState, *, wait: bool = False) -> None: ...

    def load(self, inner_step: int) -> DilocoState: ...


class Outcome(str, enum.Enum):
    FINISHED = "finished"  # this node did the run's last outer step
    STOPPED = "stopped"  # the job ended at run.stop_at; resume later
    COMPLETED = "completed"  # the run was already complete (another node finished it)


@dataclass(frozen=True)
class LoopConfig:
    inner_steps: int
    outer_steps: int  # the run's length
    stop_at: int | None = None  # this job ends after this many outer steps
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    max_retries: int = 5
    transfer_timeout: float = 600.0
    admission_timeout: float = 3600.0
    watch_interval: float = 1.0  # how often an all-reduce or a transfer checks the coordinator's view
    ckpt_every: int = 0  # inner steps (checkpoints at outer boundaries that are multiples, and the last)
    eval_every: int = 0  # inner steps
    guard: GuardConfig = GuardConfig()
    overlap: bool = False  # train round k+1 while round k's all-reduce and outer step run (see .overlap)
    overlap_delay: int | None = None  # tau: inner steps from sending a pseudo-gradient to merging its average (None: when ready)


@dataclass
class NodeParts:
    node_id: str
    inner: Inner
    client: CoordinatorClient
    ring: Callable[[Epoch], Communicator]
    transport: Transport
    store: Store
    clock: Clock = REAL
    log: Callable[[str], None] = print
    serving: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class OuterResult:
    """One outer step as this node saw it."""

    state: DilocoState
    ep: Epoch
    stats: Any  # the all-reduce's CommStats
    tries: int
    report: dict[str, Any]  # for the coordinator, sent with the next barrier
    pg_norm: float
    avg_norm: float
    sat_out: str | None
    skipped: str | None
    avg: Any = None  # the average applied (None: skipped)

    def row(self, h: str) -> dict[str, Any]:
        ep = self.ep
        return {"outer_step": self.state.outer_step, "outer_hash": h, "epoch": ep.epoch_id, "nodes": ep.world_size,
                "bytes_sent": self.stats.bytes_sent, "bytes_received": self.stats.bytes_received,
                "allreduce_tries": self.tries, "pg_norm": self.pg_norm, "avg_norm": self.avg_norm,
                "sat_out": self.sat_out, "skipped": self.skipped, "contributors": ep.world_size - len(ep.sitting_out)}


def claim_of(s: DilocoState | None) -> Resume | None:
    return Resume(s.outer_step, state_hash=state_hash(s)) if s is not None else None


class NodeLoop:
    def __init__(self, cfg: LoopConfig, parts: NodeParts) -> None:
        self.cfg, self.p = cfg, parts
        self.tx = nesterov_sgd(cfg.outer_lr, cfg.outer_momentum)
        self.guard = cfg.guard
        self.own = OwnGuard(cfg.guard)  # this node's own pseudo-gradient norms
        self.state: DilocoState | None = None  # the outer state this node holds
        self._pending: dict[str, Any] | None = None  # metrics of the newest outer step, until recorded
        self.t_first: float | None = None  # when this node's first round began (rows carry elapsed_s)

    @property
    def stop_at(self) -> int:
        return min(self.cfg.stop_at or self.cfg.outer_steps, self.cfg.outer_steps)

    def run(self) -> Outcome:
        """Register, obtain the state, do outer steps until the job's end, leave."""
        p = self.p
        held = p.store.latest()
        if held is not None:
            p.log(f"resuming from the checkpoint of outer step {held.outer_step} (hash {state_hash(held)[:12]})")
        else:  # the seeded initial state: what founders start from (its hash is checked at step 0)
            held = p.inner.init_state(self.tx)
        try:
            while True:
                reply = p.client.register(claim_of(held))
                p.log(f"registered as {'member' if reply.member else 'joiner'} at outer step {reply.outer_step}"
                      + (f" ({reply.note})" if reply.note else ""))
                try:
                    if reply.member:
                        self._adopt(held)
                    else:
                        self._join(held)
                    return self._rounds()
                except Evicted as e:
                    p.log(f"evicted ({e}); registering again")
                    held = self.state or held
        except RunCompleted as e:
            p.log(f"nothing to do: {e}")
            return Outcome.COMPLETED
        finally:
            self._wait_serving()

    # ---- joining -------------------------------------------------------------------------------
    def _join(self, held: DilocoState) -> DilocoState:
        p, cfg = self.p, self.cfg
        requeue = False
        deadline = p.clock.now() + cfg.admission_timeout
        while True:
            left = deadline - p.clock.now()
            if left <= 0:
                raise DilocoError(f"not admitted within {cfg.admission_timeout:.0f}s")
            try:
                adm = p.client.wait_admission(requeue=requeue, timeout=left)
            except Evicted as e:  # e.g. stalled past the heartbeat timeout while waiting
                p.log(f"evicted while waiting for admission ({e}); registering again")
                reply = p.client.register(claim_of(held))
                if reply.member:  # the coordinator rebuilds the run from states like ours
                    return self._adopt(held)
                requeue = False
                continue
            except PeerTimeout:
                continue
            if adm.donor_id == p.node_id:  # promoted: resume the run with the state we brought
                if held.outer_step != adm.outer_step:
                    raise Evicted(f"promoted at outer step {adm.outer_step} without that state")
                return self._adopt(held)
            p.log(f"admitted at boundary {adm.admitted_at}; receiving the state of outer step "
                  f"{adm.outer_step} from {adm.donor_id}")
            t0 = p.clock.now()
            try:
                s = self._receive(adm)
            except TransferFailed as e:
                p.log(f"state transfer from {adm.donor_id} failed ({e}); asking for another donor")
                requeue = True
                continue
            if p.client.state_received(adm.outer_step):
                p.log(f"restored the state of outer step {s.outer_step} (hash {state_hash(s)[:12]}) in "
                      f"{p.clock.now() - t0:.1f}s")
                return s
            requeue = True

    def _receive(self, adm: Admission) -> DilocoState:
        p = self.p
        try:
            meta, got = p.transport.receive(adm, p.inner.template(), lambda: p.client.admission_revoked(adm),
                                            self.cfg.transfer_timeout)
        except NetError as e:
            raise TransferFailed(str(e)) from e
        got = got._replace(outer_step=int(meta["outer_step"]), inner_step=int(meta["inner_step"]), data=None,
                           norms=tuple(float(x) for x in meta.get("norms", ())))
        h = state_hash(got)
        if h != meta["hash"] or got.outer_step != adm.outer_step:
            raise TransferFailed(f"received state of outer step {got.outer_step} hashes to {h[:12]}, the donor "
                                 f"sent {str(meta['hash'])[:12]} for {adm.outer_step}")
        # one path to a state: through the checkpoint store, with this node's own data position
        # (the donor's is another shard's), so a crash before the next checkpoint resumes from it
        p.store.save(got._replace(data=p.inner.data_state()), wait=True)
        s = p.store.load(got.inner_step)
        if state_hash(s) != h:
            raise TransferFailed(f"the checkpoint of the received state hashes to {state_hash(s)[:12]}, not {h[:12]}")
        return self._adopt(s._replace(data=None))

    # ---- rounds --------------------------------------------------------------------------------
    def _rounds(self) -> Outcome:
        if self.cfg.overlap:
            from intellect_jax.diloco.overlap import overlapped_rounds

            return overlapped_rounds(self)
        p, cfg, H = self.p, self.cfg, self.cfg.inner_steps
        s = self.state
        assert s is not None
        k, h = s.outer_step, state_hash(s)
        p.client.hold(k, h)
        report = None  # on the last all-reduce, for the coordinator (sent with the next barrier)
        while k < self.stop_at:
            t0 = p.clock.now()
            self.t_first = self.t_first if self.t_first is not None else t0
            last = p.inner.train(until=(k + 1) * H)
            t1 = p.clock.now()
            o = self.outer(s, p.inner.pseudo_gradient(s.outer_params), report)
            s, report = o.state, o.report
            p.inner.set_params(s.outer_params)
            self.state, k, h = s, s.outer_step, state_hash(s)
            p.client.hold(k, h)
            sync_s = p.clock.now() - t1
            self._serve(o.ep, s)
            if self.due(cfg.ckpt_every, k):
                p.store.save(s._replace(inner_opt_state=p.inner.live_opt_state(), data=p.inner.data_state()))
            compute_s = t1 - t0
            self._pending = {**o.row(h), "sync_s": sync_s, "compute_s": compute_s,
                             "utilization": compute_s / max(compute_s + sync_s, 1e-9), "elapsed_s": self.elapsed(),
                             "round_start_s": t0 - self.t_first,
                             **({"val_loss": p.inner.evaluate()} if self.due(cfg.eval_every, k) else {})}
            self._say(k, o, last, sync_s, h)
        return self._finish(k, h, report)

    def elapsed(self) -> float:
        """Seconds since this node's first round began: Σ compute_s / elapsed_s is its utilization."""
        return self.p.clock.now() - self.t_first if self.t_first is not None else 0.0

    def due(self, every: int, k: int) -> bool:
        """Whether a checkpoint/evaluation every ``every`` inner steps falls on outer step ``k``."""
        return bool(every and (k * self.cfg.inner_steps) % every == 0) or k == self.stop_at

    def _say(self, k: int, o: OuterResult, last: dict[str, Any], sync_s: float, h: str) -> None:
        self.p.log(f"outer step {k}: epoch {o.ep.epoch_id} ({o.ep.world_size} nodes), loss "
                   f"{last.get('loss', float('nan')):.4f}, sync {sync_s:.2f}s, "
                   f"sent {o.stats.bytes_sent / 2**20:.2f} MiB, hash {h[:12]}")

    def _finish(self, k: int, h: str, report: dict | None) -> Outcome:
        p = self.p
        p.client.sync(k, h, report=report)  # the last barrier records the final hash (and completes the run)
        self._confirm(k, h)
        self._wait_serving()
        p.client.leave()
        return Outcome.FINISHED if k >= self.cfg.outer_steps else Outcome.STOPPED

    def outer(self, s: DilocoState, pg: Any, report: dict | None) -> OuterResult:
        """Outer step ``s.outer_step`` -> +1 with this node's pseudo-gradient: own check, barrier and
        all-reduce (retried over new epochs), check of the average, Nesterov step."""
        p, H = self.p, self.cfg.inner_steps
        k, h = s.outer_step, state_hash(s)
        scale = tree_norm(s.outer_params) if len(s.norms) < self.guard.min_history else None
        pg_norm, sits_out = self.own.check(pg, scale)
        if sits_out:  # a broken contribution stays home: zeros, and the others are told
            p.log(f"WARNING sitting out outer step {k + 1}: this node's pseudo-gradient has {sits_out}")
            pg = jax.tree.map(np.zeros_like, pg)
        avg, ep, stats, tries, suspect = self._all_reduce(k, h, pg, sits_out, report)
        self._confirm(k, h)
        avg, avg_norm, skip = self._vet(s, avg, ep, scale)
        if skip:  # every node holds the same bits, so every node skips
            p.log(f"WARNING outer step {k + 1} skipped: the average has {skip}")
            s = s._replace(outer_step=k + 1, inner_step=(k + 1) * H)
        else:
            s = outer_step(s, avg, self.tx, inner_step=(k + 1) * H)._replace(norms=remember(s.norms, avg_norm, self.guard))
        if suspect:
            p.log(f"WARNING {ep.node_ids[suspect[0]]}'s contribution to outer step {k + 1} had {suspect[1]}")
        report = {"avg_failed": bool(skip), "accused": [ep.node_ids[suspect[0]], suspect[1]] if suspect else None}
        return OuterResult(s, ep, stats, tries, report, pg_norm, avg_norm, sits_out, skip, None if skip else avg)

    def _confirm(self, k: int, h: str) -> None:
        """Barrier ``k`` completed with us in it: the run recorded ``h`` for outer step ``k``."""
        row = self._pending
        if row is not None and row["outer_step"] == k and row["outer_hash"] == h:
            self.p.inner.record(k * self.cfg.inner_steps, row)
            self._pending = None

    def _vet(self, s: DilocoState, avg: Any, ep: Epoch, scale: float | None) -> tuple[Any, float, str | None]:
        """The average of the nodes that contributed (the ring's mean counts zeros for those that
        sat out), its norm, and why it must not be applied (None: fine)."""
        n = ep.world_size - len(ep.sitting_out)
        if n <= 0:
            return avg, 0.0, "no contribution (every node sat out)"
        if n < ep.world_size:
            scale = np.float32(ep.world_size / n)
            avg = jax.tree.map(lambda a: (a * scale).astype(np.float32), avg)
        norm, why = check_average(avg, s.norms, self.guard, scale)
        return avg, norm, why

    def _all_reduce(self, k: int, h: str, pg: Any, sits_out: str | None,
                    report: dict | None) -> tuple[Any, Epoch, Any, int, tuple[int, str] | None]:
        p, cfg = self.p, self.cfg
        retry_of = None
        for attempt in range(cfg.max_retries + 1):
            ep = p.client.sync(k, h, retry_of=retry_of, sits_out=sits_out, report=report if attempt == 0 else None)
            comm = p.ring(ep)
            comm.inspect = lambda theirs, ours: inspect(theirs, ours, self.guard)
            try:
                with abort_when(p.clock, lambda: p.client.epoch_broken(ep.epoch_id), comm.abort, cfg.watch_interval):
                    avg = comm.all_reduce_mean(pg)
                return avg, ep, comm.last_stats, attempt + 1, getattr(comm, "suspect", None)
            except NetError as e:
                p.log(f"all-reduce of outer step {k + 1} failed in epoch {ep.epoch_id}: {e}; retrying")
                retry_of = ep.epoch_id
            finally:
                comm.close()
        p.client.leave()
        raise Evicted(f"outer step {k + 1}: all-reduce failed {cfg.max_retries + 1} times; left to join again")

    def _serve(self, ep: Epoch, s: DilocoState) -> None:
        if not ep.serve:
            return
        snap = s._replace(inner_opt_state=self.p.inner.snapshot(), data=None)  # taken now, sent in the background
        meta = {"outer_step": s.outer_step, "inner_step": s.inner_step, "hash": state_hash(s), "norms": list(s.norms)}
        client, since = self.p.client, self.p.client.view_seq
        for joiner_id, joiner_addr in ep.serve:
            self.p.log(f"serving the state of outer step {s.outer_step} to {joiner_id}")
            self.p.serving.append(self.p.transport.serve(
                joiner_id, joiner_addr, snap, meta, lambda j=joiner_id: client.serving_revoked(j, since)))

    def _wait_serving(self) -> None:
        """Wait for this node's transfers to end; each gives up as soon as the coordinator no
        longer admits its joiner, so a node whose run is complete exits within seconds."""
        for done in self.p.serving:  # events set by the transport when a transfer ends
            done.wait(self.cfg.transfer_timeout)
        self.p.serving.clear()

    def _adopt(self, s: DilocoState) -> DilocoState:
        """Make ``s`` the node's state; the live inner optimizer state stays in the trainer."""
        self.p.inner.adopt(s)
        self.state = s._replace(inner_opt_state=None, data=None)
        return self.state
