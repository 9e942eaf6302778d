"""The DiLoCo outer loop of one node: the one implementation behind the real node
(:mod:`.node`), the in-process sweep benchmark and the fault simulation.

`NodeLoop` is handed its collaborators (:class:`~.parts.NodeParts`) instead of building them:
the inner trainer, the coordinator client, a ring factory, the state transport and the
checkpoint store, plus a clock. A node obtains its state one of three ways: founding a fresh
run, resuming from its own (or a shared) checkpoint, or joining and taking a live peer's state.
Then, per round: H inner steps, pseudo-gradient, barrier, ring all-reduce (retried over new
epochs), outer step, checkpoint, state streamed to the joiners this node donates to,
evaluation. One round loop runs synchronous and overlapped rounds alike (:mod:`.overlap`).

Recovery: any :class:`Evicted` (stalled, behind, diverged, a lost session) sends the node back
to registration with the state it holds; a joiner whose transfer fails or whose donor vanishes
asks to be admitted again. Metrics of outer step k are written once the coordinator has
recorded step k's hash (the next barrier returned), so no node ever logs a state that the run's
history did not keep.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import ValidationError

from intellect_jax.coordinator.claims import best
from intellect_jax.coordinator.clock import abort_when
from intellect_jax.coordinator.protocol import Admission, Epoch, Evicted, Record, Resume, RunCompleted
from intellect_jax.coordinator.schema import Steering
from intellect_jax.diloco.device_codec import DeviceContribution
from intellect_jax.diloco.guard import OwnGuard, check_average, remember
from intellect_jax.diloco.overlap import Gate, Round
from intellect_jax.diloco.parts import DilocoError, LoopConfig, NodeParts, Outcome, TransferFailed
from intellect_jax.diloco.state import DilocoState, hash_opening, host_copy, nesterov_sgd, outer_step, state_hash
from intellect_jax.diloco.transfer import vet_received
from intellect_jax.net.audit import MAX_CASE_BYTES, MAX_CASE_RANKS
from intellect_jax.net.errors import NetError, PeerTimeout
from intellect_jax.net.evidence import reference_rms, seal, verdict

__all__ = ["NodeLoop", "OuterResult", "claim_of"]


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
                "sat_out": self.sat_out, "skipped": self.skipped, "contributors": ep.world_size - len(ep.sitting_out),
                **({} if ep.data is None else {  # data leases: the run's account when this step's barrier formed
                    "tokens_trained": ep.data[0], "tokens_discarded": ep.data[1],
                    "goodput": round(ep.data[0] / sum(ep.data), 4) if sum(ep.data) else None})}


@jax.jit
def _shift(w: Any, e: Any, k: Any) -> Any:
    """``w - k * e`` leaf by leaf where both live (sharded alike)."""
    return jax.tree.map(lambda a, b: a - k * b, w, e)


def _finite(tree: Any) -> bool:
    """Every value finite (a residual kept on the devices is checked there)."""
    return all(bool(jnp.isfinite(x).all()) if isinstance(x, jax.Array) else np.isfinite(x).all()
               for x in jax.tree.leaves(tree))


def claim_of(s: DilocoState | None, records: Sequence[Record] = ()) -> Resume | None:
    """What a node holding ``s`` claims at registration, with the barrier record that proves it,
    if it kept one (``coordinator.claims``)."""
    if s is None:
        return None
    h = state_hash(s)
    return Resume(s.outer_step, state_hash=h, record=best(records, s.outer_step, h))


def round_report(failed: bool, ids: list[str], suspects: list, steered: list, opening: dict | None) -> dict:
    """Our report on the last round for the next sync (``coordinator.schema.Report``): whether
    its average failed our checks; the first member we hold a bad piece of (``suspects``: rank,
    why, evidence) and the others in ``more``; the members our owner's weighing showed steering
    (``steered``: rank, evidence). The steering evidence and then the further accusations take
    at most ``MAX_CASE_BYTES`` and ``MAX_CASE_RANKS`` entries each; the rest is only logged."""
    accusations = [{"accused": [ids[r], why], "evidence": {**ev, "opening": opening}} for r, why, ev in suspects]
    report = {"avg_failed": failed, **(accusations[0] if accusations else {"accused": None, "evidence": None})}
    size = 0
    if steered:  # (net.evidence.outsized: the coordinator evicts a member most of the others show so)
        report["steering"] = shown = []
        for r, ev in steered:  # what the coordinator's schema takes, as many as a sync carries
            entry = {"accused": ids[r], **ev}
            try:
                Steering.model_validate(entry)
            except ValidationError:
                continue
            size += sum(len(x or "") + 200 for x in ev["payloads"])
            if size <= MAX_CASE_BYTES and len(shown) < MAX_CASE_RANKS:
                shown.append(entry)
    more: list[dict] = []
    for a in accusations[1:]:  # one per accused (a butterfly owner sees every member's pieces), as many as fit
        size += len(json.dumps(a))
        if size <= MAX_CASE_BYTES and len(more) < MAX_CASE_RANKS:
            more.append(a)
    if more:
        report["more"] = more
    return report


class NodeLoop:
    """One node's part in a DiLoCo run, from registration to leaving (:meth:`run`).

    Phases: *obtain a state* (resume the checkpoint the store holds or found the run from the
    seeded initial state, and register with it; a joiner waits for admission and receives a
    live donor's state through the store, :meth:`_join`); *rounds* (:meth:`_rounds`): H inner
    steps, then the outer step (:meth:`outer`: own check, barrier, all-reduce retried over new
    epochs, check of the average, Nesterov), checkpoint, serving the joiners this node donates
    to, evaluation, the metrics row; *finish*: the last barrier records the final hash, then
    leave. An :class:`Evicted` anywhere goes back to registration with the state held.

    It owns the outer state (:attr:`state`: host fp32 params and momentum, no inner optimizer
    state or data position, which stay in the trainer), the outer optimizer, the guard of its
    own pseudo-gradients, the newest outer step's metrics row until the run confirms its hash,
    and the clock origin of its rows. Everything else (trainer, coordinator, ring, transport,
    store) is handed in and only driven from here.
    """

    def __init__(self, cfg: LoopConfig, parts: NodeParts) -> None:
        self.cfg, self.p = cfg, parts
        self.tx = nesterov_sgd(cfg.outer_lr, cfg.outer_momentum)
        self.guard = cfg.guard
        self.own = OwnGuard(cfg.guard)  # this node's own pseudo-gradient norms
        self.state: DilocoState | None = None  # the outer state this node holds
        self._pending: dict[str, Any] | None = None  # metrics of the newest outer step, until recorded
        self._opened: tuple[DilocoState, dict[str, Any], str] | None = None  # the last state hashed
        self.t_first: float | None = None  # when this node's first round began (rows carry elapsed_s)
        # local feedback: the host params the running round started from (its pseudo-gradient's
        # anchor on the host path; None: the outer params), and the start the trainer takes once
        # the outer params it holds are evaluated (synchronous rounds)
        self._anchor: Any = None
        self._then: Any = None

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
                reply = p.client.register(claim_of(held, p.store.book.records))
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
                reply = p.client.register(claim_of(held, p.store.book.records))
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
                s = self._receive(adm, held)
            except TransferFailed as e:
                p.log(f"state transfer from {adm.donor_id} failed ({e}); asking for another donor")
                requeue = True
                continue
            if p.client.state_received(adm.outer_step):
                p.log(f"restored the state of outer step {s.outer_step} (hash {state_hash(s)[:12]}) in "
                      f"{p.clock.now() - t0:.1f}s")
                return s
            requeue = True

    def _receive(self, adm: Admission, held: DilocoState | None = None) -> DilocoState:
        """The donor's state, once checked (:func:`~.transfer.vet_received`: nothing of the donor's
        is trusted unchecked), saved and restored through the store with this node's own data
        position: where its trainer is, or, before it trained in this process, where the state it
        ``held`` (its own checkpoint) left it, not at the start of its shard."""
        p = self.p
        try:
            meta, got = p.transport.receive(adm, p.inner.template(), lambda: p.client.admission_revoked(adm),
                                            self.cfg.transfer_timeout)
        except NetError as e:
            raise TransferFailed(str(e)) from e
        got, h = vet_received(adm, meta, got, self.cfg.inner_steps, p.inner.vet_opt_state)
        # one path to a state: through the checkpoint store, with this node's own data position
        # (the donor's is another shard's), so a crash before the next checkpoint resumes from it
        own = self.state is None and held is not None and held.data is not None  # (its trainer not there yet)
        p.store.save(got._replace(data=held.data if own else p.inner.data_state()), wait=True)  # type: ignore
        s = p.store.load(got.inner_step)
        if state_hash(s) != h:
            raise TransferFailed(f"the checkpoint of the received state hashes to {state_hash(s)[:12]}, not {h[:12]}")
        # (a joiner's feedback starts from zeros; its trainer goes to the data position only if it was not there)
        return self._adopt(s._replace(data=s.data if own else None, residual=None))

    # ---- rounds --------------------------------------------------------------------------------
    def _rounds(self) -> Outcome:
        """Rounds from the held state to the job's end, then the last barrier (see :mod:`.overlap`).

        At the window before round r (training paused; round r-1 just ended) round r-1's outer
        step is applied. Overlapped, round r trains on a thread meanwhile and merges the new
        outer params ``tau`` steps in. Synchronous, the same with no thread: the trainer takes
        the new outer params at once and round r trains here afterwards."""
        p, cfg = self.p, self.cfg
        assert self.state is not None
        k, h = self.state.outer_step, self._hash(self.state)[1]
        p.client.hold(k, h)
        # on the last all-reduce, for the coordinator (sent with the next barrier); a node that
        # resumed from its checkpoint, or a joiner, knows from the (hashed) state whether it was skipped
        held = self.state.skipped
        report = None if held is None else {"avg_failed": held, "accused": None, "evidence": None}
        ended: Round | None = None  # the round that ended at this window, its outer step not applied
        captured: Any = None  # its pseudo-gradient, captured on the devices (overlapped rounds)
        running: Round | None = None
        gate: Gate | None = None
        last: dict[str, Any] = {}  # the training metrics of the newest round
        r = k  # the round that starts at this window
        try:
            while True:
                beside = cfg.overlap and r < self.stop_at  # round r trains while round r-1's outer step runs
                ckpt = ended is not None and self.due(cfg.ckpt_every, r)
                keep = (p.inner.stash(), p.inner.data_state()) if ckpt and beside else None  # to the host below
                idle_s = p.clock.now() - ended.t1 if ended is not None and ended.t1 is not None else 0.0
                gate = Gate(p.clock) if beside and ended is not None else None
                running = self._round(r, gate, thread=True) if beside else None
                closed = None  # round r-1's outer step (beside round r or before it) and its row
                if ended is not None:
                    closed = self._close(ended, captured, report, gate, ckpt=ckpt, keep=keep, idle_s=idle_s)
                    report, k, h = closed[0].report, closed[0].state.outer_step, closed[1]["outer_hash"]
                if running is None:  # nothing trained beside the outer step
                    if closed is not None:
                        self._publish(*closed, last, held=True)
                        closed = None
                    if r >= self.stop_at:
                        break
                    running = self._round(r, None, thread=False)  # synchronous: round r trains here
                last = running.join()  # ---- the next window -------------------------------------
                ended, running = running, None
                if closed is not None:
                    closed[1]["delay_steps"] = ended.delay  # the round that merged this average
                    self._publish(*closed, last, held=False)
                captured = p.inner.capture() if cfg.overlap else None
                if cfg.overlap and getattr(p.inner, "encoder", None) is not None:  # launched before the
                    captured = p.inner.pull(captured, self.state.outer_params)  # next round's steps
                    captured.start(self.state.residual if cfg.feedback else None, cfg.feedback)
                r += 1
        finally:
            if running is not None:  # evicted or failed mid-round: the trainer is left idle first
                if gate is not None:
                    gate.shut()
                running.done.wait()
        return self._finish(k, h, report)

    def _close(self, ended: Round, captured: Any, report: dict | None, gate: Gate | None, *, ckpt: bool,
               keep: tuple[Any, Any] | None, idle_s: float) -> tuple[OuterResult, dict[str, Any]]:
        """Close round ``ended``: its outer step, held as the node's state; its outer params to the
        round training beside (``gate``) or, when none does, to the trainer; the checkpoint if due
        (``keep``: the optimizer state and data position stashed at the window, else the live
        ones); its metrics row. ``captured``: its pseudo-gradient (overlapped rounds)."""
        p, s = self.p, self.state
        assert s is not None
        t1 = p.clock.now()
        if isinstance(captured, DeviceContribution):  # its encoding started at the window
            pg = captured
        else:
            anchor = s.outer_params if self._anchor is None else self._anchor  # where the round started
            pg = p.inner.pull(captured, s.outer_params) if self.cfg.overlap else p.inner.pseudo_gradient(anchor)
        o = self.outer(s, pg, report)
        s = o.state
        if gate is None:  # nothing trains: the trainer takes the outer params now (and then its next start)
            start = self._start(s, placed=False, last=s.outer_step >= self.stop_at)
            evaluated = start is not s.outer_params and self.due(self.cfg.eval_every, s.outer_step)
            p.inner.set_params(s.outer_params if evaluated else start)
            self._then = start if evaluated else None
        self.state, h = s, self._hash(s)[1]
        p.client.hold(s.outer_step, h)
        sync_s = p.clock.now() - t1
        if gate is not None:
            gate.open(self._start(s, placed=True))  # host -> device off the training path
        if ckpt:  # off the training thread, after the gate opened
            opt, data = (host_copy(keep[0]), keep[1]) if keep else (p.inner.live_opt_state(), p.inner.data_state())
            p.store.save(s._replace(inner_opt_state=opt, data=data))
        return o, self._row(o, h, ended, sync_s, idle_s)

    def _round(self, r: int, gate: Gate | None, *, thread: bool) -> Round:
        """Round r's inner steps, on a thread merging what ``gate`` brings (overlapped) or here;
        with data leases, on the units the coordinator leased this node for round r."""
        tau, H = self.cfg.overlap_delay, self.cfg.inner_steps  # tau None: merge when ready
        if self.cfg.data_units is not None:
            u, tokens, stream = self.cfg.data_units
            units = self.p.client.lease(r, H, u, tokens, stream)
            self.p.inner.lease(r, [(a * u, b * u) for a, b in units])
        rd = Round(self.p.inner, self.p.clock, (r + 1) * H, merge_at=None if tau is None else r * H + tau,
                   gate=gate, thread=thread)
        self.t_first = rd.t0 if self.t_first is None else self.t_first
        return rd

    def _row(self, o: OuterResult, h: str, ended: Round, sync_s: float, idle_s: float) -> dict[str, Any]:
        """The metrics row of outer step ``o`` (made from round ``ended``); ``idle_s``: the
        trainer's pause at the window before the next round."""
        compute_s, t_first = ended.compute_s, self.t_first
        assert t_first is not None
        row = {**o.row(h), "sync_s": sync_s, "compute_s": compute_s}
        if self.cfg.overlap:  # the trainer waited at the merge point and the window only
            wait_s = ended.wait_s + idle_s
            row |= {"overlap_wait_s": wait_s, "utilization": compute_s / max(compute_s + wait_s, 1e-9),
                    "delay_steps": 0}
        else:  # the trainer waited for the whole outer step
            row["utilization"] = compute_s / max(compute_s + sync_s, 1e-9)
        return row | {"elapsed_s": self.elapsed(), "round_start_s": ended.t0 - t_first}

    def _publish(self, o: OuterResult, row: dict[str, Any], last: dict[str, Any], *, held: bool) -> None:
        """At a window: serve the joiners of ``o``'s epoch with its state, evaluate it if due
        (``held``: the trainer holds its outer params; else they are evaluated from the host),
        queue its row (written once the next barrier confirms it) and say it."""
        s = o.state
        self._serve(o.ep, s)
        if self.due(self.cfg.eval_every, s.outer_step):
            row["val_loss"] = self.p.inner.evaluate(None if held else s.outer_params)
        if self._then is not None:  # the outer params evaluated: the next round's start now
            self.p.inner.set_params(self._then)
            self._then = None
        self._pending = row
        self._say(s.outer_step, o, last, row["sync_s"], row["outer_hash"])

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
        opening, h = self._hash(s)  # opened: the scale pieces are judged by (net.evidence)
        k = s.outer_step
        scale = opening["scale"] if len(s.norms) < self.guard.min_history else None
        pg_norm, sits_out = self.own.check(pg, scale)
        on_devices = isinstance(pg, DeviceContribution)
        if sits_out:  # a broken contribution stays home: zeros, and the others are told
            p.log(f"WARNING sitting out outer step {k + 1}: this node's pseudo-gradient has {sits_out}")
            pg = pg if on_devices else jax.tree.map(np.zeros_like, pg)
        ref = reference_rms(opening["scale"], opening["numel"])
        finite = None  # whether the next residual is finite (None: checked below)
        if on_devices:  # encoded where it lives, error feedback included
            pg, made, finite = self._encoded(s, pg, sits_out)
            dropped = None
        else:
            pg, dropped = self._with_feedback(s, pg, sits_out)
            made = dropped
        avg, ep, stats, tries, (suspects, steered), present = self._all_reduce(k, h, pg, sits_out, report, ref,
                                                                              dropped)
        residual = s.residual if made is None else made
        if residual is not None and not (self.cfg.feedback and (_finite(residual) if finite is None else finite)):
            if self.cfg.feedback:
                p.log(f"WARNING outer step {k + 1}: the error-feedback residual is not finite; starting it anew")
            residual = None  # feedback off (e.g. another codec since the checkpoint), or a broken one
        self._confirm(k, h)
        avg, avg_norm, skip = self._vet(s, avg, ep, scale, present)
        if skip:  # every node holds the same bits, so every node skips
            p.log(f"WARNING outer step {k + 1} skipped: the average has {skip}")
            s = s._replace(outer_step=k + 1, inner_step=(k + 1) * H, skipped=True)
        else:
            s = outer_step(s, avg, self.tx, inner_step=(k + 1) * H)._replace(norms=remember(s.norms, avg_norm, self.guard))
        s = s._replace(residual=residual)
        for r, why, _ in suspects:
            p.log(f"WARNING {ep.node_ids[r]}'s contribution to outer step {k + 1} had {why}")
        for r, ev in steered:
            p.log(f"WARNING {ep.node_ids[r]}'s own pieces of our segment in outer step {k + 1}'s all-reduce were "
                  f"outsized in most pieces ({ev['ratio']:.1f}x the median row in piece {ev['piece']})")
        report = round_report(bool(skip), ep.node_ids, suspects, steered, opening if ref is not None else None)
        return OuterResult(s, ep, stats, tries, report, pg_norm, avg_norm, sits_out, skip, None if skip else avg)

    def _with_feedback(self, s: DilocoState, pg: Any, sits_out: str | None) -> tuple[Any, Any]:
        """(contribution, buffer for what its encoding drops): ``pg`` plus ``feedback`` x the
        residual under error feedback (added into ``pg``'s own arrays: a pseudo-gradient is
        made fresh for each outer step), else ``pg`` and None. A node that sits out sends zeros
        and keeps its residual for the next round (None). The residual's own arrays are never
        written: a checkpoint being saved, or the state kept after an eviction, may hold them."""
        fb = self.cfg.feedback
        if not fb or sits_out:
            return pg, None
        dropped = jax.tree.map(lambda g: np.empty(np.shape(g), np.float32), pg)
        if s.residual is None:
            return pg, dropped

        def add(g: Any, e: np.ndarray, d: np.ndarray) -> np.ndarray:
            g = g if isinstance(g, np.ndarray) and g.dtype == np.float32 and g.flags.writeable else \
                np.array(g, np.float32)
            np.multiply(e, np.float32(fb), out=d)  # d: scratch until the exchange writes it
            return np.add(g, d, out=g)

        return jax.tree.map(add, pg, s.residual, dropped), dropped

    def _encoded(self, s: DilocoState, pg: DeviceContribution, sits_out: str | None) -> tuple[Any, Any, bool | None]:
        """(the contribution encoded on the devices, the next residual there or None: keep the
        old one, whether it is finite): ``_with_feedback`` where the pseudo-gradient lives."""
        fb = self.cfg.feedback
        if sits_out:  # zeros made on the host, and the residual kept for the next round
            return pg.encode(None, 0.0, True)[0], None, None
        enc, nxt, finite = pg.encode(s.residual if fb else None, fb, False)
        return (enc, nxt, finite) if fb else (enc, None, None)

    def _start(self, s: DilocoState, *, placed: bool, last: bool = False, vet: bool = False) -> Any:
        """Where the next round starts: the outer params, less ``feedback_local x feedback x`` the
        residual under local feedback (the outer params after the ``last`` round). ``placed``: on
        the devices (:meth:`Inner.place`; an overlapped round's merge point), else as the trainer
        takes them at the window (and then, on the host, the anchor of the round's host
        pseudo-gradient; the device paths measure from where the trainer's params were set).
        A residual kept on the devices shifts the placed params there, one on the host the host
        params. ``vet``: a residual not made by this loop's last outer step (a checkpoint's, a
        held state's) shifts nothing unless finite; the next outer step starts a broken one anew."""
        k = np.float32(self.cfg.feedback_local * self.cfg.feedback)
        e = None if last or not k else s.residual
        if e is not None and vet and not _finite(e):
            e = None
        self._anchor = None
        if e is None:
            return self.p.inner.place(s.outer_params) if placed else s.outer_params
        if isinstance(jax.tree.leaves(e)[0], jax.Array):  # the device encoder's residual
            w = self.p.inner.place(s.outer_params)
            at = jax.tree.map(lambda a: a.sharding, w if isinstance(jax.tree.leaves(w)[0], jax.Array) else e)
            return _shift(jax.device_put(w, at), jax.device_put(e, at), k)  # sharded alike: no collectives
        start = jax.tree.map(lambda w, r: np.subtract(w, k * r, dtype=np.float32), s.outer_params, e)
        if placed:
            return self.p.inner.place(start)
        self._anchor = start
        return start

    def _hash(self, s: DilocoState) -> tuple[dict[str, Any], str]:
        """(opening, hash) of ``s`` (:func:`~.state.hash_opening`), computed once per state: a
        window hashes the new state, and the next outer step needs it again (a pass over
        every outer param and momentum value). States are never changed in place."""
        if self._opened is None or self._opened[0] is not s:
            o = hash_opening(s)
            self._opened = (s, o, seal(o["core"], o["numel"], o["scale"]))
        return self._opened[1], self._opened[2]

    def _confirm(self, k: int, h: str) -> None:
        """Barrier ``k`` completed with us in it: the run recorded ``h`` for outer step ``k`` (and
        the record the coordinator signed of it is kept with the checkpoints)."""
        r = self.p.client.record
        if r is not None and (r.outer_step, r.state_hash) == (k, h):
            try:
                self.p.store.book.keep(r)
            except OSError as e:  # (a full disk: the record only helps a coordinator that lost its journal)
                self.p.log(f"WARNING could not keep the coordinator's record of outer step {k}: {e}")
        row = self._pending
        if row is not None and row["outer_step"] == k and row["outer_hash"] == h:
            self.p.inner.record(k * self.cfg.inner_steps, row)
            self._pending = None

    def _vet(self, s: DilocoState, avg: Any, ep: Epoch, scale: float | None,
             present: bool = False) -> tuple[Any, float, str | None]:
        """The average of the nodes that contributed (the ring's mean counts zeros for those that
        sat out; ``present``: the exchange left them out already), its norm, and why it must not
        be applied (None: fine)."""
        n = ep.world_size - len(ep.sitting_out)
        if n <= 0:
            return avg, 0.0, "no contribution (every node sat out)"
        if n < ep.world_size and not present:
            up = np.float32(ep.world_size / n)  # (not ``scale``: that is the outer params' norm, the early bound)
            avg = jax.tree.map(lambda a: (a * up).astype(np.float32), avg)
        norm, why = check_average(avg, s.norms, self.guard, scale)
        return avg, norm, why

    def _all_reduce(self, k: int, h: str, pg: Any, sits_out: str | None, report: dict | None,
                    ref: float | None,
                    dropped: Any = None) -> tuple[Any, Epoch, Any, int, tuple[tuple[int, str, dict] | None,
                                                                          list[tuple[int, dict]]], bool]:
        p, cfg = self.p, self.cfg
        retry_of = None
        for attempt in range(cfg.max_retries + 1):
            ep = p.client.sync(k, h, retry_of=retry_of, sits_out=sits_out, report=report)
            report = None  # (the report on the last round goes with the first try only)
            try:
                comm = p.ring(ep)
            except NetError as e:  # e.g. a member's address that is no address: this epoch fails
                p.log(f"no ring for outer step {k + 1} in epoch {ep.epoch_id}: {e}; retrying")
                retry_of = ep.epoch_id
                continue
            comm.inspect = lambda theirs: verdict(theirs, ref)  # the own pieces it receives
            comm.absent = frozenset(ep.node_ids.index(n) for n in ep.sitting_out if n in ep.node_ids)
            try:
                with abort_when(p.clock, lambda: p.client.epoch_broken(ep.epoch_id), comm.abort, cfg.watch_interval):
                    avg = comm.all_reduce_mean(pg) if dropped is None else comm.all_reduce_mean(pg, dropped=dropped)
                suspect = getattr(comm, "suspect", None)
                suspects = getattr(comm, "suspects", None) or ([suspect] if suspect else [])
                return avg, ep, comm.last_stats, attempt + 1, (suspects, getattr(comm, "steered", [])), \
                    comm.over_present
            except NetError as e:
                p.log(f"all-reduce of outer step {k + 1} failed in epoch {ep.epoch_id}: {e}; retrying")
                retry_of = ep.epoch_id
                report = self._failed(k, ep, comm)
            finally:
                comm.close()
        p.client.leave()
        raise Evicted(f"outer step {k + 1}: all-reduce failed {cfg.max_retries + 1} times; left to join again")

    def _failed(self, k: int, ep: Epoch, comm: Any) -> dict | None:
        """Our report on a failed call, for the retry's sync: the case, if our audit failed it
        (:mod:`~intellect_jax.net.audit`), whose own pieces never reached us (the butterfly), and
        after an all-gather that failed once the signed digests went round (:mod:`~intellect_jax.net.gather`)
        our holding of each origin and the ranks' signed digest lists: an origin's signatures on
        two versions of a piece convict it, and a list against the ring's majority that no holding
        signed by the origin bears out convicts its signer."""
        audited, missing = getattr(comm, "audited", None), getattr(comm, "missing", ())
        held, vouched = getattr(comm, "held", []), getattr(comm, "vouched", [])
        if held:
            self.p.log(f"outer step {k + 1}'s all-reduce failed once the ranks' digest lists went round; ours, "
                       "theirs and our holdings go to the coordinator")
        if audited:
            self.p.log(f"WARNING our audit in outer step {k + 1}'s all-reduce shows {ep.node_ids[audited[0]]} at "
                       f"fault: {audited[1]}" + ("" if audited[2] else " (the case is too large to report)"))
        if missing:
            self.p.log(f"outer step {k + 1}'s all-reduce: the own pieces of "
                       f"{', '.join(ep.node_ids[r] for r in missing)} never reached us")
        if not audited and not missing and not held and not vouched:
            return None
        return {"avg_failed": False, "accused": None, "evidence": None, "audit": audited[2] if audited else None,
                "missing": {"step": k, "epoch": ep.epoch_id, "nodes": [ep.node_ids[r] for r in missing]}
                if missing else None, "holdings": held or None, "vouches": vouched or None}

    def _serve(self, ep: Epoch, s: DilocoState) -> None:
        if not ep.serve:
            return
        # taken now, sent in the background; the data position and the error feedback are this node's own
        snap = s._replace(inner_opt_state=self.p.inner.snapshot(), data=None, residual=None)
        meta = {"outer_step": s.outer_step, "inner_step": s.inner_step, "hash": state_hash(s), "norms": list(s.norms),
                "skipped": s.skipped}
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
        start = self._start(s, placed=False, vet=True)
        if self.cfg.data_units is not None:  # leased data: a data position means nothing (each round is leased)
            s = s._replace(data=None)
        self.p.inner.adopt(s if start is s.outer_params else s._replace(outer_params=start))
        self.state = s._replace(inner_opt_state=None, data=None)
        return self.state
